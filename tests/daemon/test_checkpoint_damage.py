"""A damaged checkpoint, as a user meets it: `grpod fsck` names it and says which checkpoint
resume would choose; `grpod run` passes over a damaged newest one (a warning naming it) and
refuses, exit 2 in one line, when none is complete. And DCP's CheckpointException, a
BaseException, is one line too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.daemon.helpers import Grpod, run_to_end, tiny_config

pytestmark = pytest.mark.slow

NEWEST = 4


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 5])


DAMAGE = {  # what is done to the newest checkpoint, and the problem fsck must name
    "model truncated": (lambda d: _truncate(d / "model.safetensors"), "model.safetensors: trunc"),
    "optimizer truncated": (
        lambda d: _truncate(d / "optimizer.safetensors"),
        "optimizer.safetensors: truncated",
    ),
    "cursor truncated": (
        lambda d: _truncate(d / "cursor.safetensors"),
        "cursor.safetensors: trunc",
    ),
    "state.json deleted": (lambda d: (d / "state.json").unlink(), "no state.json"),
    "state.json garbled": (
        lambda d: (d / "state.json").write_text('{"format": "grpod.chec'),
        "state.json unreadable",
    ),
    "emptied": (lambda d: [p.unlink() for p in d.iterdir()], "no state.json"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run (epochs 2: the cursor holds the generation's batch, a cursor.safetensors),
    checkpoints at steps 0, 2 and 4."""
    where = tmp_path_factory.mktemp("damage")
    config = tiny_config(where / "grpod.toml", 0, {"epochs": 2})
    run_to_end(["--config", str(config), "--run-dir", "run", "--max-steps", str(NEWEST)], where)
    assert (where / "run" / "checkpoints" / f"step-{NEWEST:08d}" / "cursor.safetensors").is_file()
    return where / "run"


def _damaged_copy(run: Path, where: Path, damage: str) -> Path:
    copy = where / "run"
    shutil.copytree(run, copy)  # no hard links between the copy's checkpoints
    DAMAGE[damage][0](copy / "checkpoints" / f"step-{NEWEST:08d}")
    return copy


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_fsck_names_a_damaged_checkpoint_and_the_one_resume_takes(
    run: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from grpod.daemon.cli import main

    copy = _damaged_copy(run, tmp_path, damage)
    assert main(["fsck", "--run-dir", str(copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoints_checked"] == 3 and report["resume_step"] == 2
    (problem,) = report["problems"]
    assert problem.startswith(f"checkpoint step {NEWEST} (") and DAMAGE[damage][1] in problem
    assert [report["resume"]] == [
        f"resume would restore checkpoint step 2, passing over step {NEWEST}"
    ]


def test_fsck_of_a_healthy_run_says_ok_and_where_resume_starts(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from grpod.daemon.cli import main

    assert main(["fsck", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        f"resume would restore checkpoint step {NEWEST}",
        out[-1],
    ] and out[-1].endswith("3 checkpoints checked, ok")


def test_resume_passes_over_a_damaged_newest_checkpoint_and_refuses_when_none_is_whole(
    run: Path, tmp_path: Path
) -> None:
    copy = _damaged_copy(run, tmp_path, "cursor truncated")
    resumed = Grpod(["--run-dir", "run", "--max-steps", str(NEWEST + 1)], tmp_path)
    assert resumed.wait() == 0, resumed.stderr
    skipped = resumed.event("skipped a damaged checkpoint")
    assert (skipped["step"], skipped["resume_from"]) == (NEWEST, 2)
    assert "cursor.safetensors: truncated" in skipped["problem"]
    assert resumed.event("started")["resumed_from"] == 2
    # the steps after the checkpoint taken are re-run (and recorded as re-runs), then step 4
    assert [(e["step"], e.get("rerun", False)) for e in resumed.steps()] == [
        (2, True),
        (3, True),
        (4, False),
    ]
    for checkpoint in (copy / "checkpoints").iterdir():  # now every checkpoint is damaged
        _truncate(checkpoint / "model.safetensors")
    before = sorted(p.relative_to(copy) for p in copy.rglob("*"))
    refused = Grpod(["--run-dir", "run"], tmp_path)
    assert refused.wait() == 2
    size = (copy / "checkpoints" / f"step-{NEWEST + 1:08d}" / "model.safetensors").stat().st_size
    assert refused.stderr.splitlines() == [
        "grpod run: error: run dir run: no complete checkpoint to resume from (checkpoint "
        f"step {NEWEST + 1}: model.safetensors: truncated ({size} bytes, its header says "
        f"{size + 5}))"
    ]
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == before  # nothing written


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_a_truncated_dcp_shard_is_one_line_not_a_base_exception(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from grpod.engine.errors import EngineError
    from grpod.engine.model.parallel import Parallel
    from grpod.engine.state import distcp
    from grpod.engine.state.checkpoint import save_checkpoint

    class Weights:
        DCP_KEYS = ("model",)

        def __init__(self) -> None:
            self.model = {"w": torch.arange(4096, dtype=torch.float32)}

        def state_dict(self, fqn: bool = False) -> dict:
            return {"model": self.model}

        def load_state_dict(self, state: dict) -> None:
            self.model = state["model"]

    where = tmp_path / "step-00000002"  # what `distcp.save` writes under torchrun, rank 0 alone
    dcp.save({"engine": {"model": Weights().model}}, checkpoint_id=str(where))
    save_checkpoint(where / "rank-0", {"engine": _Empty()})
    (where / "state.json").write_text(json.dumps({"format": distcp.FORMAT, "world_size": 1}))
    assert distcp.problems(where) == []
    (shard,) = where.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    (problem,) = distcp.problems(where)
    assert problem.startswith(f"{shard.name}: truncated (100 bytes, .metadata says ")
    with pytest.raises(EngineError) as caught:  # not DCP's CheckpointException
        distcp.load(where, {"engine": Weights()}, Parallel("none"))
    assert str(caught.value).startswith(f"checkpoint {where}: cannot load: rank 0: ")
    assert "\n" not in str(caught.value)


class _Empty:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
