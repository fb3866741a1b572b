"""`grpod drill NAME [--json] [--steps N] [--seed S]`."""

import json

import pytest

from grpod.daemon.cli import main


def test_drill_json_exit_0_when_every_injected_step_is_intercepted(capsys) -> None:
    assert main(["drill", "nan-loss", "--json", "--steps", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["drill"], result["injected"], result["intercepted"]) == ("nan-loss", 1, 1)
    assert result["clean_steps"] == 7 and result["policy_untouched"] is True


def test_drill_exit_1_when_nothing_was_intercepted(capsys) -> None:
    # 3 steps end before the first injected step (5): nothing injected, nothing shown
    assert main(["drill", "inf-grad", "--steps", "3", "--seed", "1"]) == 1
    assert "FAILED: intercepted 0/0" in capsys.readouterr().out


def test_unknown_drill_is_bad_input() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["drill", "no-such-drill"])
    assert exc.value.code == 2
