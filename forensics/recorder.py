"""`FlightRecorder`: every step's TransportBatch and StepReport, recorded off the critical path.

`record()` hands the step to a writer thread through a bounded inbox (`_Inbox`); a full inbox
blocks the trainer (and is counted in `blocked_total`), it never drops a step. The writer
commits in groups (`commit_every_steps` steps, or `commit_interval_seconds` after the first of
them), holding up to `queue_size` of a group's batches (and HOLD_BYTES) in memory, beyond which
it stages them early. It is woken when a group is due, not once per step: a step waits in the
inbox until its group is full or its interval is up, unless its verdict is at `incident_action`
or above (it may open an incident) or the inbox is full. At the commit each batch blob is
serialised: one of at most `inline_blob_bytes` into memory, for its row; a larger one into a
temp file, and every such file is fsynced and renamed into place, the directory fsynced once.
Then one transaction adds the blob rows (with the inline bytes), the step rows, for a
distributed step a row per rank naming its slice of the step's global blob
(forensics/ranks.py), and with `start_run(ledger=)` a row per prompt of each step, its fate
(forensics/ledger.py): a group of small batches costs one fsync of the store, not one per
batch. A step that opens an incident (an episode of a finding, forensics/episodes.py) commits
its group at once; so do a noted checkpoint (the steps before it first), `drain()` and
`close()`. A crash loses at most the uncommitted steps, all after the last noted checkpoint,
which a resumed run re-runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert

from grpod.base.jsonsafe import from_json, to_json
from grpod.engine import StepReport, TransportBatch
from grpod.forensics.blobs import BlobStore, StagedBlob
from grpod.forensics.config import ForensicsConfig
from grpod.forensics.episodes import Episode, EpisodeTracker, Observation, write_episode
from grpod.forensics.errors import ForensicsError
from grpod.forensics.ledger import LedgerSpec, eval_rows, step_rows, supersede
from grpod.forensics.models import Blob, Checkpoint, Eval, PromptFate, Run, Step, StepRank
from grpod.forensics.ranks import rank_columns
from grpod.forensics.store import Store

if TYPE_CHECKING:  # engine.grpo.step imports the Engine (torch, transformers): types only here
    from grpod.engine.grpo.step import StepResult

WRITER_NICE = 10  # the writer thread's niceness (a lower priority than the trainer's)
HOLD_BYTES = 64 * 1024**2  # batch bytes a commit group may hold in memory before staging them


_STEP_INSERT = insert(Step)
_RANK_INSERT = insert(StepRank)
_LEDGER_INSERT = insert(PromptFate)


@dataclass
class _StepItem:
    """A queued step. Its report and verdict become dicts on the writer thread (`take`), in
    the group's burst: a published step's report and verdict are never changed again."""

    result: StepResult
    rerun: bool
    arrived: float = 0.0  # time.monotonic() at record(): its group commits by arrived + interval
    nbytes: int = 0  # its batch's tensor bytes
    report: dict[str, Any] = field(default_factory=dict)  # StepReport.to_dict()
    verdict: dict[str, Any] = field(default_factory=dict)
    outcome: str = ""
    context: str | None = None  # the ExecutionContext's JSON (engine/context.py); None: not known
    stale_drops: int = 0  # its rollouts dropped as too stale (engine/rollout/ahead.py)
    seen: Observation | None = None  # what the step did to the episodes (writer thread)

    @property
    def batch(self) -> TransportBatch:
        return self.result.batch

    def take(self) -> None:
        """The step's dicts, from its result (the writer thread)."""
        result = self.result
        self.report = result.report.to_dict()
        self.verdict = result.verdict.to_dict()
        self.outcome = str(result.outcome)
        self.context = None if result.context is None else result.context.as_json
        self.stale_drops = 0 if result.ahead is None else len(result.ahead.dropped)


@dataclass
class _CheckpointItem:
    step: int
    path: str


