"""What both sides of a W1/W1c comparison share: model, tokenizer, prompts, reward, settings.

grpod and TRL get the identical random-init Qwen2 (`engine.model.policy.build_tiny_qwen2`, torch
seed 0, tied embeddings), the same 512 prompts (`engine.data.tasks`), the same character vocab
and the same reward rule. Each side runs in its own spawned process (separate peak RSS and
thread pool) and steps only when the parent says "go", so the two sides interleave step by
step and never compete for the two cores (see `run_interleaved`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # scripts run as `python bench/x.py` from the repo root
    sys.path.insert(0, str(ROOT))
if os.environ.get("GRPOD_BENCH_PACKAGES"):  # another checkout's grpod packages (engine_ab.py)
    sys.path.insert(0, os.environ["GRPOD_BENCH_PACKAGES"])

import torch  # noqa: E402

from grpod.engine.data.tokenizer import ARITH_CHARS, BOS, EOS, PAD, SPECIALS  # noqa: E402

# W2 (bench/WORKLOADS.md) as an engine config: long prompts, 256-token rows in 4 sequence
# chunks, one row per micro (the torchrun benches' setting, and the torchrun tests')
from tests.daemon.helpers import W2_ENGINE  # noqa: E402

THREADS = 2
GROUP_SIZE = 8
PROMPTS_PER_STEP = 16
MAX_NEW_TOKENS = 4
LR = 1e-3
OUT_DIR = ROOT / "bench" / "out"


def numeric_options(doc: str, **defaults: int | float) -> argparse.Namespace:
    """A bench's command line of numeric options only: `--first-seed` for `first_seed=0`,
    of its default's type, described by the first line of the script's `doc`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser.parse_args()


def scaleout_parser(steps: int, warmup: int) -> argparse.ArgumentParser:
    """A scale-out bench's command line: `--steps` timed after `--warmup` untimed ones, and the
    hidden options it starts its own workers with (`--worker`, `--parallel`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parallel", default="fsdp2", help=argparse.SUPPRESS)
    return parser


# ------------------------------------------------------------------ model, tokenizer, task


def build_model(vocab_size: int = len(SPECIALS) + len(ARITH_CHARS), **overrides: Any):
    """The W1 Qwen2 (or W3 with `overrides`): random init under torch seed 0, FP32, tied."""
    from grpod.engine.model.policy import build_tiny_qwen2

    return build_tiny_qwen2(vocab_size, 64, seed=0, **overrides)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the state dict, to show both sides start from identical weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_hf_tokenizer(chars: str = ARITH_CHARS):
    """A local `PreTrainedTokenizerFast` with the engine's ids: one token per character.

    `<pad>`=0, `<bos>`=1, `<eos>`=2, then `chars` in order (what `CharTokenizer` assigns);
    encoding a text prepends `<bos>` as the engine does; decoding concatenates.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({ch: i + len(SPECIALS) for i, ch in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[PAD]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[BOS]} $A", special_tokens=[(SPECIALS[BOS], BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[BOS],
        eos_token=SPECIALS[EOS],
        pad_token=SPECIALS[PAD],
    )


def task_prompts(task: str) -> list[tuple[str, str]]:
    """`(prompt text, answer)` for the 512 W1 (`arith`) or W1c (`copy`) prompts."""
    from grpod.engine.data.tasks import build_task

    return [(p.text, p.answer) for p in build_task(task).prompts]


def w2_trl_task(steps: int) -> tuple[list[tuple[str, str]], str, dict]:
    """W2 for TRL: grpod's per-step kv-retrieval prompts (W2_SETTINGS' long-batch fraction,
    engine seed 0) for `steps` steps in step order, the task's characters, and the TRL
    settings that differ from W1's (4 prompts x 4 completions, no shuffling, so that TRL's
    step i trains on grpod's step-i prompts)."""
    from grpod.engine.data.tasks import build_task

    task = build_task("kv-retrieval", long_batch_fraction=W2_SETTINGS["long_prompt_batch_fraction"])
    n = W2_ENGINE["prompts_per_step"]
    prompts = [(p.text, p.answer) for s in range(steps) for p in task.prompts_for_step(s, n, 0)]
    group = W2_ENGINE["group_size"]
    settings = {
        "per_device_train_batch_size": n * group,
        "num_generations": group,
        "shuffle_dataset": False,
    }
    return prompts, task.chars, settings


