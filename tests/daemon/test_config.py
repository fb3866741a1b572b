"""grpod.toml: validation errors name the key path, bad input creates nothing, the example
file is in sync with the models and its defaults are the real defaults."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from grpod.daemon.cli import main
from grpod.daemon.config import GrpodConfig, load_config, parse_config
from grpod.daemon.errors import ConfigError
from grpod.daemon.example import EXAMPLE_PATH, dump_toml, example_toml
from tests.daemon.helpers import GRPOD

BAD = {
    "unknown key": ("[engine]\nlearning_rate = 0.1\n", "engine.learning_rate: unknown key"),
    "unknown section": ("[trainer]\nlr = 0.1\n", "trainer: unknown key"),
    "wrong type": ('[engine]\nprompts_per_step = "four"\n', "engine.prompts_per_step: "),
    "out of range": ("[daemon]\nmetrics_port = 70000\n", "daemon.metrics_port: "),
    "bad choice": ('[daemon]\nlog_format = "xml"\n', "daemon.log_format: "),
    "bad toml": ("[engine\nlr = 1\n", "not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_names_the_key(case: str) -> None:
    text, expected = BAD[case]
    with pytest.raises(ConfigError) as info:
        parse_config(text, "grpod.toml")
    message = str(info.value)
    assert message.startswith("grpod.toml: ") and expected in message
    assert "\n" not in message


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml: cannot read: No such file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read: Is a directory"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "text",
    [*(text for text, _ in BAD.values()), None],
    ids=[*sorted(BAD, key=list(BAD).index), "unreadable"],
)
def test_grpod_run_with_a_bad_config_exits_2_and_creates_nothing(
    text: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    if text is not None:
        Path("bad.toml").write_text(text)
    assert main(["run", "--config", "bad.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpod run: error: bad.toml: ") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == (["bad.toml"] if text else [])


@pytest.mark.slow  # the fast tier stays under ~2 minutes
def test_bad_config_subprocess_one_line_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[daemon]\ncheckpoint_every = 0\n")
    proc = subprocess.run(
        [GRPOD, "run", "--config", "bad.toml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert re.fullmatch(
        r"grpod run: error: bad\.toml: daemon\.checkpoint_every: .*greater than or equal to 1"
        r".*\n",
        proc.stderr,
    ), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


def test_taken_port_and_foreign_run_dir_create_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        Path("c.toml").write_text(f"[daemon]\nmetrics_port = {port}\n")
        assert main(["run", "--config", "c.toml"]) == 2
    assert "daemon.metrics_port: cannot bind" in capsys.readouterr().err
    Path("other").mkdir()
    Path("other/file").write_text("not a run")
    assert main(["run", "--run-dir", "other"]) == 2
    assert "not a grpod run directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "other"]


def test_config_check_command(tmp_path: Path, capsys) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[engine]\nlr = 0.0005\n[daemon]\nmax_steps = 3\n")
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nlr = -1\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "engine.lr: Input should be greater than or equal to 0" in capsys.readouterr().err


def test_example_file_is_in_sync(capsys) -> None:
    assert main(["config", "example"]) == 0
    printed = capsys.readouterr().out
    assert printed == example_toml() == EXAMPLE_PATH.read_text(), (
        "daemon/grpod.example.toml is stale: grpod config example > daemon/grpod.example.toml"
    )


def test_example_defaults_are_the_defaults() -> None:
    text = example_toml()
    assert parse_config(text) == GrpodConfig()  # everything commented out
    lines = text.splitlines()
    keys = [line for line in lines if re.match(r"#[a-z_0-9]+ = ", line)]
    assert len(keys) >= len(type(GrpodConfig().daemon).model_fields) + 40
    uncommented = "\n".join(line[1:] if line in keys else line for line in lines)
    assert parse_config(uncommented) == GrpodConfig()
    for name, field in type(GrpodConfig().daemon).model_fields.items():
        assert field.description or name == "log_level", f"daemon.{name} has no description"


def test_partial_engine_section_keeps_the_embedded_task() -> None:
    config = parse_config("[engine]\nlr = 0.002\n")
    assert config.engine.task == "copy" and config.engine.lr == 0.002


def test_dump_toml_round_trips() -> None:
    config = parse_config("[engine]\nprompts_per_step = 4\n[daemon]\nmax_steps = 7\n")
    assert parse_config(dump_toml(config)) == config
