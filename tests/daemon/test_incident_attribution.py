"""A poisoned step's incident names the sample (and the layer of a NaN) without anyone
opening Python: `grpod run` attributes each new incident off the training path, and
`grpod incidents show ID` prints it, `--json` under `samples` / `nonfinite`.

The tiny model on the forensics campaign's batch (tests/forensics/campaign.py `TINY`): step 1
has sample 13 poisoned; nan-logits is FLUSHed by the finite guard, loss-scale (its loss x100:
a grad norm ~12x step 0's) WARNed by the clip guard set to its first step's baseline. The
daemon waits for the attribution at exit (`shutdown_wait_seconds`), which the test waits on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.daemon.helpers import GRPOD, Grpod, write_config
from tests.forensics.campaign import TINY

STEP, INDEX, LAYER = 1, 13, 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nan-logits", "loss-scale"])
def test_a_poisoned_step_s_incident_names_the_sample(tmp_path: Path, kind: str) -> None:
    faults = {
        "poison_sample_steps": [STEP],
        "poison_sample_index": INDEX,
        "poison_sample_kind": kind,
        "poison_sample_layer": LAYER,
    }
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**TINY, "faults": faults},
            "guards.clip": {"window": 1, "baseline_steps": 1, "fraction_max": 0.0},
            # nice 0, not idle: a nice-19 or idle child beside the suite's busy processes starves
            "forensics.attribution": {"shutdown_wait_seconds": 600, "nice": 0, "idle": False},
            "daemon": {
                "metrics": False,
                "log_format": "json",
                "progress": "off",
                "checkpoint_every": 2,
                "max_steps": STEP + 2,
            },
        },
    )
    daemon = Grpod(["--config", str(config), "--run-dir", "run"], cwd=tmp_path)
    assert daemon.wait(timeout=900) == 0, daemon.stderr

    def grpod(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [GRPOD, *args, "--run-dir", "run"], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done

    incidents = json.loads(grpod("incidents", "list", "--json").stdout)
    incident = next(i for i in incidents if i["step"] == STEP)  # later steps may have their own
    ident = str(incident["id"])
    (attributed,) = [
        e
        for e in daemon.events
        if e["event"] == "incident attributed" and e["incident"] == incident["id"]
    ]
    assert attributed["status"] == "done" and attributed["top_sample"] == INDEX
    shown = json.loads(grpod("incidents", "show", ident, "--json").stdout)
    assert shown["attribution"]["status"] == "done", shown["attribution"]["note"]
    assert shown["samples"][0]["index"] == INDEX
    assert {"index", "prompt_id", "share"} <= set(shown["samples"][0])
    text = grpod("incidents", "show", ident).stdout
    assert "attribution (computed by the daemon when the incident opened)" in text
    assert f"#1 sample {INDEX} " in text
    if kind == "nan-logits":
        module = f"model.layers.{LAYER}.mlp.down_proj"
        assert shown["action"] == "FLUSH"
        assert shown["nonfinite"]["sample"] == INDEX and shown["nonfinite"]["module"] == module
        assert f"non-finite: born at {module} output, sample {INDEX}" in text
    else:
        assert shown["action"] == "WARN" and shown["nonfinite"] is None
        assert shown["samples"][0]["share"] > 0.5