def completion_reward(completion_ids: list[int], answer: str, chars: str = ARITH_CHARS) -> float:
    """The engine's reward rule on token ids: the first character of the decoded completion.

    The engine decodes with `CharTokenizer.decode` (stop at `<eos>`, drop `<pad>`/`<bos>`)
    and rewards 1.0 iff the text starts with the answer digit; this is that rule, so TRL is
    scored exactly as grpod is.
    """
    from grpod.engine.data.tokenizer import CharTokenizer

    text = CharTokenizer(chars).decode(list(completion_ids))
    return 1.0 if text[:1] == answer[:1] else 0.0


# ------------------------------------------------------------------ the two sides
# `--pin`: a server side's server on one core and its trainer on the other (a node where the
# sampler has its own device); the other sides share both cores as usual
TRAINER_CPU, SERVER_CPU = 0, 1


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process (and what it starts from now on) onto `cpus`."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


def set_threads() -> None:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


# W2 `long-prompt` (shared/bench/WORKLOADS.md): 256-token rows of 64-token chunks, a chunked
# head, a quarter of the batches all-long-prompt
W2_SETTINGS = {
    "seq_len": 256,
    "sequence_chunks": 4,
    "lmhead_chunks": 4,
    "long_prompt_batch_fraction": 0.25,
}


def engine_config(task: str, **overrides: Any):
    """grpod's W1 settings (the EngineConfig defaults are W1), 2 threads; or, for a
    grpod.toml `task`, its `[engine]` as `grpod run` loads it (`toml_engine_config`)."""
    from grpod.engine import EngineConfig

    if task.endswith(".toml"):
        base = toml_engine_config(task).model_dump()
        return EngineConfig.model_validate({**base, **overrides})
    return EngineConfig.model_validate({"task": task, "threads": THREADS, "lr": LR, **overrides})


W4_TOML = ROOT / "examples" / "smollm2-arith" / "grpod.toml"


def workload_config(workload: str, **overrides: Any):
    """W1, W2 or W4 (shared/bench/WORKLOADS.md) as an EngineConfig with `overrides`: W2 with
    the torchrun benches' rows (W2_ENGINE) and W2_SETTINGS, 4 rows a micro; W4 the example
    campaign's `[engine]`."""
    if workload == "W4":
        return engine_config(str(W4_TOML), **overrides)
    if workload == "W2":
        keys = ("seq_len", "sequence_chunks", "lmhead_chunks", "prompts_per_step", "group_size")
        w2 = {**{k: W2_ENGINE[k] for k in keys}, **W2_SETTINGS, "micro_batch_rows": 4}
        return engine_config("kv-retrieval", **{**w2, **overrides})
    return engine_config("arith", **overrides)


def toml_engine_config(path: str | os.PathLike):
    """A campaign's `[engine]` (W4: examples/smollm2-arith/grpod.toml) as `grpod run` loads it
    from the config's directory: model, task and eval task made absolute, `reward_path` the
    directory (its reward modules import from there)."""
    from grpod.daemon.config import load_config
    from grpod.engine.data.inputs import absolute

    path = Path(path).resolve()
    return absolute(load_config(path).engine, cwd=path.parent)


TRL_CHANGED = {
    "learning_rate": (LR, "W1 lr 1e-3 (TRL default 1e-6)"),
    "lr_scheduler_type": ("constant", "W1/W1c constant lr (TRL default linear decay)"),
    "bf16": (False, "W1 is FP32 on CPU (TRL default bf16=True)"),
    "gradient_checkpointing": (False, "the faster setting (TRL default True)"),
    "per_device_train_batch_size": (PROMPTS_PER_STEP * GROUP_SIZE, "128 completions per step"),
    "num_generations": (GROUP_SIZE, "8 completions per prompt (also the default)"),
    "max_completion_length": (MAX_NEW_TOKENS, "4 new tokens (TRL default 512)"),
    "use_cpu": (True, "CPU run"),
    "report_to": ("none", "no tracker"),
    "save_strategy": ("no", "no checkpoints during the benchmark"),
    "disable_tqdm": (True, "no progress bar on the benchmark's stdout"),
    "seed": (0, "seed 0 as grpod"),
}


