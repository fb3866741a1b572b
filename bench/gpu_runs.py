"""GPU node check, the sections that run real `grpod` and `pytest` processes.

- `tests`: `pytest -m gpu`, then tests/engine with `GRPOD_TEST_DEVICE=cuda` (every engine
  test's config then asks for that device; tests/engine/helpers.py);
- `campaign`: `grpod run` on W1 and a W3-shaped model (bf16 trunk), torch sampler with the
  fused decoder: median seconds per step by phase over steps 3..N, completions/s, peak RSS and
  peak GPU memory of the process (nvidia-smi, polled);
- `replay`: a short W1 run and `grpod replay` of its last step, under the default settings,
  with `CUBLAS_WORKSPACE_CONFIG=:4096:8`, and with that and
  `torch.use_deterministic_algorithms(True)` as well (set in the process before grpod runs);
- `fsdp2`: the W1 campaign under `torchrun --nproc-per-node 1` with `[engine] parallel =
  "fsdp2"` and a bf16 trunk (FSDP2's MixedPrecisionPolicy); skipped on a checkout whose
  EngineConfig lacks that key.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from common import GROUP_SIZE, PROMPTS_PER_STEP, ROOT
from gpu_numerics import TINY_TRUNK
from w3_mfu import save_w3_model

GRPOD = str(Path(sys.executable).with_name("grpod"))
# W1 as the daemon runs it (shared/bench/WORKLOADS.md), and a dry run's tiny version of it
W1 = {"task": "arith"}
TINY = {"task": "copy", "prompts_per_step": 4, "group_size": 4, "seq_len": 16, "max_new_tokens": 2}
W3 = {"task": "arith", "max_new_tokens": 32, "prompts_per_step": 8, "group_size": 8}
DETERMINISTIC = "import torch; torch.use_deterministic_algorithms(True); "
NVIDIA_SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# ------------------------------------------------------------------ tests
def tests(dry_run: bool) -> dict[str, Any]:
    device = "cpu" if dry_run else "cuda"
    # a dry run runs one small file: the command and the report parse
    engine = ["tests/engine/data/test_advantages.py"] if dry_run else ["tests/engine"]
    with tempfile.TemporaryDirectory() as tmp:
        return {
            "gpu_marked": {"status": "not run in a dry run"}
            if dry_run
            else _pytest(["tests", "-m", "gpu"], {}, Path(tmp) / "gpu.xml", 40),
            "engine_on_device": {
                "device": device,
                **_pytest(engine, {"GRPOD_TEST_DEVICE": device}, Path(tmp) / "engine.xml", 150),
            },
        }


def _pytest(args: list[str], env: dict[str, str], junit: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "120"]
    cmd += [f"--junitxml={junit}", *args]
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"").decode(errors="replace").strip()[-600:]
        return {"status": "timeout", "reason": f"over {timeout:.0f} s", "output_tail": tail}
    if not junit.exists():
        return {"exit": proc.returncode, "error": (proc.stdout + proc.stderr).strip()[-600:]}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = []
    for case in suite.iter("testcase"):
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad  # an Element with no children is falsy
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines() or [""]
            failed.append(
                {
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "message": message[0][:240],
                }
            )
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"exit": proc.returncode, **counts, "failed": failed[:40]}


# ------------------------------------------------------------------ campaigns
def campaign(dry_run: bool) -> dict[str, Any]:
    device = "cpu" if dry_run else "cuda"
    steps = 1 if dry_run else 12
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_w3_model(str(tmp / "w3-model"), **(TINY_TRUNK if dry_run else {}))
        w3 = {**W3, "model": str(tmp / "w3-model")}
        if dry_run:
            w3.update(TINY, task="arith")
        runs = {}
        if not dry_run:  # a dry run's replay section runs W1 the same way
            runs["W1"] = run_grpod(tmp / "w1", {**W1, "device": device}, steps)
        runs["W3_bf16"] = run_grpod(
            tmp / "w3", {**w3, "device": device, "dtype": "bfloat16"}, steps
        )
    return {"runs": runs, "status": _worst(runs.values())}


def run_grpod(
    run_dir: Path,
    engine: dict[str, Any],
    steps: int,
    *,
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """`grpod run` of `steps` steps in `run_dir`; its step events summarised."""
    from grpod.daemon.config import validate
    from grpod.daemon.example import dump_toml

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config = validate(
        {
            "engine": {"seed": 0, **engine},
            "daemon": {
                "metrics_port": 0,
                "log_format": "json",
                "progress": "off",
                "checkpoint_every": max(1, steps // 2),
            },
        }
    )
    path = run_dir.with_suffix(".toml")
    path.write_text(dump_toml(config))
    cmd = [*(launcher or [GRPOD]), "run", "--config", str(path), "--run-dir", str(run_dir)]
    cmd += ["--max-steps", str(steps)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    memory = _MemoryPoll(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    memory.stop()
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    out = {
        "status": "ok" if proc.returncode == 0 else "failed",
        "exit": proc.returncode,
        "wall_seconds": round(time.perf_counter() - started, 2),
        "engine": engine,
        **summarise_steps([e for e in events if e.get("event") == "step"], engine),
        **memory.peaks(),
        "run_dir": str(run_dir),
    }
    if proc.returncode != 0:
        out["reason"] = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    return out


def summarise_steps(steps: list[dict[str, Any]], engine: dict[str, Any]) -> dict[str, Any]:
    """Median seconds per step and per phase over steps 3..N (all, with fewer), rates."""
    if not steps:
        return {"steps": 0}
    window = steps[2:] or steps
    phases = {
        name: round(statistics.median(s["phase_seconds"].get(name, 0.0) for s in window), 5)
        for name in window[0]["phase_seconds"]
    }
    per_step = statistics.median(sum(s["phase_seconds"].values()) for s in window)
    completions = engine.get("prompts_per_step", PROMPTS_PER_STEP) * engine.get(
        "group_size", GROUP_SIZE
    )
    return {
        "steps": len(steps),
        "median_s_per_step": round(per_step, 5),
        "median_phase_seconds": phases,
        "completions_per_s": round(completions / per_step, 1),
        "reward_first_last": [steps[0].get("reward_mean"), steps[-1].get("reward_mean")],
        "outcomes": sorted({s.get("outcome") for s in steps}),
    }


class _MemoryPoll:
    """Peak RSS (/proc VmHWM) and GPU memory (nvidia-smi) of one process, polled."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        self.pid, self.every = pid, every
        self.rss_mib, self.gpu_mib, self.gpu_note = 0.0, None, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(self.every):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                hwm = next(line for line in status.splitlines() if line.startswith("VmHWM"))
                self.rss_mib = max(self.rss_mib, int(hwm.split()[1]) / 1024)
            except (OSError, StopIteration):
                pass
            self._gpu()

    def _gpu(self) -> None:
        if self.gpu_note is not None:
            return
        try:
            text = subprocess.run(
                NVIDIA_SMI_APPS,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.gpu_note = f"nvidia-smi: {type(exc).__name__}"
            return
        for line in text.splitlines():
            pid, _, used = line.partition(",")  # "1234, 5678 MiB"
            used = used.strip().removesuffix("MiB").strip()
            if pid.strip() == str(self.pid) and used.isdigit():
                self.gpu_mib = max(self.gpu_mib or 0.0, float(used))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def peaks(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_rss_mib": round(self.rss_mib, 1)}
        out["peak_gpu_mib"] = self.gpu_mib
        if self.gpu_mib is None:
            out["peak_gpu_note"] = self.gpu_note or "the process never showed in nvidia-smi"
        return out


# ------------------------------------------------------------------ replay
def replay(dry_run: bool) -> dict[str, Any]:
    """Record a short W1 run and replay its last step, under each determinism setting."""
    engine = {**(TINY if dry_run else W1), "device": "cpu" if dry_run else "cuda"}
    steps = 2 if dry_run else 4
    settings = {
        "default": ([GRPOD], {}),
        "cublas_workspace": ([GRPOD], CUBLAS),
        "deterministic_algorithms": (_python_grpod(DETERMINISTIC), CUBLAS),
    }
    if dry_run:  # the campaign section runs plain `grpod run`; this the other launcher
        settings = {"deterministic_algorithms": settings["deterministic_algorithms"]}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (launcher, env) in settings.items():
            run = run_grpod(Path(tmp) / name, engine, steps, launcher=launcher, env=env)
            out[name] = {"env": env, "torch_deterministic": launcher != [GRPOD]}
            if run["status"] != "ok":
                out[name].update(status="failed", reason=run.get("reason"))
                continue
            out[name].update(
                _replay_step(launcher, env, Path(run["run_dir"]), steps - 1), status="ok"
            )
    out["status"] = _worst(out.values())
    return out


def _python_grpod(prelude: str) -> list[str]:
    """`grpod` as `python -c`: `prelude` runs in the process before the command does."""
    return [
        sys.executable,
        "-c",
        prelude + "import sys; from grpod.daemon.cli import main; sys.exit(main(sys.argv[1:]))",
    ]


def _replay_step(launcher: list[str], env: dict[str, str], run_dir: Path, step: int) -> dict:
    proc = subprocess.run(
        [*launcher, "replay", "--run-dir", str(run_dir), "--step", str(step), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"replay_exit": proc.returncode, "reason": proc.stderr.strip()[-300:]}
    recorded, replayed = result["recorded"], result["replayed"]
    return {
        "step": step,
        "reproduced": result["reproduced"],
        "diverged_at": result.get("diverged_at"),
        "field": result.get("field"),
        "differences": {
            k: _difference(recorded[k], replayed[k]) for k in recorded if k in replayed
        },
    }


def _difference(recorded: Any, replayed: Any) -> dict[str, Any]:
    if not isinstance(recorded, (int, float)) or not isinstance(replayed, (int, float)):
        return {"recorded": recorded, "replayed": replayed}
    delta = abs(replayed - recorded)
    return {"abs": delta, "rel": delta / abs(recorded) if recorded else None}


# ------------------------------------------------------------------ FSDP2 under torchrun
def fsdp2_available() -> str | None:
    """Why the FSDP2 campaign cannot run yet, or None when `[engine] parallel` takes it."""
    from pydantic import ValidationError

    from grpod.engine import EngineConfig

    if "parallel" not in EngineConfig.model_fields:
        return "skipped: scale-out not landed (EngineConfig has no `parallel` key)"
    try:
        EngineConfig.model_validate({"parallel": "fsdp2"})
    except ValidationError:
        return 'skipped: scale-out not landed (`parallel = "fsdp2"` is not accepted)'
    return None


def fsdp2(dry_run: bool) -> dict[str, Any]:
    reason = fsdp2_available()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    engine = {**TINY, "device": "cpu"} if dry_run else {**W1, "device": "cuda", "dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        # torch's agent's own directory in this one, not one left in /tmp per check
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
        launcher += ["--log-dir", str(Path(tmp) / "torchelastic"), GRPOD]
        run = run_grpod(
            Path(tmp) / "fsdp2",
            {**engine, "parallel": "fsdp2"},
            2 if dry_run else 12,
            launcher=launcher,
        )
    return {"run": run, "backend": "gloo" if dry_run else "nccl", "status": run["status"]}


def _worst(parts: Any) -> str:
    statuses = {p.get("status", "ok") for p in parts if isinstance(p, dict)}
    return "ok" if statuses <= {"ok"} else "failed"
