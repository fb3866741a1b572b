"""grpod.integrations.trl on real TRL 1.16 steps of a tiny HF model (CPU).

One guarded campaign covers the recorder, the CLI readers, the metrics scrape and three
faults: a NaN advantage (the loss is NaN: trl#6702), an inf gradient, and a halved
num_items_in_batch (the seed's accounting bug). Each is flushed with the weights, AdamW state
and LR schedule bit-identical; `grpod replay` reproduces the recorded steps through TRL's
own loss.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from transformers import TrainerCallback

from tests.daemon.helpers import GRPOD
from tests.dashboards.helpers import CONTRACT, load_alert_rules, metric_names, promtool
from tests.integrations.trlrun import Faults, build_trainer, constant_reward, state_digest

NAN_STEP, INF_STEP, ACCOUNTING_STEP, STEPS = 1, 2, 3, 5


class _Watch(TrainerCallback):
    """The state digest after every step, and a scrape of /metrics after the last one."""

    def __init__(self, trainer: Any, scrape_at: int) -> None:
        self.trainer, self.scrape_at = trainer, scrape_at
        self.digests: dict[int, str] = {}
        self.scrape = ""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.digests[0] = state_digest(self.trainer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.digests[state.global_step] = state_digest(self.trainer)
        if state.global_step == self.scrape_at:
            with urllib.request.urlopen(self.trainer.grpod_sink.metrics_url, timeout=30) as r:
                self.scrape = r.read().decode()


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`grpod ARGS` in this process (TRL and torch are imported once, not per command)."""
    from grpod.daemon.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


class _Lines(logging.Handler):
    """The messages of grpod's lines in TRL's logging (`trl.grpod`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Logs(TrainerCallback):
    """Every dict TRL logs (what its console prints)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append({**(logs or {}), "step": state.global_step})


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trl")
    faults = Faults({NAN_STEP}, {INF_STEP}, {ACCOUNTING_STEP})
    trainer = build_trainer(root, max_steps=STEPS, faults=faults, metrics_port=0)
    watch, logged, lines = _Watch(trainer, STEPS), _Logs(), _Lines()
    trainer.add_callback(watch)
    trainer.add_callback(logged)
    logging.getLogger("trl.grpod").addHandler(lines)
    try:
        trainer.train()
    finally:
        logging.getLogger("trl.grpod").removeHandler(lines)
    return {
        "root": root,
        "run": root / "run",
        "trainer": trainer,
        "watch": watch,
        "logs": logged.logs,
        "lines": lines.lines,
    }


def test_faults_are_flushed_and_leave_state_bit_identical(campaign: dict[str, Any]) -> None:
    from grpod.forensics import Store

    store = Store(campaign["run"], create=False)
    try:
        with store.session() as session:
            rows = [store.latest_step(session, s) for s in range(STEPS)]
            outcomes = [r.outcome for r in rows]
            verdicts = [json.loads(r.verdict_json) for r in rows]
    finally:
        store.close()
    assert outcomes == ["applied", "flushed", "flushed", "flushed", "applied"]
    guards = {s: {f["guard"] for f in v["findings"]} for s, v in enumerate(verdicts)}
    assert "finite" in guards[NAN_STEP] and "finite" in guards[INF_STEP]
    assert guards[ACCOUNTING_STEP] == {"accounting"}
    digests = campaign["watch"].digests
    # weights, AdamW moments and step counts, and the LR schedule: untouched by the flushes
    assert digests[1] == digests[2] == digests[3] == digests[4]
    assert digests[0] != digests[1] and digests[4] != digests[5]
    trainer = campaign["trainer"]
    assert trainer.state.global_step == STEPS  # TRL counts the flushed steps too
    assert trainer.grpod_optimizer.declined_total == 3
    assert trainer.lr_scheduler.inner.last_epoch == 2  # the schedule moved on applied steps only