# grpod settings that match what TRL does and grpod's defaults do not
GRPOD_MATCHES_TRL = {
    "advantage_std": "sample",  # TRL divides by the n - 1 std (grpod's default: n)
}


def toml_trl_changed(engine) -> dict[str, tuple[Any, str]]:
    """TRL's settings for a grpod.toml campaign (W4): W1's TRL_CHANGED with the campaign's
    batch, completion budget, sampling, optimizer and reward weights in place of W1's."""
    batch = engine.prompts_per_step * engine.group_size
    return {
        **TRL_CHANGED,
        "learning_rate": (engine.lr, f"the campaign's lr {engine.lr:g} (TRL default 1e-6)"),
        "max_grad_norm": (engine.max_grad_norm, "the campaign's max_grad_norm"),
        "per_device_train_batch_size": (
            batch,
            f"{engine.prompts_per_step} prompts x {engine.group_size} completions per step",
        ),
        "num_generations": (engine.group_size, "the campaign's group size (TRL default 8)"),
        "max_completion_length": (
            engine.max_new_tokens,
            f"{engine.max_new_tokens} new tokens (TRL default 512)",
        ),
        "temperature": (engine.temperature, "the campaign's sampling temperature"),
        "top_p": (engine.top_p, "the campaign's top_p"),
        "reward_weights": (
            list(engine.reward_weights) or None,
            "the campaign's reward_weights (weighted sum, as grpod)",
        ),
    }


def trl_config(max_steps: int, output_dir: str, seed: int = 0, **overrides: Any):
    from trl import GRPOConfig

    settings = {k: v for k, (v, _) in TRL_CHANGED.items()}
    return GRPOConfig(
        output_dir=output_dir, max_steps=max_steps, **{**settings, "seed": seed, **overrides}
    )


def _grpod_worker(conn, task: str, overrides: dict) -> None:
    set_threads()
    from grpod.engine import Engine

    engine = Engine(engine_config(task, **overrides))
    conn.send(("ready", weights_digest(engine.model)))
    while conn.recv() == "go":
        started = time.perf_counter()
        batch = engine.rollout()
        report = engine.accumulate(batch)
        engine.apply()
        seconds = time.perf_counter() - started
        tokens = int(batch.completion_lengths.sum())
        phases = engine.take_phase_seconds()
        conn.send(("step", seconds, report.reward_mean, tokens, phases))
    conn.send(("done", peak_rss_mib(), engine.state_digest()))