@dataclass
class _EvalItem:
    row: dict[str, Any]  # the evals row without run_id


@dataclass
class _Staged:
    """A step whose blob is staged and whose row waits for its group's commit."""

    blob: StagedBlob
    row: dict[str, Any]  # the steps row
    seen: Observation | None  # the episodes the step opened, extended or closed
    ranks: list[dict[str, Any]]  # its step_ranks rows without step_id ([]: one process)
    ledger: list[dict[str, Any]]  # its prompts' prompt_ledger rows (forensics/ledger.py)


_STOP = object()
_COMMIT = object()  # drain(): commit what is held now


class _Inbox:
    """The trainer's hand-off to the writer: a list under one lock, with conditions for the
    writer (work is due), the trainer (room in a full inbox) and `drain()` (items done).

    `put` wakes the writer only when it must act: an urgent item (anything but a plain step: a
    step whose verdict is at `incident_action` or above, a checkpoint, an eval, a drain, the
    stop), a group that `put` made full (the writer's held steps and the inbox's), an inbox
    that `put` made full (`queue_size`: the writer takes it before the next `put` has to wait,
    as the old queue drained a step at a time), batches over HOLD_BYTES (the writer's and the
    inbox's: the writer stages them), or a first step while the writer waits with nothing
    uncommitted (its interval starts). Otherwise the step waits here and the writer takes the
    whole group in one wake-up at its deadline, instead of one wake-up (and one hand-off of the
    GIL) per step."""

    def __init__(self, size: int, group: int) -> None:
        self.size = size  # queue_size: a put that finds this many items waits
        self.group = group  # commit_every_steps: the held and waiting steps of a full group
        self.items: list[Any] = []
        self.lock = threading.Lock()
        self.due = threading.Condition(self.lock)  # the writer waits for work
        self.room = threading.Condition(self.lock)  # a trainer waits for room
        self.done = threading.Condition(self.lock)  # drain() waits for its item
        self.urgent = False  # an item the writer must take now
        self.idle = False  # the writer waits with nothing uncommitted (no deadline)
        self.held = 0  # the writer's uncommitted steps, as of its last wait (under the lock)
        self.held_bytes = 0  # the tensor bytes of its batches held in memory, as of then
        self.bytes = 0  # the tensor bytes of the inbox's batches
        self.put_total = self.done_total = 0

    def put(self, item: Any, urgent: bool, nbytes: int = 0) -> tuple[int, bool]:
        """Append `item` (a batch of `nbytes`); (its sequence number for `wait_done`, whether
        the inbox was full)."""
        with self.lock:
            blocked = False
            while len(self.items) >= self.size:
                blocked = self.urgent = True
                self.due.notify()
                self.room.wait()
            self.items.append(item)
            self.put_total += 1
            self.bytes += nbytes
            if urgent or self.held_bytes + self.bytes > HOLD_BYTES:
                self.urgent = True
            if self.urgent or self.idle or self.full():
                self.due.notify()
            return self.put_total, blocked

    def full(self) -> bool:
        """(Under the lock) the inbox is at `size`, or its steps complete the writer's group."""
        return len(self.items) >= self.size or self.held + len(self.items) >= self.group

    def wait_done(self, number: int) -> None:
        """Until the writer has taken and handled the `number`th item."""
        with self.lock:
            while self.done_total < number:
                self.done.wait()

    def mark_done(self, count: int) -> None:
        with self.lock:
            self.done_total += count
            self.done.notify_all()