def test_cli_readers_work_on_the_trl_run(campaign: dict[str, Any]) -> None:
    run = str(campaign["run"])
    status = json.loads(_cli("status", "--run-dir", run, "--json").stdout)
    assert status["outcomes"] == {"applied": 2, "flushed": 3} and status["state"] == "finished"
    listed = json.loads(_cli("incidents", "list", "--run-dir", run, "--json").stdout)
    assert {(i["guard"], i["step"]) for i in listed} >= {("finite", NAN_STEP)}
    accounting = next(i for i in listed if i["guard"] == "accounting")
    shown = _cli("incidents", "show", str(accounting["id"]), "--run-dir", run, "--samples", "2")
    assert shown.returncode == 0, shown.stderr
    assert "sample 1 (group" in shown.stdout and "completion:" in shown.stdout
    fsck = _cli("fsck", "--run-dir", run)
    assert fsck.returncode == 0 and "ok" in fsck.stdout, fsck.stdout + fsck.stderr
    plot = _cli("plot", "--run-dir", run, "--out", str(campaign["root"] / "plot.png"))
    assert plot.returncode == 0, plot.stderr


def test_a_trl_user_sees_one_grpod_line_per_finding_and_the_verdict_in_the_logs(
    campaign: dict[str, Any],
) -> None:
    lines = campaign["lines"]
    listed = json.loads(
        _cli("incidents", "list", "--run-dir", str(campaign["run"]), "--json").stdout
    )
    for step, guard in (
        (NAN_STEP, "finite"),
        (INF_STEP, "finite"),
        (ACCOUNTING_STEP, "accounting"),
    ):
        incident = next(i["id"] for i in listed if i["guard"] == guard and i["step"] <= step)
        # one line per finding (the finite guard finds the loss and a micro's loss at once)
        mine = [line for line in lines if f"grpod: step {step} FLUSH {guard}: " in line]
        assert mine and all(m.endswith(f"(incident {incident})") for m in mine), lines
    assert all("\n" not in line for line in lines)
    verdicts = {log["step"]: log.get("grpod/verdict") for log in campaign["logs"] if "loss" in log}
    assert verdicts[NAN_STEP + 1] == verdicts[INF_STEP + 1] == 2.0  # FLUSH, logged after it
    flushed = [log.get("grpod/flushed") for log in campaign["logs"] if "loss" in log]
    assert flushed == [0.0, 1.0, 1.0, 1.0, 0.0]
    status = json.loads(_cli("status", "--run-dir", str(campaign["run"]), "--json").stdout)
    assert status["run_id"]
    from grpod.daemon.runinfo import device_name
    from grpod.forensics import Store

    store = Store(campaign["run"], create=False)
    try:
        with store.session() as session:
            (run_id,) = store.run_ids(session)
            recorded = store.run(session, run_id).device
    finally:
        store.close()
    assert recorded == device_name(campaign["trainer"].accelerator.device)