def _trl_worker(conn, task: str, max_steps: int, seed: int = 0, guarded: bool = False) -> None:
    """TRL's GRPOTrainer on `task`; `guarded`: grpod.integrations.trl's GuardedGRPOTrainer
    (every guard and the flight recorder on, a run dir beside TRL's output dir)."""
    set_threads()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- TRL prints its log dicts; not ours
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    last: dict[str, float] = {}
    if task.endswith(".toml"):  # a grpod.toml campaign (W4): its model, prompts and rewards
        dataset, reward_funcs, model, tokenizer, overrides = toml_trl_task(task, last)
    else:
        if task == "kv-retrieval":  # W2: per-step prompts, 256-token positions, 4 x 4 per step
            prompts, chars, overrides = w2_trl_task(max_steps + 1)
            from grpod.engine.model.policy import build_tiny_qwen2

            model = build_tiny_qwen2(len(SPECIALS) + len(chars), W2_ENGINE["seq_len"])
        else:
            prompts, chars, overrides, model = task_prompts(task), ARITH_CHARS, {}, build_model()
        dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in prompts])

        def reward(prompts, completions, completion_ids, answer, **_) -> list[float]:
            values = [completion_reward(ids, a, chars) for ids, a in zip(completion_ids, answer)]
            last["reward"] = sum(values) / len(values)
            last["tokens"] = sum(len(ids) for ids in completion_ids)
            return values

        reward_funcs, tokenizer = [reward], build_hf_tokenizer(chars)

    class Lockstep(TrainerCallback):
        """Blocks at every step start until the parent says go; reports the step that ended."""

        started: float | None = None

        def _report(self) -> None:
            if self.started is not None:
                seconds = time.perf_counter() - self.started
                phases = {"grpod_s": last.pop("grpod_s")} if "grpod_s" in last else {}
                conn.send(("step", seconds, last["reward"], last["tokens"], phases))

        def on_step_begin(self, args, state, control, **kwargs):
            self._report()
            if conn.recv() != "go":
                raise _Stop
            self.started = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self._report()

    with tempfile.TemporaryDirectory() as out:
        cls, extra = GRPOTrainer, {}
        if guarded:
            from grpod.integrations.trl import GrpodTRLConfig, GuardedGRPOTrainer

            cls, extra = GuardedGRPOTrainer, {"grpod": GrpodTRLConfig(run_dir=f"{out}/run")}
        trainer = cls(
            model=model,
            reward_funcs=reward_funcs,
            args=trl_config(max_steps, f"{out}/trl", seed, **overrides),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Lockstep()],
            **extra,
        )
        if guarded:  # the integration's own seconds per step: the decision without inner.step()
            decide = trainer._grpod_decide

            def timed(apply):
                started, applying = time.perf_counter(), [0.0]

                def timed_apply():
                    begun = time.perf_counter()
                    apply()
                    applying[0] += time.perf_counter() - begun

                applied = decide(timed_apply)
                last["grpod_s"] = time.perf_counter() - started - applying[0]
                return applied

            trainer._grpod_decide = timed
        conn.send(("ready", weights_digest(trainer.model)))
        try:
            trainer.train()
            conn.recv()  # the parent's final "stop"
        except _Stop:  # stopped early, between steps
            pass
    conn.send(("done", peak_rss_mib(), None))


def toml_trl_task(path: str, last: dict[str, float]) -> tuple[Any, list, Any, Any, dict]:
    """TRL's side of a grpod.toml campaign (W4): the dataset (every task prompt, as chat
    messages under the system prompt when `prompt_format = "chat"`), one TRL reward function
    per grpod reward (each calls the same `module:function` with grpod's arguments: prompt
    text, completion text, answer; TRL weighs them by `reward_weights`), the model directory
    in FP32, its tokenizer, and `toml_trl_changed`'s settings. `last` gets the step's
    weighted mean reward and completion tokens, as the W1 reward records them."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpod.engine.data.inputs import use_reward_path
    from grpod.engine.data.tasks import config_task, load_reward

    engine = engine_config(path)
    use_reward_path(engine)  # the campaign's reward modules, as grpod's Engine imports them
    system = [{"role": "system", "content": engine.system_prompt}] if engine.system_prompt else []

    def prompt(text: str):
        return (
            [*system, {"role": "user", "content": text}] if engine.prompt_format == "chat" else text
        )

    rows = [
        {"prompt": prompt(p.text), "text": p.text, "answer": p.answer}
        for p in config_task(engine).prompts
    ]
    specs = list(engine.rewards) or [engine.reward]
    weights = list(engine.reward_weights) or [1.0] * len(specs)
    means: dict[str, tuple[float, float]] = {}

    def trl_reward(spec: str, weight: float):
        fn = load_reward(spec)

        def reward(prompts, completions, completion_ids, text, answer, **_) -> list[float]:
            completions = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            values = [float(fn(t, c, a)) for t, c, a in zip(text, completions, answer)]
            means[spec] = (weight, sum(values) / len(values))
            last["reward"] = sum(w * m for w, m in means.values())  # all of them, once the last ran
            last["tokens"] = sum(len(ids) for ids in completion_ids)
            return values

        reward.__name__ = spec.replace(":", ".")
        return reward

    model = AutoModelForCausalLM.from_pretrained(engine.model, dtype=torch.float32)
    return (
        Dataset.from_list(rows),
        [trl_reward(s, w) for s, w in zip(specs, weights)],
        model,
        AutoTokenizer.from_pretrained(engine.model),
        {k: v for k, (v, _) in toml_trl_changed(engine).items() if k != "seed"},  # the run's
    )


class _Stop(Exception):
    """The parent ended the run before TRL's max_steps."""


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_interleaved(
    task: str,
    steps: int,
    grpod_overrides: dict | None = None,
    stop: Callable[[dict], bool] | None = None,
    seed: int = 0,
    idle_gap: float = 0.0,
    progress_every: int = 25,
) -> dict[str, dict]:
    """Run up to `steps` steps of grpod and TRL in lock step; returns per-side traces.

    `seed` is each side's run seed (grpod's sampler and prompt order, TRL's `seed`); the
    model's initial weights stay those of torch seed 0 on both sides. `idle_gap` seconds of
    idle machine go before every step (bench/README.md: the ratio depends on the duty cycle).

    The order alternates every step (grpod first on even steps, TRL first on odd ones) so a
    slow spell on the shared machine hits both sides alike. `stop(trace)` ends the run early.
    """
    return run_lockstep(
        {
            "grpod": (
                _grpod_worker,
                (task, {**GRPOD_MATCHES_TRL, "seed": seed, **(grpod_overrides or {})}),
                {},
            ),
            "trl": (_trl_worker, (task, steps, seed), {}),
        },
        steps,
        stop,
        idle_gap,
        progress_every,
    )


