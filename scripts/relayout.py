"""Rewrite the pre-layers module names of a branch started before the engine's sub-packages.

`grpod.engine.grpo.trainer` is `grpod.engine.grpo.trainer` now, `grpod.base.fileio` is
`grpod.base.fileio`, `engine/rollout/ahead.py` is `engine/rollout/ahead.py`, and so on (`MOVES`).
Git's merge follows the renamed files, but an import or path a branch adds in its own lines
still names the old place: after merging such a branch, run

    python scripts/relayout.py            # every tracked text file; or name the files

then `ruff check --fix --select I .` (import order) and `make lint`. It is idempotent: a name
already in its new place is left alone. Lines it cannot rewrite alone (`from grpod.engine
import distcp`: a submodule through the package) are printed for a hand. Delete this script
once no branch from before the relayout is left.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOVES = {  # sub-package: old module[:new name] ...
    "data": "tokenizer tasks rewardcall rewards packing advantages inputs",
    "model": "model:policy lora fused trunk kvdecoder flat parallel",
    "rollout": "torch_sampler stop_strings vllm_limits rollout_vllm vllm_server rollout_server "
    "sampling ahead",
    "train": "accounting loss layout kvmask forward_backward optim stats",
    "state": "cursor state:engine_state checkpoint distcp export",
    "grpo": "trainer build assemble step eval preflight samples",
}
TESTS = {  # tests/engine/test_X.py -> tests/engine/<package>/test_X.py
    "data": "tasks rewards advantages packing",
    "model": "model lora fused trunk kvdecoder parallel flat chunked_head",
    "rollout": "torch_sampler stop_strings rollout_vllm rollout_server ahead",
    "train": "loss accounting trunk_passes",
    "state": "checkpoint",
    "grpo": "trainer",
}
BASE = ("fileio", "jsonsafe", "oneline", "lazy", "torchrun", "collectives")
TEXT = (".py", ".md", ".toml", ".sh", ".txt", ".ini", ".yml", ".yaml", ".cfg")


def mapping() -> dict[str, str]:
    """Old dotted module name -> new."""
    moved = {f"grpod.{m}": f"grpod.base.{m}" for m in BASE}
    for package, modules in MOVES.items():
        for entry in modules.split():
            old, _, new = entry.partition(":")
            moved[f"grpod.engine.{old}"] = f"grpod.engine.{package}.{new or old}"
    for package, names in TESTS.items():
        for name in names.split():
            moved[f"tests.engine.test_{name}"] = f"tests.engine.{package}.test_{name}"
    return moved


def path_of(module: str) -> str:
    if module.startswith("grpod.engine."):
        module = "engine." + module[len("grpod.engine.") :]
    return module.replace(".", "/") + ".py"


def rewriter():
    moved = mapping()
    # the old `model` and `state` modules are package names now: `grpod.engine.model.fused`
    # is already new (a submodule follows), `grpod.engine.model.policy.load_policy` is old, and
    # the bare name is left alone (which it means is for a reader to say)
    submodules = {
        f"grpod.engine.{package}": {p.stem for p in (ROOT / "engine" / package).glob("*.py")}
        for package in ("model", "state")
    }
    names = "|".join(re.escape(k) for k in sorted(moved, key=len, reverse=True))
    dotted = re.compile(rf"(?<![\w.])({names})(?![\w])(\.\w+|\s+import\s+[\w, ]+)?")
    paths = {path_of(k): path_of(v) for k, v in moved.items()}
    path_names = "|".join(re.escape(k) for k in sorted(paths, key=len, reverse=True))
    pathre = re.compile(rf"(?<![\w.])((?:grpod/)?)({path_names})(?!\w)")

    def dotted_sub(match: re.Match) -> str:
        old, tail = match.group(1), match.group(2) or ""
        inside = submodules.get(old)
        if inside is None:
            return moved[old] + tail
        if not tail:
            return match.group(0)
        if tail.startswith(".") and tail[1:] in inside:
            return match.group(0)  # already new: a submodule of the package
        if "import" in tail:
            imported = {n.strip() for n in tail.split("import", 1)[1].split(",")}
            if imported & inside:
                return match.group(0)  # `from grpod.engine.state import distcp`: new
        return moved[old] + tail

    def rewrite(text: str) -> str:
        text = dotted.sub(dotted_sub, text)
        text = pathre.sub(lambda m: m.group(1) + paths[m.group(2)], text)
        base = "|".join(BASE)
        return re.sub(rf"^(\s*)from grpod import ((?:{base})(?:, (?:{base}))*)$",
                      r"\1from grpod.base import \2", text, flags=re.M)  # fmt: skip

    return rewrite


PUBLIC = re.compile(r"^\s*from grpod\.engine import (.+)$", re.M)


def main(argv: list[str]) -> int:
    files = (
        argv
        or subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    )
    rewrite = rewriter()
    changed = 0
    for name in files:
        path = ROOT / name
        if not path.is_file() or not (name.endswith(TEXT) or path.name == "Makefile"):
            continue
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            path.write_text(new)
            changed += 1
        for match in PUBLIC.finditer(new):
            if any(n.strip() in {"distcp", "state", "trainer"} for n in match.group(1).split(",")):
                print(f"{name}: by hand: {match.group(0).strip()}")
    print(f"relayout: {changed} files rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
