"""`grpod plot`: the dashboard's main views as PNG files, rendered from the forensic store.

For a run without Prometheus and Grafana (a laptop, a bug report, the README). Reads every
recorded step of the run directory (the last record of each step when a step was re-run)
and its incidents; writes, into `--out`:

- `learning.png`: reward mean ± std (and the held-out eval reward) and loss per step;
- `outcomes.png`: each step's outcome (applied / flushed / skipped) with incidents marked;
- `accounting.png`: valid tokens, engine counter vs host-side loss-mask sum, per step;
- `gradnorm.png`: pre-clip grad norm against expected / valid tokens (the reversed-chunk
  signature: 1 on every step of an exact counter),
  titled with the correlation the `gradnorm_vtc_correlation` guard held after the last step
  (its window, minimum and rule of which steps count, from the run's config.toml);
- `entropy.png`: the policy entropy per step, with the span of each campaign guard's
  episodes (entropy, reward_trend, dead_campaign, advantage): when each fired and for how long;
- `overview.png`: the four views on one page.

Rendering uses matplotlib's Agg canvas through `Figure` objects (no pyplot global state).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpod.daemon.commands.status import DEFAULT_RUN_DIR

if TYPE_CHECKING:
    from grpod.guards.config import CorrelationConfig

OUTCOME_COLORS = {"applied": "#2ca02c", "flushed": "#ff7f0e", "skipped": "#1f77b4"}
OUTCOME_LEVELS = {"applied": 0, "flushed": 1, "skipped": 2}
PNG_DPI = 100


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="render a run's curves from the store as PNG files")
    p.add_argument(
        "--run-dir", default=DEFAULT_RUN_DIR, help="run directory (default: %(default)s)"
    )
    p.add_argument("--store-url", default="", help="store URL (default: the run dir's)")
    p.add_argument("--out", required=True, help="directory for the PNG files (created)")
    p.set_defaults(handler=_plot)


@dataclass
class RunSeries:
    """Per-step columns of one run directory, in step order (one entry per step)."""

    steps: list[int] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    valid_tokens: list[float] = field(default_factory=list)
    expected_valid_tokens: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    reward_std: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)  # nats; NaN when not recorded
    incidents: list[tuple[int, int, str]] = field(default_factory=list)  # (id, step, action)
    correlation: CorrelationConfig | None = None  # the run's guard section (None: defaults)
    # (guard, first step, last step) of each incident's episode
    episodes: list[tuple[str, int, int]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, total eval reward)


def load_series(run_dir: str | Path, store_url: str = "") -> RunSeries:
    """Read the recorded steps and incidents of `run_dir` from its store (read-only).

    Raises ForensicsError when there is no store, its schema is not this grpod's, or it
    holds no step.
    """
    from grpod.forensics.errors import ForensicsError
    from grpod.forensics.store import Store

    store = Store(run_dir, store_url, create=False)
    try:
        store.check_schema()
        points = store.step_points()
        marks = store.incident_marks()
        incidents = [(i.id, i.step, i.action) for i in marks]
        episodes = [
            (i.guard, i.step, i.step if i.last_step is None else i.last_step) for i in marks
        ]
        evals = {e.step: e.total for e in store.eval_totals()}
    finally:
        store.close()
    if not points:
        raise ForensicsError(f"run dir {store.run_dir}: no recorded steps to plot")
    series = RunSeries(
        incidents=incidents,
        correlation=_correlation_config(run_dir),
        episodes=episodes,
        evals=[(k, _num(v)) for k, v in sorted(evals.items())],
    )
    for row in points:
        series.steps.append(row.step)
        series.outcomes.append(row.outcome)
        # A skipped step computed nothing: its counter, loss and grad norm are not readings.
        computed = row.outcome != "skipped"
        series.valid_tokens.append(_num(row.valid_tokens) if computed else math.nan)
        series.expected_valid_tokens.append(_num(row.expected_valid_tokens))
        series.loss.append(_num(row.loss) if computed else math.nan)
        series.reward_mean.append(_num(row.reward_mean))
        series.reward_std.append(_num(row.reward_std))
        series.grad_norm.append(_num(row.grad_norm) if computed else math.nan)
        series.entropy.append(_num(row.entropy) if computed else math.nan)
    return series


def _correlation_config(run_dir: str | Path) -> CorrelationConfig | None:
    """The run's `[guards.gradnorm_vtc_correlation]` (None without a config.toml)."""
    from grpod.daemon.config import load_config
    from grpod.daemon.rundir import RunDir

    path = RunDir(run_dir).config_path
    return load_config(path).guards.gradnorm_vtc_correlation if path.is_file() else None


