"""Group commit: steps commit in groups; incidents, checkpoints, drain and close commit at once;
a SIGKILL loses only held steps that were never acknowledged, and the store stays clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from sqlalchemy import delete, func, select

from grpod.forensics import (
    BlobStore,
    FlightRecorder,
    ForensicsConfig,
    ForensicsError,
    Store,
    canonical_digest,
    fsck,
)
from grpod.forensics import recorder as recorder_module
from grpod.forensics.blobs import TEMP_PREFIX, encode
from grpod.forensics.models import Blob, Checkpoint, Incident, Run, Step
from tests.forensics.test_store import PASS, WARN, decided, tiny_batch, tiny_report

ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30  # a liveness bound, not a timing assertion
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.002)


def stored(run_dir: Path) -> tuple[list[int], list[int], list[int]]:
    """(recorded steps, incident steps, checkpoint steps) as committed in the store."""
    store = Store(run_dir, create=False)
    with store.session() as session:
        steps = list(session.scalars(select(Step.step).order_by(Step.id)))
        incidents = list(session.scalars(select(Incident.step).order_by(Incident.id)))
        checkpoints = list(session.scalars(select(Checkpoint.step).order_by(Checkpoint.id)))
    store.close()
    return steps, incidents, checkpoints


def test_steps_commit_in_groups_incidents_and_checkpoints_at_once(tmp_path: Path) -> None:
    config = ForensicsConfig(
        commit_every_steps=4, commit_interval_seconds=3600, queue_size=16, inline_blob_bytes=0
    )
    recorder = FlightRecorder(tmp_path, config)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")

    def record(step: int, verdict: dict = PASS) -> None:
        recorder.record(decided(tiny_batch(step), tiny_report(step), verdict, "applied"))

    for step in range(3):
        record(step)
    wait_for(lambda: recorder.uncommitted_steps == 3, "three held steps")
    assert stored(tmp_path) == ([], [], []) and recorder.recorded_total == 0
    record(3)  # the group is full
    wait_for(lambda: recorder.recorded_total == 4, "the first group committed")
    assert stored(tmp_path)[0] == [0, 1, 2, 3] and recorder.commits_total == 1

    record(4)
    record(5, WARN)  # an incident commits its group at once, itself included
    wait_for(lambda: recorder.recorded_total == 6, "the incident's group committed")
    assert stored(tmp_path)[:2] == ([0, 1, 2, 3, 4, 5], [5])

    record(6)
    recorder.note_checkpoint(7, tmp_path / "checkpoints" / "step-00000007")
    wait_for(lambda: stored(tmp_path)[2] == [7], "the checkpoint row")
    assert stored(tmp_path)[0][-1] == 6  # the steps before a checkpoint commit before it

    record(7)
    recorder.drain()  # acknowledged: committed when drain returns
    assert stored(tmp_path)[0] == list(range(8)) and recorder.uncommitted_steps == 0
    record(8)
    recorder.close()
    assert stored(tmp_path)[0] == list(range(9))
    assert (recorder.recorded_total, recorder.incidents_total, recorder.commits_total) == (9, 1, 5)
    blob_dir = tmp_path / "blobs" / "sha256"
    assert not any(p.name.startswith(TEMP_PREFIX) for p in blob_dir.iterdir())
    report = fsck(tmp_path)
    assert report.blobs_checked == 9 and not report.notes
    # every blob is whole; the one problem is the checkpoint this recorder-only test noted
    # without writing it (fsck checks what resume needs)
    assert report.problems == [
        f"checkpoint step 7 ({tmp_path / 'checkpoints' / 'step-00000007'}): missing",
        "no complete checkpoint: resume would refuse (exit 2)",
    ]


def started(run_dir: Path, group: int, inbox: int) -> FlightRecorder:
    """A started recorder whose groups commit by size alone (an hour's interval)."""
    config = ForensicsConfig(
        commit_every_steps=group, commit_interval_seconds=3600, queue_size=inbox
    )
    recorder = FlightRecorder(run_dir, config)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    return recorder


def test_the_writer_takes_a_group_in_one_wake_up(tmp_path: Path) -> None:
    recorder = started(tmp_path, group=8, inbox=8)
    for step in range(7):
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
    # the first step only started the group's interval: all seven wait, none is taken
    assert recorder.queue_depth == 7 and recorder.uncommitted_steps == 7
    assert recorder.takes_total == 0
    recorder.record(decided(tiny_batch(7), tiny_report(7), PASS, "applied"))  # a full group
    wait_for(lambda: recorder.recorded_total == 8, "the group committed")
    assert recorder.takes_total == 1 and recorder.commits_total == 1
    assert stored(tmp_path)[0] == list(range(8))
    recorder.record(decided(tiny_batch(8), tiny_report(8), WARN, "applied"))  # at once
    wait_for(lambda: recorder.recorded_total == 9, "the incident's step committed")
    assert recorder.takes_total == 2 and stored(tmp_path)[1] == [8]
    recorder.close()


def test_a_full_inbox_wakes_the_writer_before_the_trainer_must_wait(tmp_path: Path) -> None:
    recorder = started(tmp_path, group=16, inbox=2)
    for step in range(8):
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
        # every second step fills the inbox: the writer takes both (none waits for it)
        wait_for(lambda: recorder.queue_depth < 2, "the full inbox taken")
    wait_for(lambda: recorder.queue_depth == 0, "the last pair taken")
    assert recorder.takes_total == 4 and recorder.blocked_total == 0
    assert recorder.uncommitted_steps == 8 and recorder.recorded_total == 0
    recorder.close()
    assert stored(tmp_path)[0] == list(range(8))


def test_a_failed_commit_leaves_the_writer_waiting_not_spinning(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, ForensicsConfig(commit_every_steps=2))
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    with recorder.store.session() as session:  # the step rows' run vanishes: the commit fails
        session.execute(delete(Run))
    for step in range(2):  # a full group: its commit fails, the group stays held
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
    wait_for(lambda: recorder._error is not None, "the failed commit")
    takes = recorder.takes_total
    time.sleep(0.2)  # a writer looping on its full group would take thousands of times here
    assert recorder.takes_total == takes
    with pytest.raises(ForensicsError, match="flight recorder failed"):
        recorder.drain()
    with pytest.raises(ForensicsError, match="flight recorder failed"):
        recorder.close()


def test_a_quiet_group_commits_after_the_interval(tmp_path: Path) -> None:
    config = ForensicsConfig(commit_every_steps=1000, commit_interval_seconds=0.05)
    recorder = FlightRecorder(tmp_path, config)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    recorder.record(decided(tiny_batch(0), tiny_report(0), PASS, "applied"))
    wait_for(lambda: recorder.recorded_total == 1, "the interval's commit")
    assert stored(tmp_path)[0] == [0]
    recorder.close()


def test_commit_every_step_is_one_commit_per_step(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, ForensicsConfig(commit_every_steps=1))
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    for step in range(3):
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
    recorder.close()
    assert recorder.commits_total == 3 and stored(tmp_path)[0] == [0, 1, 2]


@pytest.mark.slow  # the fast tier stays under ~2 minutes
@pytest.mark.parametrize("inline_bytes", [0, 1 << 20], ids=["files", "inline"])
def test_sigkill_loses_only_unacknowledged_uncommitted_steps(
    tmp_path: Path, inline_bytes: int
) -> None:
    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.forensics.group_writer", str(run_dir), str(inline_bytes)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.split() == ["8", "2"], line  # 8 committed, 2 held
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    steps, incidents, _ = stored(run_dir)
    assert steps == list(range(8))  # drained 0-4, then the incident's group 5-7; 8-9 lost
    assert incidents == [7]
    store, blobs = Store(run_dir, create=False), BlobStore(run_dir)
    with store.session() as session:
        digests = list(session.scalars(select(Step.batch_digest)))
        assert session.scalar(select(func.count()).select_from(Step)) == 8
        for digest in digests:  # complete and verified, in its file or its row
            blob = session.get(Blob, digest)
            assert (blob.path == "") == (blob.data is not None) == bool(inline_bytes)
            blobs.verify(digest, blob.data)
    store.close()
    files = sorted(p.name for p in blobs.root.iterdir()) if blobs.root.is_dir() else []
    assert files == ([] if inline_bytes else sorted(set(digests)))  # 8-9: memory only
    assert fsck(run_dir).ok and not fsck(run_dir).notes


def test_held_batches_past_the_memory_cap_are_staged_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recorder_module, "HOLD_BYTES", 1)  # every batch is over the cap
    config = ForensicsConfig(commit_every_steps=8, commit_interval_seconds=3600)
    recorder = FlightRecorder(tmp_path, config)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    for step in range(3):
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))

    def temps() -> list[Path]:  # the writer makes the directory at its first blob
        root = recorder.blobs.root
        if not root.exists():
            return []
        return [p for p in root.iterdir() if p.name.startswith(TEMP_PREFIX)]

    # each batch over the cap wakes the writer, which stages it: on disk, not yet committed
    wait_for(lambda: len(temps()) == 3, "three staged batches")
    wait_for(lambda: recorder.uncommitted_steps == 3, "three held steps")
    assert stored(tmp_path)[0] == []
    recorder.close()
    assert stored(tmp_path)[0] == [0, 1, 2]
    assert fsck(tmp_path).ok and not fsck(tmp_path).notes


