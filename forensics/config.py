"""`ForensicsConfig`: the forensics config section (`[forensics]` in grpod.toml)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from grpod.engine.config import ConfigSection, Positive
from grpod.engine.verdict import ACTION_NAMES, ActionName
from grpod.forensics.errors import ForensicsError

GPU_RUN_FRACTION = 0.15  # the attribution's share of the trainer's GPU, at most


class AttributionConfig(ConfigSection):
    """Per-sample attribution of each incident's step (forensics/incident_attribution.py),
    computed by the daemon in a child process off the training path, one at a time."""

    enabled: bool = Field(
        True,
        description="attribute the first step of every new incident (`grpod incidents show ID` "
        "prints its top samples and where a NaN was born); off: only on demand (--by-sample)",
    )
    max_samples: int = Field(
        512, ge=1, description="a step with more samples is skipped (a note says so)"
    )
    max_seconds: float = Field(
        3600.0, gt=0, description="an attribution still running after this is stopped (a note)"
    )
    max_rss_mib: int = Field(
        8192, ge=64, description="an attribution whose process grows past this RSS is stopped"
    )
    max_pending: int = Field(
        8, ge=1, description="incidents waiting their turn; one more is skipped (a note)"
    )
    run_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="the attribution process's CPU time as a share of its wall time: it "
        "sleeps whenever it is ahead (forensics/pace.py). 0 = auto: 1 (unpaced) on the CPU, "
        "where SCHED_IDLE already yields every core the trainer wants; "
        f"{GPU_RUN_FRACTION} on a GPU, which has no idle priority",
    )

    def pace(self, run_device: str) -> float:
        """The run fraction for an attribution of a run on `run_device` (`device` first)."""
        if self.run_fraction:
            return self.run_fraction
        return 1.0 if (self.device or run_device) == "cpu" else GPU_RUN_FRACTION

    threads: int = Field(1, ge=1, description="torch threads of the attribution process")
    nice: int = Field(19, ge=0, le=19, description="niceness of the attribution process")
    idle: bool = Field(
        True,
        description="Linux: also the SCHED_IDLE class, below every niceness: the child runs "
        "only on a core no other process wants, and a waking trainer thread preempts it at "
        "once. false = nice alone, for a machine whose other busy work would starve it",
    )
    device: str = Field(
        "",
        pattern=r"^(|cpu|cuda(:\d+)?)$",
        description="where the attribution runs: '' = the run's device; 'cpu' keeps it off "
        "the GPU the trainer uses (nice does not share a GPU), at the CPU's speed",
    )
    shutdown_wait_seconds: float = Field(
        10.0,
        ge=0,
        description="at exit, how long the daemon waits for the attribution in progress; "
        "then it and every pending one say 'attribution not computed: daemon stopped'",
    )


class ForensicsConfig(ConfigSection):
    """Where steps are recorded, when an incident opens, and how much history is kept."""

    store_url: str = Field(
        "",
        description="SQLAlchemy URL; '' = SQLite file <run_dir>/grpod.sqlite. No password in "
        "it (refused: the config is copied into the run dir): PostgreSQL's driver reads "
        "PGPASSWORD, PGPASSFILE or ~/.pgpass",
    )
    incident_action: ActionName = Field(
        "WARN",
        description="a finding at or above this action opens an incident: one per episode of "
        "a guard's finding over consecutive steps, pinning its first and worst step",
    )
    episode_gap_steps: int = Field(
        16,
        ge=0,
        description="an episode closes after this many steps in a row without its finding "
        "(0 = at the first step without it)",
    )
    queue_size: int = Field(8, ge=1, description="steps the recorder may hold before record blocks")
    commit_every_steps: int = Field(
        16,
        ge=1,
        description="steps the writer commits together (their blob fsyncs and one transaction); "
        "an incident or a checkpoint commits at once; 1 = every step",
    )
    commit_interval_seconds: Positive = Field(
        1.0, description="the longest a recorded step waits for its group's commit"
    )
    inline_blob_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="a batch blob of at most this many bytes is stored in its store row, "
        "committed with the step (no file and no fsync of its own); larger ones, or all with "
        "0, are files under blobs/sha256/",
    )
    retention_bytes: int = Field(
        2 * 1024**3,
        ge=0,
        description="disk budget of a run dir (checkpoints, batch blobs, the store file): the "
        "daemon prunes to it after every checkpoint, as `grpod gc` does; incident pins and the "
        "newest checkpoint are kept even past it",
    )
    keep_checkpoints: int = Field(
        5,
        ge=0,
        description="the daemon keeps the newest K checkpoints (plus those incidents pin) and "
        "the batches they need, pruning the rest as it runs; 0 = keep every checkpoint and "
        "prune nothing while running",
    )
    busy_timeout_ms: int = Field(10_000, ge=0, description="SQLite busy_timeout")
    attribution: AttributionConfig = Field(
        default_factory=AttributionConfig,
        description="each new incident's step attributed to its samples by the daemon, in a "
        "child process off the training path (forensics/incident_attribution.py)",
    )

    @field_validator("store_url")
    @classmethod
    def _no_password(cls, url: str) -> str:
        if has_password(url):
            raise ValueError(PASSWORD_REFUSED)
        return url


PASSWORD_REFUSED = (
    "has a password in it (refused: the config is copied into the run dir and URLs get "
    "printed); give it through PGPASSWORD, PGPASSFILE or ~/.pgpass (docs/SECURITY.md)"
)


def has_password(url: str) -> bool:
    """Whether the SQLAlchemy URL `url` carries a password (an unparsable one: no)."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return bool(url) and make_url(url).password is not None
    except (ArgumentError, ValueError):
        return False


def run_dir_config(run_dir: str | os.PathLike) -> ForensicsConfig:
    """The `[forensics]` section of `<run_dir>/config.toml` (defaults when there is none)."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return ForensicsConfig()
    import tomllib

    try:
        section = tomllib.loads(path.read_text()).get("forensics", {})
        return ForensicsConfig.model_validate(section)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ForensicsError(f"config {path}: unreadable: {exc}") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, ("forensics", *error["loc"])))
        raise ForensicsError(f"config {path}: {where}: {error['msg']}") from None


def action_rank(action: str | int) -> int:
    """0..3 for PASS..HALT, from a name ("FLUSH") or a guards `Action` value."""
    if isinstance(action, int):
        return int(action)
    try:
        return ACTION_NAMES.index(action.upper())
    except ValueError:
        raise ForensicsError(f"verdict action {action!r}: not one of {ACTION_NAMES}") from None