class FlightRecorder:
    """Records one run directory's steps; one writer thread, one bounded inbox."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: ForensicsConfig | None = None,
        *,
        upgrade: bool = True,
        on_incident: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.config = config or ForensicsConfig()
        # called on the writer thread once an incident's row is committed: (incident id, its
        # first step, that step's samples); the daemon queues its attribution there
        self.on_incident = on_incident
        self.run_dir = Path(run_dir)
        self.store = Store(
            self.run_dir, self.config.store_url, busy_timeout_ms=self.config.busy_timeout_ms
        )
        self.store.refuse_corrupt()
        if upgrade:
            self.store.upgrade()
        else:
            self.store.check_schema()
        self.blobs = BlobStore(self.run_dir)
        # a blob row per digest, its first: no SELECT of the known digests before each insert
        self._blob_rows = self.store.rows_insert(self.store.insert_keeping(Blob, "sha256"))
        self._step_rows = self.store.rows_insert(_STEP_INSERT)  # rows that need no id back
        self._rank_rows = self.store.rows_insert(_RANK_INSERT)
        self._ledger_rows = self.store.rows_insert(_LEDGER_INSERT)
        self.episodes = EpisodeTracker(self.config.incident_action, self.config.episode_gap_steps)
        self.run_id: str | None = None
        self.ledger: LedgerSpec | None = None  # None: no prompt ledger is written
        self.blocked_total = 0  # record() calls that found the queue full and waited
        self.recorded_total = 0  # steps committed by the writer
        self.incidents_total = 0  # incidents (episodes) opened by the writer
        self.incident_steps_total = 0  # committed steps with at least one episode's finding
        self.open_incidents = 0  # episodes open after the last commit
        self.write_seconds_total = 0.0  # the writer's busy time (blob files and rows)
        self.write_cpu_seconds_total = 0.0  # the writer thread's CPU time in that work
        self.commits_total = 0  # transactions that committed steps
        self.takes_total = 0  # the writer's wake-ups with work: each takes the whole inbox
        self._error: BaseException | None = None
        # uncommitted steps, oldest first: held in memory, or staged (writer thread only)
        self._group: list[_StepItem | _Staged] = []
        self._held = self._held_bytes = 0  # held (not yet staged) batches, their tensor bytes
        self._inline_bytes = 0  # bytes of the group's staged inline blobs (in memory)
        self._group_deadline = 0.0  # time.monotonic() by which the group commits
        self._inbox = _Inbox(self.config.queue_size, self.config.commit_every_steps)
        self._taken_steps = 0  # steps the writer took and has not committed (writer thread)
        self._thread = threading.Thread(target=self._write_loop, name="grpod-recorder", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Items (steps, checkpoints, evals) in the inbox, not yet taken by the writer."""
        return len(self._inbox.items)

    @property
    def uncommitted_steps(self) -> int:
        """Steps recorded and not yet committed: in the inbox, taken by the writer, or held."""
        inbox = self._inbox
        with inbox.lock:
            waiting = sum(isinstance(item, _StepItem) for item in inbox.items)
            return waiting + self._taken_steps

    # ----------------------------------------------------------------- trainer side
    def start_run(
        self,
        run_id: str,
        config_json: dict[str, Any],
        versions: dict[str, str],
        device: str,
        *,
        ledger: LedgerSpec | None = None,
        next_step: int | None = None,
    ) -> None:
        """Register the run (idempotent for a resumed run id): config {engine, guards, ...}.
        `ledger`: write the prompt ledger of this data stream; `next_step`: the step the run
        starts at, whose ledger rows on are superseded (forensics/ledger.py)."""
        text = json.dumps(config_json, sort_keys=True)
        with self.store.session() as session:
            run = session.get(Run, run_id)
            if run is None:
                session.add(
                    Run(
                        id=run_id,
                        run_dir=str(self.store.run_dir),
                        config_json=text,
                        config_digest=hashlib.sha256(text.encode()).hexdigest(),
                        versions_json=json.dumps(versions, sort_keys=True),
                        device=device,
                        started_at=_now(),
                        ended_at=None,
                    )
                )
            else:
                run.ended_at = None
            if next_step is not None:
                session.flush()  # the run's row before any ledger row names it
                supersede(session, self.store.run_ids(session), next_step)
            episodes = [Episode.from_row(row) for row in self.store.open_incidents(session)]
        last = self.store.last_recorded_step()
        self.episodes.restore(episodes, -1 if last is None else last)
        self.open_incidents = len(episodes)
        self.run_id, self.ledger = run_id, ledger

    def record(self, result: StepResult, *, rerun: bool = False) -> None:
        """Queue one decided step: its batch, report, verdict, outcome and execution context
        (`StepResult`, read on the writer thread: none of them may change after this call).
        Blocks (counted) only when `queue_size` steps are waiting."""
        self._raise_failure()
        if self.run_id is None:
            raise ForensicsError("flight recorder: record() before start_run()")
        # a finding at incident_action or above may open an incident: durable at once
        urgent = int(result.verdict.action) >= self.episodes.rank
        nbytes = sum(t.nbytes for t in result.batch.tensors().values())
        self._put(_StepItem(result, rerun, time.monotonic(), nbytes), urgent=urgent, nbytes=nbytes)

    def note_checkpoint(self, step: int, path: str | os.PathLike) -> None:
        """A checkpoint taken with engine.step == `step` (the state before step `step`)."""
        self._raise_failure()
        if self.run_id is None:
            raise ForensicsError("flight recorder: note_checkpoint() before start_run()")
        self._put(_CheckpointItem(step, self.store.relative(path)))

    def note_eval(self, result: dict[str, Any]) -> None:
        """A held-out evaluation: {step, samples, temperature, rewards, completion_length_mean,
        seconds}; committed in its own transaction after the steps before it."""
        self._raise_failure()
        if self.run_id is None:
            raise ForensicsError("flight recorder: note_eval() before start_run()")
        row = {k: v for k, v in result.items() if k != "rewards"}
        row["rewards_json"] = json.dumps(to_json(result["rewards"]), sort_keys=True)
        self._put(_EvalItem(row))

    def drain(self) -> None:
        """Wait until everything queued so far is committed (blobs fsynced, rows committed)."""
        if self._thread.is_alive():  # not counted as blocked: the caller asked to wait
            number, _ = self._inbox.put(_COMMIT, True)
            self._inbox.wait_done(number)
        self._raise_failure()

    def close(self) -> None:
        """Commit everything queued, stop the writer, mark the run ended."""
        if self._thread.is_alive():
            self._inbox.put(_STOP, True)
            self._thread.join()
        try:
            self._raise_failure()
            if self.run_id is not None:
                with self.store.session() as session:
                    session.get(Run, self.run_id).ended_at = _now()
        finally:
            self.store.close()

    def _put(self, item: Any, *, urgent: bool = True, nbytes: int = 0) -> None:
        _, blocked = self._inbox.put(item, urgent, nbytes)
        self.blocked_total += blocked

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise ForensicsError(f"flight recorder failed: {self._error}")

    # ----------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        # Linux nice is per thread: the trainer's threads win any contention for a core.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        inbox = self._inbox
        while True:
            items = self._take()
            count = len(items)
            items.reverse()  # popped oldest first: a handled step's batch is not kept alive
            try:
                while items:
                    item = items.pop()
                    if item is _STOP:
                        self._work(self._commit)
                        self._work(self._close_episodes)
                        return
                    self._work(self._write, item)
                if self._group and time.monotonic() >= self._group_deadline:
                    self._work(self._commit)  # the oldest held step waited its interval
            finally:
                inbox.mark_done(count)

    def _take(self) -> list[Any]:
        """Wait until work is due (module doc), then take everything in the inbox."""
        inbox = self._inbox
        interval = self.config.commit_interval_seconds
        with inbox.lock:
            while not inbox.urgent:
                held = inbox.held = len(self._group)
                inbox.held_bytes = self._held_bytes
                if self._error is not None:  # nothing is written: take items as they come
                    deadline = None if not inbox.items else 0.0
                elif inbox.full():
                    break
                elif held:
                    deadline = self._group_deadline
                elif inbox.items:  # the steps' arrival: the oldest commits by its deadline
                    deadline = inbox.items[0].arrived + interval
                else:
                    deadline = None
                inbox.idle = deadline is None
                if deadline is not None:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        break
                    inbox.due.wait(timeout)
                else:
                    inbox.due.wait()
            inbox.urgent = inbox.idle = False
            items, inbox.items, inbox.bytes = inbox.items, [], 0
            self._taken_steps += sum(isinstance(item, _StepItem) for item in items)
            self.takes_total += 1
            inbox.room.notify_all()
        return items

    def _work(self, job: Any, *args: Any) -> None:
        """Run one writer job, timed; the first failure stops all writing (the queue still
        drains, so the trainer never hangs) and surfaces on the trainer's next call."""
        if self._error is not None:
            return
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            job(*args)
        except BaseException as exc:
            self._error = exc
        finally:
            self.write_seconds_total += time.perf_counter() - started
            self.write_cpu_seconds_total += time.thread_time() - cpu

    def _close_episodes(self) -> None:
        """The run stops: its open episodes end with it (a resumed run opens new ones)."""
        episodes = self.episodes.close_all()
        if episodes and self.run_id is not None:
            with self.store.session() as session:
                for episode in episodes:
                    write_episode(session, self.store, self.run_id, episode)
        self.open_incidents = 0

    def _write(self, item: Any) -> None:
        if item is _COMMIT:
            self._commit()
        elif isinstance(item, _CheckpointItem):
            self._commit()  # the steps before a checkpoint are durable before its row
            with self.store.session() as session:
                session.add(
                    Checkpoint(
                        run_id=self.run_id,
                        step=item.step,
                        path=item.path,
                        pinned=False,
                        deleted=False,
                        created_at=_now(),
                    )
                )
        elif isinstance(item, _EvalItem):
            self._commit()
            with self.store.session() as session:
                session.add(Eval(run_id=self.run_id, recorded_at=_now(), **item.row))
                if self.ledger is not None and item.row["samples"]:
                    rows = eval_rows(item.row["step"], item.row["samples"])
                    stamp = dict(run_id=self.run_id, recorded_at=_now())
                    session.execute(_LEDGER_INSERT, [{**row, **stamp} for row in rows])
        else:
            self._hold(item)

    def _hold(self, item: _StepItem) -> None:
        """Hold a step for its group. Its work runs in one burst at the commit (warm caches,
        one handoff of the GIL instead of one per step), or earlier once `queue_size` batches
        or HOLD_BYTES are held (then they are staged into temp files, out of memory)."""
        if not self._group:
            self._group_deadline = item.arrived + self.config.commit_interval_seconds
        item.take()
        item.seen = self.episodes.observe(item.report["step"], item.verdict["findings"])
        self._held += 1
        self._held_bytes += item.nbytes
        if self._held >= self.config.queue_size or self._held_bytes > HOLD_BYTES:
            self._stage_held(item)  # memory: at most queue_size batches queued and as many held
        else:
            self._group.append(item)
        if item.seen.opened or len(self._group) >= self.config.commit_every_steps:
            self._commit()  # an incident is durable as soon as the writer reaches it

    def _stage_held(self, *new: _StepItem) -> None:
        """Stage the held batches (and `new`), then publish the group in one assignment: a
        step counts in `uncommitted_steps` once it is held in memory or its file is staged."""
        group = [*self._group, *new]
        self._group = [self._stage(x) if isinstance(x, _StepItem) else x for x in group]
        self._held = self._held_bytes = 0

    def _stage(self, item: _StepItem) -> _Staged:
        batch = item.batch
        inline_max = self.config.inline_blob_bytes
        if self._inline_bytes + inline_max > HOLD_BYTES:
            inline_max = 0  # the group holds enough inline bytes in memory: a file
        blob = self.blobs.stage(batch.tensors(), batch.metadata(), inline_max)
        if blob.data is not None:
            self._inline_bytes += blob.size
        report = item.report
        scalars = {name: from_json(report[name]) for name in StepReport.SCALARS}
        row = dict(
            run_id=self.run_id,
            step=report["step"],
            outcome=item.outcome,
            rerun=item.rerun,
            verdict_action=item.verdict["action"],
            verdict_json=json.dumps(item.verdict, sort_keys=True),
            batch_digest=blob.digest,
            report_json=json.dumps(report),
            context_json=item.context,
            recorded_at=_now(),
            **scalars,
        )
        keys = dict(run_id=self.run_id, step=report["step"], batch_digest=blob.digest)
        ranks = [{**keys, **columns} for columns in rank_columns(report)]
        ledger = []
        if self.ledger is not None:
            stamp = dict(run_id=self.run_id, recorded_at=row["recorded_at"])
            found = step_rows(
                self.ledger, batch, report, item.verdict, item.outcome, item.stale_drops
            )
            ledger = [{**prompt, **stamp} for prompt in found]
        return _Staged(blob, row, item.seen, ranks, ledger)

    def _commit(self) -> None:
        """Publish the group's blobs (fsync, rename, one directory fsync), then commit its
        blob rows, step rows, rank rows and incidents in one transaction."""
        if not self._group:
            return
        self._stage_held()
        group: list[_Staged] = self._group  # type: ignore[assignment]
        self.blobs.publish([staged.blob for staged in group])  # files complete first
        blobs = {staged.blob.digest: staged.blob for staged in group}
        opened = 0
        new: list[tuple[Episode, int]] = []  # opened episodes, their first step's samples
        with self.store.session() as session:
            conn = session.connection()
            now = _now()
            rows = [
                dict(
                    sha256=digest,
                    size=blob.size,
                    kind="batch",
                    path="" if blob.data is not None else self.blobs.relpath(digest),
                    data=blob.data,
                    created_at=now,
                )
                for digest, blob in blobs.items()
            ]
            self._blob_rows(conn, rows)  # a digest the store has keeps its row
            plain: list[dict[str, Any]] = []  # rows that need no id: one executemany
            ranks: list[dict[str, Any]] = []  # rank rows of the group's distributed steps
            ledger = [prompt for staged in group for prompt in staged.ledger]
            touched: dict[int, Episode] = {}  # by id(): each episode written once per group
            affected = 0
            for staged in group:
                seen = staged.seen
                if seen is not None:
                    touched.update((id(e), e) for e in seen.touched)
                    affected += seen.affected
                if not staged.ranks and (seen is None or not seen.needs_step_id):
                    plain.append(staged.row)
                    continue
                if plain:
                    self._step_rows(conn, plain)
                    plain = []
                # bound parameters: the compiled INSERT is cached, not rebuilt from 40 literals
                step_id = conn.execute(_STEP_INSERT, staged.row).inserted_primary_key[0]
                ranks += [{**rank, "step_id": step_id} for rank in staged.ranks]
                if seen is None:
                    continue
                for episode in seen.opened:
                    episode.first_step_id = episode.worst_step_id = step_id
                    episode.verdict_json = staged.row["verdict_json"]
                    new.append((episode, staged.row["num_samples"]))
                for episode in seen.worse:
                    episode.worst_step_id = step_id
            self._step_rows(conn, plain)
            self._rank_rows(conn, ranks)
            self._ledger_rows(conn, ledger)  # the prompts' fates commit with their steps
            for episode in touched.values():
                opened += episode.incident_id is None
                write_episode(session, self.store, self.run_id, episode)
        self._group = []
        self._taken_steps -= len(group)
        self._inline_bytes = 0
        self.commits_total += 1
        self.recorded_total += len(group)
        self.incidents_total += opened
        self.incident_steps_total += affected
        self.open_incidents = len(self.episodes.open)
        if self.on_incident is not None:
            for episode, samples in new:
                self.on_incident(episode.incident_id, episode.first_step, samples)


def _now() -> datetime:
    return datetime.now(timezone.utc)