def test_encode_writes_what_safetensors_reads() -> None:
    tensors = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.arange(12).reshape(3, 4).t(),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "ids": torch.arange(7, dtype=torch.int32),
    }
    meta = {"step": "3", "format": "x"}
    digest, chunks = encode(tensors, meta)
    data = b"".join(chunks)
    loaded = load(data)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert digest == canonical_digest(tensors, meta)
    assert load(save({n: t.contiguous() for n, t in tensors.items()}, metadata=meta)).keys() == (
        loaded.keys()
    )
    header_length = int.from_bytes(data[:8], "little")
    assert (8 + header_length) % 8 == 0  # the tensor bytes start 8-byte aligned


def test_encode_header_is_the_metadata_and_layout_of_each_batch() -> None:
    """The tensors' part of the header is built once per layout: two batches of one layout
    and different metadata (or none) each carry their own, in the bytes json.dumps writes."""
    tensors = {"ids": torch.arange(6).reshape(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool)}
    for meta in ({"step": "1", "format": "x"}, {"step": "2"}, {}):
        data = b"".join(encode(tensors, meta)[1])
        length = int.from_bytes(data[:8], "little")
        layout = {
            "ids": {"dtype": "I64", "shape": [2, 3], "data_offsets": [0, 48]},
            "mask": {"dtype": "BOOL", "shape": [2, 3], "data_offsets": [48, 54]},
        }
        header = {"__metadata__": meta, **layout} if meta else layout
        assert (
            data[8 : 8 + length].rstrip(b" ") == json.dumps(header, separators=(",", ":")).encode()
        )
        assert load(data)["ids"].tolist() == tensors["ids"].tolist()


