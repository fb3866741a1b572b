"""The run directory the daemon owns, and the plan of a start (fresh run or resume).

Layout: `config.toml` (the run's effective config, written once), `run.json` (run id),
`status.json` (live state, rewritten atomically every step), `grpod.sqlite` and `blobs/`
(forensics), `checkpoints/step-00000010/` (engine checkpoints). `resolve_plan` only reads:
nothing is created before the config, the run dir and the port have all been accepted.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpod.base.fileio import atomic_dir, private_umask, write_atomic
from grpod.daemon.config import DEFAULT_ROOT, GrpodConfig, load_config, validate
from grpod.daemon.errors import ConfigError
from grpod.daemon.example import dump_toml
from grpod.daemon.lock import RunDirLock
from grpod.engine.data.inputs import absolute, check_inputs, input_digests
from grpod.engine.errors import EngineError

CONFIG_NAME = "config.toml"
RUN_NAME = "run.json"
STATUS_NAME = "status.json"
CHECKPOINTS = "checkpoints"


class RunDir:
    """Paths and small files of one run directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.held: RunDirLock | None = None  # this process's lock on the directory

    def lock(self) -> None:
        """Own an existing run directory (ConfigError naming the live holder's pid)."""
        if self.held is None:
            self.held = RunDirLock.acquire(self.path)

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def status_path(self) -> Path:
        return self.path / STATUS_NAME

    def is_run(self) -> bool:
        return (self.path / RUN_NAME).is_file()

    def checkpoint_path(self, step: int) -> Path:
        return self.path / CHECKPOINTS / f"step-{step:08d}"

    def run_id(self) -> str:
        try:
            return str(json.loads((self.path / RUN_NAME).read_text())["run_id"])
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"run dir {self.path}: unreadable {RUN_NAME}: {exc}") from None

    def create(self, run_id: str, config: GrpodConfig, trainer: str = "grpod") -> None:
        """Make a new run dir atomically: built beside its name, renamed into place (over an
        empty directory if one is there), so a run dir is complete or absent. `trainer`:
        whose steps it records (`grpod`, or `trl` for grpod.integrations.trl)."""
        try:
            with atomic_dir(self.path) as tmp:
                tmp.chmod(0o750 & ~private_umask())  # even when the parent is world-readable
                (tmp / CHECKPOINTS).mkdir()
                # locked before it has its name: a second process never sees it unowned
                self.held = RunDirLock.acquire(tmp, shown_as=str(self.path))
                (tmp / CONFIG_NAME).write_text(dump_toml(config), encoding="utf-8")
                record = {
                    "run_id": run_id,
                    "created_at": time.time(),
                    "config": CONFIG_NAME,
                    "inputs": input_digests(config.engine),  # engine/data/inputs.py
                    **({"trainer": trainer} if trainer != "grpod" else {}),
                }
                (tmp / RUN_NAME).write_text(json.dumps(record) + "\n", encoding="utf-8")
        except OSError as exc:
            if self.held is not None:
                self.held.release()
                self.held = None
            if self.is_run():  # another process created it first: name its pid
                self.lock()
            where = f" ({exc.filename})" if exc.filename else ""
            raise ConfigError(
                f"run dir {self.path}: cannot create: {exc.strerror or exc}{where}"
            ) from None

    def trainer(self) -> str:
        """Whose steps the run records: `grpod` (the daemon's) or `trl`."""
        try:
            return str(json.loads((self.path / RUN_NAME).read_text()).get("trainer", "grpod"))
        except (OSError, ValueError):
            return "grpod"

    def check_inputs(self, under: str = "") -> None:
        """ConfigError naming a model or task file (`under`: only those in that directory)
        that moved or changed since the run."""
        try:
            recorded = json.loads((self.path / RUN_NAME).read_text()).get("inputs", {})
        except (OSError, ValueError):
            return  # run_id() names an unreadable run.json
        if under:
            recorded = {f: d for f, d in recorded.items() if Path(f).parent == Path(under)}
        try:
            check_inputs(recorded, f"run dir {self.path}")
        except EngineError as exc:
            raise ConfigError(str(exc)) from None

    def discard(self) -> None:
        """Remove a run directory this process created and could not start (nothing in it
        is a run yet: a restart must not resume it)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def remove_stale_temporaries(self) -> list[str]:
        """Checkpoint directories a killed process left half-written (never referenced)."""
        stale = sorted((self.path / CHECKPOINTS).glob(".step-*.tmp-*"))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return [path.name for path in stale]

    def write_status(self, status: dict[str, Any]) -> None:
        # rewritten every step and only a live view: atomic, not worth an fsync
        write_atomic(self.status_path, json.dumps(status, sort_keys=True) + "\n", durable=False)

    def read_status(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None


def existing_run_dir(path: str | os.PathLike, store_url: str = "") -> RunDir:
    """A run directory a reader command names, as this grpod writes one: its run.json with a
    run id and the inputs' digests, its store at this grpod's schema (`store_url`: the
    command's, else the run's). ConfigError or ForensicsError naming the file and the reason;
    nothing is written (a store of another schema is left as it is)."""
    from grpod.forensics.store import refuse_password

    refuse_password(store_url)  # the command's own argument, before any file is read
    run = RunDir(path)
    record_path = run.path / RUN_NAME
    if not record_path.is_file():
        raise ConfigError(f"run dir {run.path}: not a grpod run directory (no {RUN_NAME})")
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{record_path}: unreadable: {exc}") from None
    if not isinstance(record, dict) or "run_id" not in record:
        raise ConfigError(f"{record_path}: no run_id (not written by grpod)")
    if not isinstance(record.get("inputs"), dict):  # every grpod since the digests writes them
        raise ConfigError(
            f"{record_path}: no inputs digests: written by an older grpod, whose model and "
            "task files this one cannot check"
        )
    from grpod.forensics.errors import ForensicsError
    from grpod.forensics.store import Store

    store = Store(run.path, store_url, create=False)  # ForensicsError: no store there
    try:
        store.revision()
    except ForensicsError:  # unreadable: each command names it (fsck: a problem, exit 1)
        return run
    else:
        store.check_schema()  # a newer grpod's (or an older, before `grpod db upgrade`)
    finally:
        store.close()
    return run


@dataclass(frozen=True)
class Plan:
    """What `grpod run` will do, decided before anything is written."""

    config: GrpodConfig
    run_dir: RunDir
    run_id: str
    resume: bool
    config_source: Path | None  # the file SIGHUP re-reads for [guards]
    link_latest: Path | None  # ./var/grpod/latest for the embedded default location


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def resolve_plan(config_file: str | None, run_dir: str | None, overrides: dict[str, Any]) -> Plan:
    """Load and check the config, pick the run dir, decide fresh run or resume."""
    given = load_config(config_file) if config_file is not None else None
    where = run_dir or (given.daemon.run_dir if given else "")
    run_id = new_run_id()
    target = RunDir(where or DEFAULT_ROOT / run_id)
    link = None if where else DEFAULT_ROOT / "latest"
    if given is not None:  # its relative paths are the cwd's: recorded absolute (self-contained)
        given = given.model_copy(update={"engine": absolute(given.engine)})
    if target.is_run():
        if target.trainer() == "trl":  # its config names a tokenizer, not a model to train
            raise ConfigError(
                f"run dir {target.path}: recorded by a TRL script (grpod.integrations.trl), "
                "not by grpod run; resume it by running that script again with the same "
                "GrpodTRLConfig(run_dir=...) and trainer.train(resume_from_checkpoint=True)"
            )
        base = load_config(target.config_path)
        if given is not None:
            _check_same_run(given, base, target.config_path)
        config = given or base
        run_id, resume = target.run_id(), True
    else:
        if target.path.exists() and (not target.path.is_dir() or any(target.path.iterdir())):
            raise ConfigError(f"run dir {target.path}: exists and is not a grpod run directory")
        config = given or GrpodConfig()
        config = config.model_copy(update={"engine": absolute(config.engine)})
        resume = False
    daemon = {**config.daemon.model_dump(), "run_dir": str(target.path), **overrides}
    config = validate({**config.model_dump(), "daemon": daemon}, "command line")
    source = Path(config_file) if config_file else target.config_path
    return Plan(config, target, run_id, resume, source, link)


def _check_same_run(given: GrpodConfig, base: GrpodConfig, where: Path) -> None:
    """A resumed run keeps its engine and its store; guards and daemon may change."""
    if given.engine != base.engine:
        changed = sorted(
            key
            for key, value in given.engine.model_dump().items()
            if base.engine.model_dump()[key] != value
        )
        raise ConfigError(
            f"engine.{changed[0]}: differs from the run's {where} (a run's engine is fixed; "
            "use a new --run-dir)"
        )
    if given.forensics.store_url != base.forensics.store_url:
        raise ConfigError(f"forensics.store_url: differs from the run's {where}")


def link_latest(link: Path, target: Path) -> None:
    """Point `link` (./var/grpod/latest) at `target`, replacing it atomically."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name if target.parent == link.parent else target.resolve())
    os.replace(tmp, link)
