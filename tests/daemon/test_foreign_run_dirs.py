"""Run dirs this grpod did not write as it writes them (a newer grpod's store, an older
grpod's run.json, no run.json at all): every reader says which file and why in one line,
exits 2 and changes nothing. Argument errors are one line too."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.helpers import cli, run_to_end, write_config

pytestmark = pytest.mark.slow

READERS = (
    ("status",),
    ("fsck",),
    ("incidents", "list"),
    ("incidents", "show", "1"),
    ("replay", "--step", "1"),
    ("export", "exported"),
    ("plot", "--out", "plots"),
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run dir of two steps on the tiny model."""
    root = tmp_path_factory.mktemp("recorded")
    config = write_config(
        root / "grpod.toml",
        {
            "engine": {"task": "copy", "prompts_per_step": 2, "group_size": 2, "threads": 1},
            "daemon": {"metrics": False, "log_format": "json", "progress": "off"},
        },
    )
    run = run_to_end(["--config", str(config), "--run-dir", "run", "--max-steps", "2"], root)
    assert run.proc.returncode == 0, run.stderr
    return root / "run"


def _digest(run_dir: Path) -> str:
    """Every file's bytes, the store's rows (a reader's connection may checkpoint the WAL
    into the file: the same rows in other bytes)."""
    h = hashlib.sha256()
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        if path.name.startswith("grpod.sqlite") or path.name == "lock":
            continue
        h.update(str(path.relative_to(run_dir)).encode())
        h.update(path.read_bytes())
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        for line in db.iterdump():
            h.update(line.encode())
    return h.hexdigest()


def _newer_schema(run_dir: Path) -> None:
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        db.execute("UPDATE alembic_version SET version_num = 'f00d'")


def _no_inputs(run_dir: Path) -> None:
    record = json.loads((run_dir / "run.json").read_text())
    del record["inputs"]
    (run_dir / "run.json").write_text(json.dumps(record) + "\n")


def _no_run_json(run_dir: Path) -> None:
    (run_dir / "run.json").unlink()


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (_newer_schema, "written by a newer grpod: schema revision f00d is newer than this grpod"),
        (_no_inputs, "run.json: no inputs digests: written by an older grpod"),
        (_no_run_json, "not a grpod run directory (no run.json)"),
    ],
)
def test_every_reader_refuses_a_foreign_run_dir_in_one_line(
    tmp_path: Path, recorded: Path, fake, reason: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(recorded, run_dir)
    fake(run_dir)
    before = _digest(run_dir)
    for reader in READERS:
        done = cli(*reader, "--run-dir", str(run_dir), cwd=tmp_path)
        assert done.returncode == 2, (reader, done.stderr)
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"grpod {reader[0]}: error: ") and reason in line, (reader, line)
        assert done.stdout == ""
    assert _digest(run_dir) == before
    assert not (tmp_path / "exported").exists() and not (tmp_path / "plots").exists()


# the reader refuses before it imports the engine: the run dir is read by the store alone
LIGHT_READ = """
import sys
from grpod.daemon.cli import main
codes = [main(reader + ["--run-dir", sys.argv[1]]) for reader in READERS]
print(codes, sorted({"torch", "safetensors"} & set(sys.modules)))
"""


def test_a_refusal_imports_no_torch_and_listing_incidents_needs_none(
    tmp_path: Path, recorded: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(recorded, run_dir)
    _newer_schema(run_dir)
    for run, readers, codes in (  # a foreign run dir's refusals; a run dir's light readers
        (run_dir, [list(r) for r in READERS], [2] * len(READERS)),
        (recorded, [["status"], ["incidents", "list"]], [0, 0]),
    ):
        script = f"READERS = {readers!r}\n" + LIGHT_READ
        done = subprocess.run(
            [sys.executable, "-c", script, str(run)], capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
        last = done.stdout.splitlines()[-1]
        assert last == f"{codes} []", last  # the exit codes; neither module was imported


def test_the_recorded_run_dir_itself_is_read(tmp_path: Path, recorded: Path) -> None:
    done = cli("status", "--run-dir", str(recorded), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "last recorded step 1" in done.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("incidents", "show", "1", "--samples", "-1"), "argument --samples: must be >= 0: -1"),
        (("run", "--max-steps", "x"), "argument --max-steps: not a number: 'x'"),
        (("status", "--nope"), "unrecognized arguments: --nope"),
        (("frobnicate",), "argument COMMAND: invalid choice: 'frobnicate'"),
    ],
)
def test_an_argument_error_is_one_line(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    done = cli(*args, cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("grpod") and ": error: " in line and needle in line, line
    assert list(tmp_path.iterdir()) == []
