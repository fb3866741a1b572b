"""scripts/gpu_check.sh --dry-run: the GPU node check parses, finds its inputs and runs every
measurement on the CPU at a tiny size; its JSON keeps the schema the README documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

SECTIONS = ["tests", "numerics", "campaign", "replay", "mfu", "flashinfer", "fsdp2"]
CASES = ["bf16_trunk_fp32_head", "bf16_trunk_bf16_head", "fp32"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("gpu-check")
    out = tmp / "check.json"
    env = {**os.environ, "PYTHON": sys.executable, "GRPOD_GPU_VENV": str(tmp / "venv")}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.with_suffix(".txt").read_text().strip() in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def test_every_section_ran_and_the_table_names_it(dry_run: tuple[dict, str]) -> None:
    record, table = dry_run
    assert record["schema"] == "grpod-gpu-check/1" and record["dry_run"] is True
    assert record["device"]["type"] == "cpu" and record["versions"]["torch"]
    assert record["setup"]["status"] == "ok" and record["setup"]["missing_after"] == []
    assert list(record["sections"]) == SECTIONS
    for name, section in record["sections"].items():
        assert section["status"] in ("ok", "skipped"), (name, section)
        assert section["seconds"] >= 0
        assert any(line.startswith(name) for line in table.splitlines())


def test_numerics_order_the_three_cases(dry_run: tuple[dict, str]) -> None:
    numerics = dry_run[0]["sections"]["numerics"]
    errors = numerics["logprob_error_nats"]
    for case in CASES:
        q = errors[case]
        assert 0 <= q["p50"] <= q["p90"] <= q["p99"] <= q["max"], (case, q)
    # FP32 beats grpod's bf16 trunk + FP32 head, which beats an all-bf16 head
    assert errors["fp32"]["p99"] < errors["bf16_trunk_fp32_head"]["p99"]
    assert errors["bf16_trunk_fp32_head"]["p90"] < errors["bf16_trunk_bf16_head"]["p90"]
    zeroed = numerics["zeroed_target_grad_fraction"]
    assert zeroed["targets_p_ge_0_88"] > 0  # the chosen temperature made confident targets
    assert zeroed["fp32"] == 0.0 and zeroed["bf16_trunk_fp32_head"] == 0.0
    assert 0.0 <= zeroed["bf16_trunk_bf16_head"] <= 1.0
    accumulation = numerics["grad_accumulation_rel_l2"]
    assert list(accumulation) == ["2", "4"]  # the dry run's micros (16 and 256 on a GPU)
    for micros in accumulation.values():
        assert 0 < micros["fp32"] < 1e-5 < micros["bf16"] < 0.1


def test_runs_replay_and_mfu_report_numbers(dry_run: tuple[dict, str]) -> None:
    sections = dry_run[0]["sections"]
    w3 = sections["campaign"]["runs"]["W3_bf16"]
    assert w3["exit"] == 0 and w3["steps"] == 1 and w3["median_s_per_step"] > 0
    assert set(w3["median_phase_seconds"]) >= {"rollout", "grad", "optim"}
    assert w3["peak_rss_mib"] > 0
    replayed = sections["replay"]["deterministic_algorithms"]
    assert replayed["torch_deterministic"] is True
    assert replayed["reproduced"] is True  # CPU replay is bit-exact (an invariant)
    assert all(d["abs"] == 0 for d in replayed["differences"].values())
    mfu = sections["mfu"]
    assert mfu["achieved_gflop_per_s"] > 0 and 0 < mfu["mfu"] < 1
    flashinfer = sections["flashinfer"]
    sampling = flashinfer["sampling"]
    assert 0 <= sampling["tv_distance_torch"] < 0.1 and 0 <= sampling["tv_distance_other"] < 0.1
    assert flashinfer["decode_attention"]["rel_error"] < 1e-5
    engine_tests = sections["tests"]["engine_on_device"]
    assert engine_tests["passed"] > 0 and engine_tests["failures"] == 0
    fsdp2 = sections["fsdp2"]
    assert fsdp2["status"] == "ok" or fsdp2["reason"].startswith("skipped: scale-out")


def test_carried_wheels_install_only_what_is_missing_or_older(tmp_path: Path) -> None:
    from gpu_env import to_install, wheels_in

    for name in ("structlog-0.0.1-py3-none-any.whl", "no_such_dist-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    carried = wheels_in(tmp_path)
    assert set(carried) == {"structlog", "no-such-dist"}
    assert to_install(sys.executable, carried) == [tmp_path / "no_such_dist-1.0-py3-none-any.whl"]
    assert wheels_in(tmp_path / "absent") == {}
