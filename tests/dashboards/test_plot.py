"""`grpod plot` on the run directory of a real `grpod run`."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpod.daemon.cli import main
from grpod.daemon.commands.plot import load_series, pearson
from tests.dashboards.conftest import MAX_STEPS, DaemonRun

PNGS = ("learning.png", "outcomes.png", "accounting.png", "gradnorm.png", "overview.png")


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
    assert series.incidents and all(s in series.steps for _, s, _ in series.incidents)
    computed = [(v, e) for v, e in zip(series.valid_tokens, series.expected_valid_tokens) if v == v]
    assert computed and all(v == e for v, e in computed)  # the real counter is right


def test_plot_bad_run_dir_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plot", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpod plot: error:") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_pearson() -> None:
    assert pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert pearson([1, 2], [1, 2]) is None  # too few points
    assert pearson([1, 1, 1], [1, 2, 3]) is None  # no variance


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