def test_a_digest_staged_twice_is_published_once(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    tensors = {"a": torch.arange(4)}
    first, second = blobs.stage(tensors, {}), blobs.stage(tensors, {})
    blobs.publish([first, second])
    assert [p.name for p in blobs.root.iterdir()] == [first.digest]
    blobs.verify(first.digest)


def test_small_batches_commit_inline_and_large_ones_as_files(tmp_path: Path) -> None:
    small, large = tiny_batch(0), tiny_batch(1)
    large = replace(large, config_digest="x" * 4096)  # past the threshold
    size = {
        s: len(b"".join(encode(b.tensors(), b.metadata())[1])) for s, b in ((0, small), (1, large))
    }
    assert size[0] < 4096 < size[1]
    recorder = FlightRecorder(tmp_path, ForensicsConfig(inline_blob_bytes=4096))
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    recorder.record(decided(small, tiny_report(0), PASS, "applied"))
    recorder.record(decided(large, tiny_report(1), PASS, "applied"))
    recorder.close()
    store, blobs = Store(tmp_path, create=False), BlobStore(tmp_path)
    with store.session() as session:
        rows = {r.step: session.get(Blob, r.batch_digest) for r in session.scalars(select(Step))}
        assert rows[0].path == "" and len(rows[0].data) == rows[0].size == size[0]
        assert rows[1].path == blobs.relpath(rows[1].sha256) and rows[1].data is None
        assert rows[1].size == size[1] == blobs.path(rows[1].sha256).stat().st_size
        for step, batch in ((0, small), (1, large)):
            tensors, metadata = blobs.read(rows[step].sha256, rows[step].data)
            assert metadata == batch.metadata()
            assert all(torch.equal(tensors[n], t) for n, t in batch.tensors().items())
    store.close()
    assert [p.name for p in blobs.root.iterdir()] == [rows[1].sha256]  # no file for the small
    assert fsck(tmp_path).ok and not fsck(tmp_path).notes
