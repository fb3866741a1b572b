"""The two structure checks `make lint` runs besides ruff: the duplicate counter
(scripts/check_duplicates.py) and the layering contract (scripts/lint_imports.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BLOCK = "\n".join(f"value_{i} = compute({i}, scale)  # step {i}" for i in range(8))


def test_a_shared_run_is_one_pair_whatever_its_length() -> None:
    dup = _script("check_duplicates")
    a = dup.code_lines(f"import os\n\ndef f():\n{BLOCK}\n    return 1\n")
    b = dup.code_lines(f"from x import (\n    y,\n)\n# why\n{BLOCK}\nother = 2\n")
    pairs = dup.duplicate_pairs({"a.py": a, "b.py": b}, 6)
    assert [(n, pa[1:], pb[1:]) for n, pa, pb in pairs] == [(8, (4, 11), (5, 12))]
    assert dup.duplicate_pairs({"a.py": a, "b.py": dup.code_lines(BLOCK[:120])}, 6) == []


def test_blank_comment_and_import_lines_do_not_count() -> None:
    dup = _script("check_duplicates")
    text = "import os\nfrom a import (\n    b,\n    c,\n)\n\n# note\nx  =   1\n)\n"
    assert dup.code_lines(text) == [(8, "x = 1")]


def test_the_tree_is_within_its_duplicate_budget() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_duplicates.py")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout


@pytest.mark.skipif(
    not Path(sys.executable).with_name("lint-imports").exists(), reason="import-linter (dev)"
)
def test_the_layering_contract_fails_on_a_violation(tmp_path: Path) -> None:
    """Sampling importing training breaks the contract; the tree as it is keeps it."""
    lint = _script("lint_imports")
    assert subprocess.run([sys.executable, str(ROOT / "scripts/lint_imports.py")],
                          capture_output=True).returncode == 0  # fmt: skip
    lint.lay_out(tmp_path)
    sampling = tmp_path / "grpod/engine/rollout/sampling.py"
    sampling.write_text(sampling.read_text() + "\nfrom grpod.engine.train import loss\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    run = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "pyproject.toml", "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert "grpod.engine.rollout.sampling -> grpod.engine.train" in run.stdout


def test_relayout_moves_old_names_once() -> None:
    """A pre-layers branch's imports and paths move to the sub-packages; new ones stay."""
    rewrite = _script("relayout").rewriter()
    old = (
        "from grpod.engine.train.stats import StepStats\n"
        "from grpod.engine.model.policy import TINY_QWEN2\n"
        "from grpod.engine.state import distcp\n"
        "from grpod import collectives, torchrun\n"
        "# engine/grpo/eval.py, grpod/base/fileio.py, tests.engine.rollout.test_ahead\n"
    )
    new = rewrite(old)
    assert new == (
        "from grpod.engine.train.stats import StepStats\n"
        "from grpod.engine.model.policy import TINY_QWEN2\n"
        "from grpod.engine.state import distcp\n"
        "from grpod.base import collectives, torchrun\n"
        "# engine/grpo/eval.py, grpod/base/fileio.py, tests.engine.rollout.test_ahead\n"
    )
    assert rewrite(new) == new