def test_grpod_run_on_a_trl_run_dir_says_how_to_resume_it(campaign: dict[str, Any]) -> None:
    before = sorted(p.name for p in campaign["run"].iterdir())
    done = subprocess.run(
        [GRPOD, "run", "--run-dir", str(campaign["run"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"grpod run: error: run dir {campaign['run']}: recorded by a TRL script "
        "(grpod.integrations.trl), not by grpod run; resume it by running that script again "
        "with the same GrpodTRLConfig(run_dir=...) and "
        "trainer.train(resume_from_checkpoint=True)"
    ]
    assert sorted(p.name for p in campaign["run"].iterdir()) == before


def test_replay_reproduces_recorded_steps_through_trl(campaign: dict[str, Any]) -> None:
    run = str(campaign["run"])
    nan = json.loads(_cli("replay", "--run-dir", run, "--step", str(NAN_STEP), "--json").stdout)
    assert nan["reproduced"] and nan["recorded"]["loss"] == "nan" == nan["replayed"]["loss"]
    last = _cli("replay", "--run-dir", run, "--step", str(STEPS - 1), "--json")
    result = json.loads(last.stdout)
    # the inf gradient was injected outside the batch: replay says so, at that step
    assert not result["reproduced"] and result["diverged_at"] == INF_STEP
    assert result["field"] == "grad_norm" and last.returncode == 1
    counted = json.loads(
        _cli("replay", "--run-dir", run, "--step", str(ACCOUNTING_STEP), "--json").stdout
    )
    assert counted["diverged_at"] == INF_STEP  # the steps before it re-run: the inf step again


def test_metrics_scrape_has_the_contract_and_passes_promtool(campaign: dict[str, Any]) -> None:
    scrape = campaign["watch"].scrape
    declared = {
        line.split()[2]: line.split()[3]
        for line in scrape.splitlines()
        if line.startswith("# TYPE")
    }
    missing = {n for n, kind in CONTRACT.items() if declared.get(n) != kind}
    assert not missing, sorted(missing)
    alerts = {n for rule in load_alert_rules() for n in metric_names(rule["expr"])}
    assert all(n.split("{")[0] in scrape for n in alerts if n.startswith("grpod_"))
    assert 'grpod_steps_total{outcome="flushed"} 3.0' in scrape
    checked = subprocess.run(
        [promtool(), "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_collapsing_campaign_warns_then_halts_with_a_trl_checkpoint(tmp_path: Path) -> None:
    from grpod.integrations.trl import GrpodHalt

    guards = {
        "entropy": {"window": 2, "floor": 0.5},
        "dead_campaign": {"steps": 4},
        "spike": {"enabled": False},
    }
    trainer = build_trainer(
        tmp_path, max_steps=20, reward_func=constant_reward, guards=guards, collapse=40.0
    )
    with pytest.raises(GrpodHalt) as halt:
        trainer.train()
    assert halt.value.exit_code == 3 and halt.value.result.step == 3
    assert Path(halt.value.checkpoint, "model.safetensors").is_file()  # TRL's own save
    assert trainer.state.global_step == 4  # stopped: should_training_stop
    listed = json.loads(
        _cli("incidents", "list", "--run-dir", str(tmp_path / "run"), "--json").stdout
    )
    episodes = [(i["guard"], i["kind"]) for i in listed]
    assert ("entropy", "floor") in episodes and ("dead_campaign", "") in episodes
    assert len(episodes) == len(set(episodes))  # one incident per episode
    status = json.loads(_cli("status", "--run-dir", str(tmp_path / "run"), "--json").stdout)
    assert status["state"] == "halted" and status["outcomes"] == {"applied": 3, "flushed": 1}


class _Payload:
    """A pickle that, unpickled, writes `marker`: what a hostile training_args.bin could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "unpickled"))


def test_replay_never_unpickles_the_run_dir(campaign: dict[str, Any], tmp_path: Path) -> None:
    """docs/SECURITY.md: a hostile training_args.bin in every checkpoint is never loaded (the
    GRPOConfig comes from the JSON recorded with the run); without that record, one line."""
    import pickle
    import shutil
    import sqlite3

    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Payload(live)))
    assert live.read_text() == "unpickled"  # the payload works: unpickling it would show
    marker = tmp_path / "marker"
    checkpoints = sorted(campaign["root"].glob("out/checkpoint-*"))
    assert checkpoints
    for checkpoint in checkpoints:
        (checkpoint / "training_args.bin").write_bytes(pickle.dumps(_Payload(marker)))
    run = str(campaign["run"])
    nan = _cli("replay", "--run-dir", run, "--step", str(NAN_STEP), "--json")
    assert nan.returncode == 0 and json.loads(nan.stdout)["reproduced"], nan.stderr
    assert not marker.exists()

    bare = tmp_path / "run"
    shutil.copytree(campaign["run"], bare)
    with sqlite3.connect(bare / "grpod.sqlite") as db:
        rows = db.execute("SELECT id, config_json FROM runs").fetchall()
        for run_id, text in rows:
            config = json.loads(text)
            del config["trl"]["args"]
            db.execute("UPDATE runs SET config_json = ? WHERE id = ?", (json.dumps(config), run_id))
    refused = _cli("replay", "--run-dir", str(bare), "--step", str(NAN_STEP))
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr.count("\n") == 1 and "no recorded GRPOConfig" in refused.stderr
    assert not marker.exists()


def test_the_recorded_grpo_config_rebuilds_the_same_config() -> None:
    from trl import GRPOConfig

    from grpod.integrations.trl import trl_config
    from grpod.integrations.trl_replay import grpo_config

    args = GRPOConfig(
        output_dir="out",
        max_steps=5,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        hub_token="not-recorded",
    )
    recorded = json.loads(json.dumps(trl_config(args)))["args"]
    assert recorded["hub_token"] == "<HUB_TOKEN>"  # TrainingArguments masks its tokens
    rebuilt = grpo_config(recorded)
    assert rebuilt.hub_token is None
    assert {k: v for k, v in rebuilt.to_dict().items()} == args.to_dict()
