"""No store password in any output or file, and run dirs others cannot read (docs/SECURITY.md).

The password reaches PostgreSQL's driver from outside the config (PGPASSWORD, PGPASSFILE);
a URL with a password in it is refused. A real run on a loose umask (000) leaves nothing in its
run dir that users other than the owner and group can read, and `grpod fsck` warns about a run
dir that they can. The PostgreSQL test connects as `grpod_pw`, a role that must give its
password (scripts/pg_test_server.sh creates it, scram-sha-256).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from tests.daemon.helpers import GRPOD, TINY_ENGINE, free_port, tiny_config

PASSWORD = "grpod-test-secret-5f1c"  # scripts/pg_test_server.sh's grpod_pw
PG_URL = os.environ.get("GRPOD_TEST_PG_URL", "")
STEPS = 3


def _grpod(*args: str, env: dict[str, str] | None = None, umask: int | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("PGPASS")}
    return subprocess.run(
        [GRPOD, *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),
    )


def _one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def test_a_password_in_the_store_url_is_refused(tmp_path: Path) -> None:
    url = "postgresql+psycopg://grpod_pw:hunter2-secret@127.0.0.1:1/grpod_pw"
    config = tiny_config(tmp_path / "grpod.toml", free_port())
    config.write_text(config.read_text() + f'\n[forensics]\nstore_url = "{url}"\n')
    run = _grpod("run", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    _one_line_error(run, "forensics.store_url", "PGPASSWORD")
    assert "hunter2" not in run.stderr + run.stdout
    assert not (tmp_path / "run").exists()  # nothing written
    fsck = _grpod("fsck", "--run-dir", str(tmp_path / "run"), "--store-url", url)
    _one_line_error(fsck, "PGPASSWORD", "***")
    assert "hunter2" not in fsck.stderr + fsck.stdout


@pytest.mark.slow  # a daemon run
def test_a_run_under_umask_000_leaves_nothing_for_other_users(tmp_path: Path) -> None:
    config = tiny_config(tmp_path / "grpod.toml", free_port())
    run_dir = tmp_path / "run"
    done = _grpod(
        "run", "--config", str(config), "--run-dir", str(run_dir), "--max-steps", "2", umask=0
    )
    assert done.returncode == 0, done.stderr
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in [run_dir, *run_dir.rglob("*")]}
    assert len(modes) > 8  # config, run.json, the store, blobs, checkpoints
    loose = {str(p): f"{m:04o}" for p, m in modes.items() if m & 0o027 and not p.is_symlink()}
    assert not loose, loose  # no group write, nothing for others
    assert modes[run_dir] == 0o750
    assert _grpod("fsck", "--run-dir", str(run_dir)).stdout.count("warning:") == 0
    run_dir.chmod(0o755)
    (run_dir / "run.json").chmod(0o666)
    fsck = _grpod("fsck", "--run-dir", str(run_dir))
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr  # a warning, not a problem
    warnings = [line for line in fsck.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, fsck.stdout
    assert "mode 0755: other users can read it" in warnings[0]
    assert "run.json: mode 0666: other users can read and write it" in warnings[1]
    as_json = json.loads(_grpod("fsck", "--run-dir", str(run_dir), "--json").stdout)
    assert as_json["ok"] and len(as_json["warnings"]) == 2


def _password_url() -> str:
    """GRPOD_TEST_PG_URL with the role and database `grpod_pw` (no password in it)."""
    url = urllib.parse.urlsplit(PG_URL)
    netloc = f"grpod_pw@{url.hostname}:{url.port}"
    return urllib.parse.urlunsplit((url.scheme, netloc, "/grpod_pw", url.query, ""))


@pytest.mark.postgres
@pytest.mark.slow
def test_the_store_password_comes_from_libpq_and_is_never_printed_or_written(
    tmp_path: Path,
) -> None:
    if not PG_URL:
        pytest.skip("GRPOD_TEST_PG_URL not set (make test starts the server)")
    url = _password_url()
    with_password = {"PGPASSWORD": PASSWORD}
    config = tiny_config(
        tmp_path / "grpod.toml",
        free_port(),
        {**TINY_ENGINE, "faults": {"nan_loss_steps": [1]}},  # an incident to show and export
    )
    config.write_text(config.read_text() + f'\n[forensics]\nstore_url = "{url}"\n')
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir)]
    # without the password: one line naming the store, nothing but the refusal
    refused = _grpod("run", "--config", str(config), *args, "--max-steps", str(STEPS))
    assert refused.returncode == 2 and "grpod_pw" in refused.stderr, refused.stderr
    assert "password" in refused.stderr
    run = _grpod(
        "run", "--config", str(config), *args, "--max-steps", str(STEPS), env=with_password
    )
    assert run.returncode == 0, run.stderr
    assert f"store: {url} (run dir" in run.stderr  # the label: the URL, which has no password
    outputs = [refused.stdout, refused.stderr, run.stdout, run.stderr]
    incidents = _grpod("incidents", "list", *args, "--json", env=with_password)
    first = json.loads(incidents.stdout)[0]["id"]
    for command in (
        ["status", *args],
        ["status", *args, "--json"],
        ["incidents", "show", str(first), *args],
        ["incidents", "export", str(first), str(tmp_path / "incident"), *args],
        ["fsck", *args],
        ["replay", "--step", "1", *args, "--json"],
        ["export", "--run-dir", str(run_dir), str(tmp_path / "model")],
    ):
        done = _grpod(*command, env=with_password)
        assert done.returncode in (0, 1), (command, done.stderr)
        outputs += [done.stdout, done.stderr]
    status = json.loads(_grpod("status", *args, "--json", env=with_password).stdout)
    assert status["store"] == url and status["last_step"] == STEPS - 1
    # ~/.pgpass's format through PGPASSFILE: 0600, as libpq requires
    pgpass = tmp_path / "pgpass"
    server = urllib.parse.urlsplit(url)
    pgpass.write_text(f"{server.hostname}:{server.port}:grpod_pw:grpod_pw:{PASSWORD}\n")
    pgpass.chmod(0o600)
    through_file = _grpod("status", *args, "--json", env={"PGPASSFILE": str(pgpass)})
    assert json.loads(through_file.stdout)["last_step"] == STEPS - 1, through_file.stderr
    assert all(PASSWORD not in text for text in outputs)
    for root in (run_dir, tmp_path / "incident", tmp_path / "model"):
        files = [p for p in root.rglob("*") if p.is_file()]
        assert files
        assert not [str(p) for p in files if PASSWORD.encode() in p.read_bytes()]
