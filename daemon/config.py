"""grpod.toml: one section per package, composed and validated here.

`[engine]` (EngineConfig), `[guards]` (GuardsConfig), `[forensics]` (ForensicsConfig) and
`[daemon]` (DaemonConfig) make one `GrpodConfig`. Every error becomes one `ConfigError` line
naming the file, the key path and the reason; nothing is created before a config is valid.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError

from grpod.daemon.errors import ConfigError
from grpod.engine.config import ConfigSection, EngineConfig, NonNegative, Positive
from grpod.forensics.config import ForensicsConfig
from grpod.guards import GuardsConfig

if TYPE_CHECKING:  # the policy is handed over: loading the config loads no guard
    from grpod.guards import GuardPolicy

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib

DEFAULT_ROOT = Path("var/grpod")  # the embedded default: ./var/grpod/<run-id>, ./var/grpod/latest


class DaemonConfig(ConfigSection):
    """The service around the engine: the loop, checkpoints, metrics, health, logs."""

    run_dir: str = Field(
        "", description="run directory; '' = ./var/grpod/<run-id> with ./var/grpod/latest"
    )
    max_steps: int = Field(0, ge=0, description="stop when the run reaches this step; 0 = never")
    checkpoint_every: int = Field(10, ge=1, description="checkpoint every K steps")
    checkpoint_timeout_seconds: Positive = Field(
        600.0, description="EXTEND_TIMEOUT_USEC sent to systemd while checkpointing"
    )
    metrics: bool = Field(True, description="serve /metrics and /healthz")
    metrics_host: str = Field("127.0.0.1", description="bind address of /metrics and /healthz")
    metrics_port: int = Field(9464, ge=0, le=65535, description="0 = any free port (logged)")
    health_max_step_age_seconds: Positive = Field(
        600.0, description="/healthz turns 503 when the last step is older than this"
    )
    linger_seconds: NonNegative = Field(
        0.0, description="keep /metrics up (with /healthz 503) this long after the loop"
    )
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto = console on a TTY, JSON lines otherwise"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    publish_hold_seconds: NonNegative = Field(
        1.0,
        description="a healthy step's metrics and log line may wait this long to go out with "
        "the next steps' in one burst (cheaper per step); 0 = each at once",
    )
    state_digest_on_exit: bool = Field(
        False, description="log engine.state_digest() at exit (hashes all weights; tests, audits)"
    )
    log_samples: int = Field(
        0, ge=0, description="decoded completions (with rewards) in each step event and incident"
    )
    progress: Literal["auto", "on", "off"] = Field(
        "auto", description="progress bar on stderr; auto = only when stderr is a TTY"
    )


class GrpodConfig(ConfigSection):
    """The whole grpod.toml. The embedded default trains the tiny model on `copy`."""

    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(task="copy"))
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    forensics: ForensicsConfig = Field(default_factory=ForensicsConfig)
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)

    def to_json(self) -> dict[str, Any]:
        """{engine, guards, forensics, daemon}, as the store keeps a run's config."""
        return self.model_dump(mode="json")


def load_config(path: str | os.PathLike | None) -> GrpodConfig:
    """Read and validate a grpod.toml; `None` is the embedded default."""
    if path is None:
        return GrpodConfig()
    where = Path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{where}: cannot read: {reason}") from None
    return parse_config(text, str(where))


def parse_config(text: str, source: str = "<config>") -> GrpodConfig:
    """Validate TOML text; a missing section or key takes its default."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return validate(data, source)


def validate(data: dict[str, Any], source: str = "<config>") -> GrpodConfig:
    engine = data.get("engine")
    if isinstance(engine, dict) and "task" not in engine:
        data = {**data, "engine": {**engine, "task": GrpodConfig().engine.task}}
    try:
        return GrpodConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe(exc)}") from None


def describe(exc: ValidationError) -> str:
    """The first error as 'key.path: reason' (and how many more there are)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    reason = first["msg"]
    if first["type"] == "extra_forbidden":
        reason = "unknown key"
    elif "input" in first and first["type"] not in ("missing",) and _short(first["input"]):
        reason = f"{reason} (got {first['input']!r})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {reason}{more}"


def _short(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) and len(repr(value)) <= 60


def reload_guards(
    config: GrpodConfig, source: str | os.PathLike | None, policy: GuardPolicy, log: Any
) -> GrpodConfig:
    """SIGHUP: new guard thresholds from the config file into `policy`; the engine and the
    forensics settings are never reloaded (a change to them is logged as ignored). Returns
    the config with the new guards (a bad file: the previous one, and an error event)."""
    try:
        fresh = load_config(source)
    except ConfigError as exc:
        log.error("reload failed", error=str(exc), kept="previous guards")
        return config
    policy.reload(fresh.guards)
    ignored = [
        name for name in ("engine", "forensics") if getattr(fresh, name) != getattr(config, name)
    ]
    log.info("reloaded", source=str(source), section="guards", ignored_changes=ignored)
    return config.model_copy(update={"guards": fresh.guards})