def run_lockstep(
    specs: dict[str, tuple[Callable, tuple, dict[str, str]]],
    steps: int,
    stop: Callable[[dict], bool] | None = None,
    idle_gap: float = 0.0,
    progress_every: int = 25,
) -> dict[str, dict]:
    """Two workers `{name: (target, args, extra environment)}` stepped alternately, with
    `idle_gap` seconds of sleep before each step (not counted: each worker times itself)."""
    ctx = mp.get_context("spawn")
    sides = {}
    for name, (target, args, env) in specs.items():
        saved = dict(os.environ)
        os.environ.update(env)  # a spawned child starts with the parent's environment
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        # BENCH_PYTHON: this side's interpreter (another venv: TRL beside .venv-vllm's vLLM),
        # with its own sys.path (a spawned child takes the parent's) and this directory
        python, path = env.get("BENCH_PYTHON", sys.executable), list(sys.path)
        if python != sys.executable:
            own = subprocess.run(
                [python, "-c", "import json, sys; print(json.dumps(sys.path))"],
                capture_output=True,
                text=True,
                check=True,
            )
            sys.path[:] = [str(Path(__file__).parent), *json.loads(own.stdout)]
        ctx.set_executable(python)
        try:
            proc.start()
        finally:
            ctx.set_executable(sys.executable)
            sys.path[:] = path
        child.close()  # the child's end is the child's alone: its death is EOF here, not a hang
        os.environ.clear()
        os.environ.update(saved)
        sides[name] = {"conn": parent, "proc": proc}
    names = list(specs)
    trace: dict[str, dict] = {}
    for name, side in sides.items():
        kind, digest = side["conn"].recv()
        assert kind == "ready", kind
        trace[name] = {"weights": digest, "seconds": [], "reward": [], "tokens": [], "phases": []}
    for k in range(steps):
        order = names if k % 2 == 0 else names[::-1]
        for name in order:
            conn = sides[name]["conn"]
            if idle_gap:
                time.sleep(idle_gap)
            conn.send("go")
            kind, seconds, reward, tokens, phases = conn.recv()
            assert kind == "step", kind
            t = trace[name]
            t["seconds"].append(seconds)
            t["reward"].append(reward)
            t["tokens"].append(tokens)
            t["phases"].append(phases)
        if (k + 1) % progress_every == 0:  # progress on stderr; stdout carries only the JSON line
            print(
                f"step {k + 1}: "
                + ", ".join(
                    f"{n} {sum(trace[n]['seconds']):.1f} s reward {trace[n]['reward'][-1]:.2f}"
                    for n in names
                ),
                file=sys.stderr,
                flush=True,
            )
        if stop is not None and stop(trace):
            break
    for name, side in sides.items():
        side["conn"].send("stop")
        kind, rss, state_digest = side["conn"].recv()
        trace[name]["peak_rss_mib"] = rss
        trace[name]["state_digest"] = state_digest  # grpod's Engine.state_digest(); TRL: None
        side["proc"].join(timeout=60)
    return trace