def gradnorm_correlation(series: RunSeries) -> tuple[float | None, int]:
    """What the guard read after the last step: its correlation (None under `min_steps`) and
    the number of steps in its window, replayed through the guard itself."""
    from grpod.guards.config import CorrelationConfig
    from grpod.guards.correlation import GradNormVTCCorrelationGuard

    guard = GradNormVTCCorrelationGuard(series.correlation or CorrelationConfig())
    for grad_norm, valid, expected in zip(
        series.grad_norm, series.valid_tokens, series.expected_valid_tokens
    ):
        guard.observe(grad_norm, valid, expected)
    return guard.value, len(guard.grad_norms)


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


# ---------------------------------------------------------------------------- views
def draw_learning(series: RunSeries, reward_ax: Any, loss_ax: Any) -> None:
    """Reward mean with a ±std band, and the loss, per step."""
    mean, std = series.reward_mean, series.reward_std
    reward_ax.plot(series.steps, mean, color="#1f77b4", lw=1.2, label="reward mean")
    reward_ax.fill_between(
        series.steps,
        [m - s for m, s in zip(mean, std)],
        [m + s for m, s in zip(mean, std)],
        color="#1f77b4",
        alpha=0.2,
        lw=0,
        label="± std",
    )
    if series.evals:
        steps, values = zip(*series.evals)
        reward_ax.plot(steps, values, "D-", color="#9467bd", ms=4, lw=1, label="eval (held-out)")
    reward_ax.set_ylabel("reward")
    reward_ax.legend(loc="best", fontsize=8)
    loss_ax.plot(series.steps, series.loss, color="#d62728", lw=1.2, label="loss")
    for ax in (reward_ax, loss_ax):
        _shade_flushed(series, ax)
    loss_ax.set_ylabel("loss")
    loss_ax.set_xlabel("step")
    loss_ax.legend(loc="best", fontsize=8)


def draw_outcomes(series: RunSeries, ax: Any) -> None:
    """One marker per step at its outcome's level; incidents as labelled vertical lines."""
    for outcome, color in OUTCOME_COLORS.items():
        xs = [s for s, o in zip(series.steps, series.outcomes) if o == outcome]
        if xs:
            ax.scatter(xs, [OUTCOME_LEVELS[outcome]] * len(xs), s=14, color=color, label=outcome)
    for n, (incident_id, step, action) in enumerate(series.incidents):
        ax.axvline(step, color="#d62728", lw=0.8, alpha=0.6, label="incident" if n == 0 else None)
        ax.annotate(
            f"#{incident_id} {action}",
            (step, 2.45),
            fontsize=7,
            color="#d62728",
            rotation=90,
            va="bottom",
            ha="right",
        )
    ax.set_yticks(list(OUTCOME_LEVELS.values()), list(OUTCOME_LEVELS))
    ax.set_ylim(-0.5, 3.6)
    ax.set_xlabel("step")
    count = len(series.incidents)
    ax.set_title(f"outcomes ({count} incident{'' if count == 1 else 's'})", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def draw_accounting(series: RunSeries, ax: Any) -> None:
    """Engine valid tokens vs the loss-mask sum; steps where they differ in red (skipped
    steps computed nothing: a gap in the engine line)."""
    ax.plot(series.steps, series.expected_valid_tokens, color="#7f7f7f", lw=2.5, alpha=0.5,
            label="expected (loss mask)")  # fmt: skip
    ax.plot(series.steps, series.valid_tokens, color="#1f77b4", lw=1.0, label="engine counter")
    bad = [
        (s, v)
        for s, v, e in zip(series.steps, series.valid_tokens, series.expected_valid_tokens)
        if math.isfinite(v) and v != e
    ]
    if bad:
        ax.scatter(*zip(*bad), color="#d62728", s=20, zorder=3, label=f"differ ({len(bad)})")
        title = f"token accounting: engine differs from the loss mask on {len(bad)} steps"
    else:
        computed = sum(math.isfinite(v) for v in series.valid_tokens)
        title = f"token accounting: engine = loss mask on all {computed} computed steps"
    ax.set_xlabel("step")
    ax.set_ylabel("valid tokens")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="best", fontsize=8)


