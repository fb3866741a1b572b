"""`grpod plot` on the run directory of a real `grpod run`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from grpod.daemon.cli import main
from grpod.daemon.commands.plot import RunSeries, gradnorm_correlation, load_series
from grpod.guards.config import CorrelationConfig
from grpod.guards.correlation import GradNormVTCCorrelationGuard
from tests.dashboards.conftest import EVAL_EVERY, MAX_STEPS, DaemonRun
from tests.guards.helpers import batch, report

pytestmark = pytest.mark.slow  # a real run per module: not in the fast tier

PNGS = (
    "learning.png",
    "outcomes.png",
    "accounting.png",
    "gradnorm.png",
    "entropy.png",
    "overview.png",
)


def test_plot_renders_every_view_of_a_real_run(
    daemon_run: DaemonRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from matplotlib.image import imread

    out = tmp_path / "plots"
    assert main(["plot", "--run-dir", str(daemon_run.run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted(PNGS)
    for name in PNGS:
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert 10_000 < path.stat().st_size < 400_000, name
        pixels = imread(path)  # [height, width, 4] floats in [0, 1]
        assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, name
        assert pixels[..., :3].std() > 0.02, f"{name} is blank"
        # Curves and markers in colour, not just black axes on white.
        rgb = pixels[..., :3].reshape(-1, 3)
        saturated = (rgb.max(axis=1) - rgb.min(axis=1)) > 0.3
        assert saturated.sum() > 50, f"{name} has no coloured data"  # 6 points are ~100 px


def test_plot_reads_every_step_and_the_incident(daemon_run: DaemonRun) -> None:
    series = load_series(daemon_run.run_dir)
    assert series.steps == list(range(MAX_STEPS))
    assert "flushed" in series.outcomes
    assert [step for step, _ in series.evals] == list(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))
    assert series.incidents and all(s in series.steps for _, s, _ in series.incidents)
    computed = [(v, e) for v, e in zip(series.valid_tokens, series.expected_valid_tokens) if v == v]
    assert computed and all(v == e for v, e in computed)  # the real counter is right
    entropy = [e for e, o in zip(series.entropy, series.outcomes) if o != "skipped"]
    assert entropy and all(0 < e < math.log(15) for e in entropy)  # 15-token vocabulary
    assert [step for _, step, _ in series.incidents] == [first for _, first, _ in series.episodes]


def test_plot_bad_run_dir_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plot", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpod plot: error:") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_plot_onto_an_existing_file_is_one_line_exit_2(
    daemon_run: DaemonRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plots.png"
    out.write_bytes(b"mine")
    assert main(["plot", "--run-dir", str(daemon_run.run_dir), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"grpod plot: error: --out {out}: exists and is not a directory "
        "(plot writes its PNG files into one)\n"
    )
    assert out.read_bytes() == b"mine"


def test_the_plot_reads_the_correlation_the_guard_held() -> None:
    """The plot's r is the guard's own after the run's steps: its window, its minimum, its
    rule of which steps count (no grad norm, a zero one or no valid tokens do not)."""
    valid = [100.0, 50.0, 25.0, 80.0, math.nan, 40.0, 20.0, 10.0, 0.0]
    grad = [0.01, 0.02, 0.04, 0.0, math.nan, 0.03, 0.06, math.nan, 1.0]
    outcomes = ["applied"] * 3 + ["applied", "skipped", "applied", "applied", "flushed", "flushed"]
    steps = list(range(len(valid)))
    expected = [10.0] * len(valid)  # the loss mask's sum, as the guard's reports have it
    series = RunSeries(
        steps=steps, outcomes=outcomes, valid_tokens=valid, grad_norm=grad,
        expected_valid_tokens=expected,
    )  # fmt: skip
    for config in (CorrelationConfig(window=4, min_steps=3), CorrelationConfig(min_steps=5)):
        guard = GradNormVTCCorrelationGuard(config)
        for v, g in zip(valid, grad):
            if v == v:  # a skipped step computed nothing: no report reaches the guard
                guard.after(batch(), report(grad_norm=g, valid_tokens=int(v)))
        series.correlation = config
        assert gradnorm_correlation(series) == (guard.value, len(guard.grad_norms))
    assert gradnorm_correlation(series)[1] == 5  # five steps count, the 0.0 grad norm does not
    series.correlation = None  # no config.toml: the guard's defaults, 16 steps before a value
    assert gradnorm_correlation(series) == (None, 5)


def test_plot_shows_the_accounting_fault_of_a_halted_run(
    halted_run: DaemonRun, tmp_path: Path
) -> None:
    """Skipped steps (no grad norm) and flushed ones plot; the counter's misreads show."""
    from grpod.daemon.commands.plot import render

    series = load_series(halted_run.run_dir)
    assert set(series.outcomes) <= {"flushed", "skipped"} and series.incidents
    differ = [v != e for v, e in zip(series.valid_tokens, series.expected_valid_tokens) if v == v]
    assert any(differ)  # v == v: skipped steps (no compute) read NaN
    written = render(series, tmp_path)
    assert [p.name for p in written] == list(PNGS)
    assert all(p.stat().st_size > 10_000 for p in written)