# ------------------------------------------------------------------ reporting
def summarise(
    t: dict, first_step: int = 3, completions: int = PROMPTS_PER_STEP * GROUP_SIZE
) -> dict[str, float]:
    """Median s/step over steps `first_step`..N (1-based), rates (`completions` a step),
    RSS, reward first/last 5."""
    window = t["seconds"][first_step - 1 :]
    median = statistics.median(window)
    tokens = statistics.mean(t["tokens"][first_step - 1 :])
    return {
        "median_s_per_step": round(median, 5),
        "completions_per_s": round(completions / median, 2),
        "completion_tokens_per_s": round(tokens / median, 1),
        "peak_rss_mib": round(t["peak_rss_mib"], 1),
        "reward_first5": round(statistics.mean(t["reward"][:5]), 4),
        "reward_last5": round(statistics.mean(t["reward"][-5:]), 4),
    }


def compare(trace: dict[str, dict], completions: int = PROMPTS_PER_STEP * GROUP_SIZE) -> dict:
    """A grpod-vs-TRL trace's figures: each side's `summarise` (steps 3..N, `completions` a
    step), grpod's median phase seconds, and the grpod / TRL ratios."""
    g, t = (summarise(trace[name], completions=completions) for name in ("grpod", "trl"))
    phases = trace["grpod"]["phases"][2:]
    return {
        "same_initial_weights": trace["grpod"]["weights"] == trace["trl"]["weights"],
        "grpod": g,
        "trl": t,
        "grpod_phase_median_s": {
            k: round(statistics.median(p[k] for p in phases), 5) for k in phases[0]
        },
        "ratio_completions_per_s": round(g["completions_per_s"] / t["completions_per_s"], 2),
        "ratio_completion_tokens_per_s": round(
            g["completion_tokens_per_s"] / t["completion_tokens_per_s"], 2
        ),
        "ratio_peak_rss": round(g["peak_rss_mib"] / t["peak_rss_mib"], 2),
    }


def versions() -> dict[str, str]:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["transformers"] = transformers.__version__
    try:
        import trl

        out["trl"] = trl.__version__
    except ImportError:
        pass
    return out


def status_kib(key: str) -> int:
    """A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`)."""
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{key}:\s+(\d+)", fh.read()).group(1))


def reset_peak() -> float:
    """Reset the kernel's RSS high-water mark (`VmHWM`); returns the current RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return status_kib("VmRSS") / 1024


def in_child(target: Callable[..., None], *args: Any) -> dict:
    """`target(conn, *args)` in a fresh spawned process (its own peak RSS); what it sends."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    out = parent.recv()
    proc.join()
    return out


def bootstrap_ci95(
    values: list[float], statistic: Callable[[list[float]], float] = statistics.mean
) -> tuple[float, float]:
    """Percentile-bootstrap 95% interval of `statistic` over `values` (2000 resamples, seed 0)."""
    rng = random.Random(0)
    resamples = 2000
    stats = sorted(statistic(rng.choices(values, k=len(values))) for _ in range(resamples))
    return stats[int(0.025 * resamples)], stats[int(0.975 * resamples) - 1]


def emit(record: dict) -> None:
    """Print the one JSON line of a benchmark and append it to bench/out/results.jsonl: the
    record, then the host's context (versions, the benches' torch threads, CPUs, load) where
    the record does not say it itself (w4_vs_trl.py's `threads` are its two sides')."""
    context = {
        "versions": versions(),
        "threads": THREADS,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **record,
        **{key: value for key, value in context.items() if key not in record},
    }
    line = json.dumps(record, sort_keys=False)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with open(OUT_DIR / "results.jsonl", "a") as fh:
        fh.write(line + "\n")
    print(line, flush=True)
