import json
import math

from grpod.engine.verdict import Action, Finding, Verdict


def test_actions_are_ordered() -> None:
    assert Action.PASS < Action.WARN < Action.FLUSH < Action.HALT
    assert max(Action.WARN, Action.FLUSH) is Action.FLUSH


def test_verdict_is_the_highest_action_and_keeps_every_finding() -> None:
    findings = [
        Finding("clip", Action.WARN, "w", {"x": 1.0}),
        Finding("finite", Action.FLUSH, "f", {"loss": math.nan}),
        Finding("reorder", Action.PASS, "p", {}),
    ]
    verdict = Verdict.of(findings)
    assert verdict.action is Action.FLUSH and verdict.findings == findings
    assert Verdict.of([]).action is Action.PASS


def test_to_dict_is_strict_json_with_action_names() -> None:
    verdict = Verdict.of([Finding("finite", Action.FLUSH, "loss is nan", {"loss": math.nan})])
    data = verdict.to_dict()
    assert data == {
        "action": "FLUSH",
        "findings": [
            {
                "guard": "finite",
                "action": "FLUSH",
                "message": "loss is nan",
                "evidence": {"loss": "nan"},
            }
        ],
    }
    json.dumps(data, allow_nan=False)
    back = Verdict.from_dict(data)
    assert back.action is Action.FLUSH and math.isnan(back.findings[0].evidence["loss"])