def draw_gradnorm(series: RunSeries, ax: Any) -> None:
    """Pre-clip grad norm against expected / valid tokens, by outcome, for the steps the
    correlation guard counts; the guard's Pearson r in the title."""
    from grpod.guards.correlation import is_evidence

    points = [
        (e / v, g, o)
        for v, e, g, o in zip(
            series.valid_tokens, series.expected_valid_tokens, series.grad_norm, series.outcomes
        )
        if is_evidence(g, v) and math.isfinite(e)
    ]
    for outcome, color in OUTCOME_COLORS.items():
        xs = [(x, g) for x, g, o in points if o == outcome]
        if xs:
            ax.scatter(*zip(*xs), s=14, color=color, alpha=0.8, label=outcome)
    r, window = gradnorm_correlation(series)
    r_text = "n/a" if r is None else f"{r:.2f}"
    ax.set_title(
        f"grad norm vs expected/valid tokens (guard r = {r_text} over the last {window} "
        f"of {len(points)} steps)",
        fontsize=10,
    )
    ax.set_xlabel("expected / valid tokens (the counter's scale error)")
    ax.set_ylabel("pre-clip grad norm")
    ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2))
    if points:
        ax.legend(loc="best", fontsize=8)


CAMPAIGN_GUARDS = {
    "entropy": "#9467bd",
    "reward_trend": "#8c564b",
    "dead_campaign": "#d62728",
    "advantage": "#7f7f7f",
}


def draw_entropy(series: RunSeries, ax: Any) -> None:
    """Policy entropy per step; each campaign guard's episodes as a band on its own level."""
    ax.plot(series.steps, series.entropy, color="#1f77b4", lw=1.2, label="policy entropy")
    ax.set_ylabel("entropy (nats)")
    ax.set_xlabel("step")
    top = max((e for e in series.entropy if e == e), default=1.0) or 1.0
    for level, (guard, color) in enumerate(CAMPAIGN_GUARDS.items()):
        spans = [(a, b) for g, a, b in series.episodes if g == guard]
        for n, (first, last) in enumerate(spans):
            ax.axvspan(
                first - 0.5,
                last + 0.5,
                ymin=0.02 + 0.05 * level,
                ymax=0.06 + 0.05 * level,
                color=color,
                alpha=0.8,
                lw=0,
                label=f"{guard} episode" if n == 0 else None,
            )
    ax.set_ylim(0, top * 1.1)
    ax.legend(loc="upper right", fontsize=8)


def _shade_flushed(series: RunSeries, ax: Any) -> None:
    """A band over each flushed step (its loss may be NaN: a gap in the curve)."""
    flushed = [s for s, o in zip(series.steps, series.outcomes) if o == "flushed"]
    for n, step in enumerate(flushed):
        ax.axvspan(step - 0.5, step + 0.5, color=OUTCOME_COLORS["flushed"], alpha=0.25, lw=0,
                   label="flushed" if n == 0 else None)  # fmt: skip


# ---------------------------------------------------------------------------- files
# the files of one panel each: (name, size in inches, what draws it on its one axes)
SINGLE_PANELS = (
    ("outcomes.png", (8, 3.5), draw_outcomes),
    ("accounting.png", (8, 4), draw_accounting),
    ("gradnorm.png", (6, 5), draw_gradnorm),
    ("entropy.png", (8, 3.5), draw_entropy),
)


def render(series: RunSeries, out_dir: str | Path, title: str = "") -> list[Path]:
    """Write the six PNG files into `out_dir` (created); returns their paths."""
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        if title:
            fig.suptitle(title, fontsize=11)
        path = out / name
        fig.savefig(path, dpi=PNG_DPI)
        written.append(path)

    fig = Figure(figsize=(8, 6), layout="constrained")
    reward_ax, loss_ax = fig.subplots(2, 1, sharex=True)
    draw_learning(series, reward_ax, loss_ax)
    save(fig, "learning.png")

    for name, size, draw in SINGLE_PANELS:
        fig = Figure(figsize=size, layout="constrained")
        draw(series, fig.subplots())
        save(fig, name)

    fig = Figure(figsize=(12, 8), layout="constrained")
    grid = fig.add_gridspec(3, 2)
    reward_ax = fig.add_subplot(grid[0, 0])
    draw_learning(series, reward_ax, fig.add_subplot(grid[1, 0], sharex=reward_ax))
    draw_outcomes(series, fig.add_subplot(grid[2, 0]))
    draw_accounting(series, fig.add_subplot(grid[0:1, 1]))
    draw_gradnorm(series, fig.add_subplot(grid[1:3, 1]))
    save(fig, "overview.png")
    return written


def _plot(args: argparse.Namespace) -> int:
    from grpod.daemon.errors import ConfigError

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(
            f"--out {args.out}: exists and is not a directory (plot writes its PNG files into one)"
        )
    from grpod.daemon.rundir import existing_run_dir

    existing_run_dir(args.run_dir, args.store_url)  # as every reader: this grpod's run dir
    series = load_series(args.run_dir, args.store_url)
    title = (
        f"grpod {Path(args.run_dir).resolve().name}: steps {series.steps[0]}..{series.steps[-1]}"
    )
    for path in render(series, args.out, title=title):
        print(path)
    return 0
