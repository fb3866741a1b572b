"""The store itself is checked: fsck runs the database's integrity check, `run` refuses a
corrupt store (exit 2), `status` exits 2 on an unreadable one (real `grpod` subprocesses)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from grpod.forensics.store import Store
from tests.daemon.helpers import cli, run_to_end, write_config

pytestmark = pytest.mark.slow


def test_corrupt_and_unreadable_stores_are_refused(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {"task": "copy", "prompts_per_step": 2, "group_size": 2, "threads": 1},
            "daemon": {"metrics": False, "log_format": "json", "checkpoint_every": 2},
        },
    )
    run_to_end(["--config", str(config), "--run-dir", "run", "--max-steps", "4"], tmp_path)
    assert cli("fsck", "--run-dir", "run", cwd=tmp_path).returncode == 0
    assert Store(tmp_path / "run").integrity_problems() == []

    shutil.copytree(tmp_path / "run", tmp_path / "pages")
    with open(tmp_path / "pages" / "grpod.sqlite", "r+b") as fh:  # pages 4-5 overwritten
        fh.seek(3 * 4096)
        fh.write(os.urandom(2 * 4096))
    checked = cli("fsck", "--run-dir", "pages", cwd=tmp_path)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "problem: store sqlite:///" in checked.stdout
    assert "malformed" in checked.stdout, checked.stdout
    before = (tmp_path / "pages" / "grpod.sqlite").read_bytes()
    refused = cli("run", "--config", str(config), "--run-dir", "pages", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "refusing to write into it" in refused.stderr
    assert (tmp_path / "pages" / "grpod.sqlite").read_bytes() == before  # nothing written

    shutil.copytree(tmp_path / "run", tmp_path / "noise")
    (tmp_path / "noise" / "grpod.sqlite").write_bytes(os.urandom(64 * 1024))
    status = cli("status", "--run-dir", "noise", cwd=tmp_path)
    assert status.returncode == 2 and status.stdout == "", status
    assert status.stderr.count("\n") == 1 and "file is not a database" in status.stderr


@pytest.mark.postgres
def test_a_postgres_store_answers_its_integrity_check(tmp_path: Path) -> None:
    url = os.environ.get("GRPOD_TEST_PG_URL")
    if not url:
        pytest.skip("GRPOD_TEST_PG_URL not set (make test starts the server)")
    store = Store(tmp_path, url)
    try:
        store.upgrade()
        assert store.integrity_problems() == []
        store.check_schema()
    finally:
        store.close()
