"""Incidents carry their attribution: each new incident's first step, attributed to its
samples (forensics/attribution.py) off the training path, stored with the incident.

    attributor = IncidentAttributor(run_dir, config.attribution, store_url=config.store_url)
    recorder = FlightRecorder(run_dir, config, on_incident=attributor.submit)
    ...
    recorder.close()
    attributor.close()  # bounded: what is left says "attribution not computed: daemon stopped"

`submit` only queues (the recorder's writer calls it after an incident's commit). One worker
thread runs the queue one incident at a time, each in a child process
(`python -m grpod.forensics.incident_attribution`: niced, and SCHED_IDLE on Linux,
`[forensics.attribution] threads` torch threads, paced to `run_fraction` of a core
(forensics/pace.py), the torchrun environment removed) that rebuilds the step from the
store and prints its attribution as one JSON line; the worker
stores it (`incident_attributions`, schema 0007), or a note instead: a step over
`max_samples`, more than `max_pending` waiting, a child past `max_seconds` or `max_rss_mib`
(stopped), a child that failed (its last line), or a daemon that stopped first (its
`shutdown_wait_seconds` spent). Nothing read back is unpickled: the child's JSON only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select

from grpod.forensics.config import AttributionConfig
from grpod.forensics.errors import ForensicsError
from grpod.forensics.models import IncidentAttribution
from grpod.forensics.pace import FreePipe, Pace
from grpod.forensics.store import Store

MODULE = "grpod.forensics.incident_attribution"
STATUSES = ("done", "skipped", "failed", "stopped")
STOPPED = "attribution not computed: daemon stopped"
POLL_SECONDS = 0.2  # how often a running child's time, memory and the stop are checked
# the child must not join (or wait for) the daemon's process group under torchrun
TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class AttributionRecord:
    """An incident's attribution as stored: `attribution` is `StepAttribution.to_dict()`
    when `status` is "done", else None and `note` says why."""

    incident_id: int
    step: int
    status: str
    note: str
    seconds: float | None = None
    attribution: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """What an incident's JSON carries: `samples` (ranked: each with `index`,
        `prompt_id`, `share`, ...), `nonfinite` ({sample, token, module, ...} or None) and
        `attribution` (status, note, seconds, the step and its gradient check)."""
        data = self.attribution or {}
        head = {k: v for k, v in data.items() if k not in ("samples", "nonfinite")}
        return {
            "samples": data.get("samples", []),
            "nonfinite": data.get("nonfinite"),
            "attribution": {
                **head,
                "step": self.step,
                "status": self.status,
                "note": self.note,
                "seconds": data.get("seconds"),  # the attribution's own
                "process_seconds": self.seconds,  # its child process's wall: start to end
            },
        }

    @property
    def top(self) -> dict[str, Any] | None:
        """The first-ranked sample (None: no attribution)."""
        samples = (self.attribution or {}).get("samples") or []
        return samples[0] if samples else None

    def log_fields(self) -> dict[str, Any]:
        """The record's headline, as the daemon's `incident attributed` line carries it."""
        top = self.top or {}
        return dict(
            incident=self.incident_id,
            attributed_step=self.step,
            status=self.status,
            note=self.note,
            seconds=self.seconds,
            top_sample=top.get("index"),
            top_share=top.get("share"),
            nonfinite=(self.attribution or {}).get("nonfinite"),
        )


@dataclass(frozen=True)
class _Job:
    incident_id: int
    step: int
    num_samples: int
    behind: int  # jobs pending when it was submitted


_STOP = object()


def save_attribution(store: Store, record: AttributionRecord) -> None:
    """Insert or replace the attribution row of `record.incident_id`."""
    text = None if record.attribution is None else json.dumps(record.attribution)
    with store.session() as session:
        row = session.scalars(
            select(IncidentAttribution).where(IncidentAttribution.incident_id == record.incident_id)
        ).first()
        values = dict(
            step=record.step,
            status=record.status,
            note=record.note,
            seconds=record.seconds,
            attribution_json=text,
            created_at=datetime.now(timezone.utc),
        )
        if row is None:
            session.add(IncidentAttribution(incident_id=record.incident_id, **values))
        else:
            for name, value in values.items():
                setattr(row, name, value)


def load_attribution(session: Any, incident_id: int) -> AttributionRecord | None:
    """The stored attribution of an incident (None: none was stored)."""
    row = session.scalars(
        select(IncidentAttribution).where(IncidentAttribution.incident_id == incident_id)
    ).first()
    if row is None:
        return None
    data = None if row.attribution_json is None else json.loads(row.attribution_json)
    return AttributionRecord(row.incident_id, row.step, row.status, row.note, row.seconds, data)


def child_command(
    run_dir: str | os.PathLike,
    incident_id: int,
    config: AttributionConfig,
    store_url: str = "",
    run_device: str = "cpu",
) -> list[str]:
    """The child process that attributes one incident (of a run on `run_device`) and prints
    its JSON."""
    command = [sys.executable, "-m", MODULE, "--run-dir", str(run_dir)]
    command += ["--incident", str(incident_id), "--threads", str(config.threads)]
    command += ["--nice", str(config.nice), "--run-fraction", str(config.pace(run_device))]
    command += ["--idle"] if config.idle else []
    command += ["--device", config.device] if config.device else []
    return command + (["--store-url", store_url] if store_url else [])


class IncidentAttributor:
    """Attributes incidents one at a time in child processes; see the module docstring.

    `on_done(record)` runs on the worker thread after each record is stored (the daemon's
    metrics); `command(incident_id)` overrides the child's command line (tests); `run_device`:
    the run's device (the pace's default, `AttributionConfig.pace`)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: AttributionConfig | None = None,
        *,
        store_url: str = "",
        busy_timeout_ms: int = 10_000,
        on_done: Callable[[AttributionRecord], None] | None = None,
        command: Callable[[int], Sequence[str]] | None = None,
        run_device: str = "cpu",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config or AttributionConfig()
        self.store_url, self.busy_timeout_ms = store_url, busy_timeout_ms
        self.on_done = on_done
        self.command = command or (
            lambda incident: child_command(
                self.run_dir, incident, self.config, store_url, run_device
            )
        )
        self.totals = dict.fromkeys(STATUSES, 0)  # records stored, by status
        self.error: BaseException | None = None  # the worker's failure (it then only drains)
        self._queue: queue.Queue = queue.Queue()  # unbounded: `max_pending` skips, never blocks
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._deadline = float("inf")  # the stop's: a child still running after it is killed
        self._store: Store | None = None
        self._thread = threading.Thread(target=self._work, name="grpod-attribution", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Incidents submitted and not yet stored (the one running included)."""
        return self._pending

    def submit(self, incident_id: int, step: int, num_samples: int) -> None:
        """Queue the attribution of incident `incident_id` (its first step `step`, of
        `num_samples` samples). Never blocks; after `close` nothing runs it (the incident
        keeps no attribution: `--by-sample` computes one)."""
        with self._lock:
            behind, self._pending = self._pending, self._pending + 1
        self._queue.put(_Job(incident_id, step, num_samples, behind))

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is pending; False when `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, wait_seconds: float | None = None) -> None:
        """Stop: the queue gets `wait_seconds` (default the config's
        `shutdown_wait_seconds`) to finish, then the running child is killed; it and every
        pending one are stored as "attribution not computed: daemon stopped"."""
        wait = self.config.shutdown_wait_seconds if wait_seconds is None else wait_seconds
        self._deadline = time.monotonic() + wait
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(timeout=wait + 10 * POLL_SECONDS + 5.0)  # + the stored notes
        if self._store is not None and not self._thread.is_alive():
            self._store.close()

    # ----------------------------------------------------------------- worker thread
    def _work(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # below the trainer, as the writer
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.nice)
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                try:
                    record = self._decide(job)
                except Exception as exc:  # the child could not start (its program, memory)
                    note = f"attribution failed: {type(exc).__name__}: {exc}".splitlines()[0]
                    record = AttributionRecord(job.incident_id, job.step, "failed", note)
                self._save(record)
            except BaseException as exc:  # a store that failed: keep draining, never hang
                self.error = exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _decide(self, job: _Job) -> AttributionRecord:
        config = self.config
        skipped = ""
        if not config.enabled:
            skipped = "attribution not computed: [forensics.attribution] enabled = false"
        elif job.num_samples > config.max_samples:
            skipped = (
                f"attribution skipped: step {job.step} has {job.num_samples} samples, over "
                f"[forensics.attribution] max_samples = {config.max_samples}; "
                f"`grpod incidents show {job.incident_id} --by-sample` computes it"
            )
        elif job.behind >= config.max_pending:
            skipped = (
                f"attribution skipped: {job.behind} incidents were waiting for theirs "
                f"([forensics.attribution] max_pending = {config.max_pending})"
            )
        if skipped:
            return AttributionRecord(job.incident_id, job.step, "skipped", skipped)
        if self._stopping.is_set() and time.monotonic() >= self._deadline:
            return AttributionRecord(job.incident_id, job.step, "stopped", STOPPED)
        return self._run_child(job)

    def _run_child(self, job: _Job) -> AttributionRecord:
        """Run the child for `job` within the time, memory and stop bounds."""
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        threads = str(self.config.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
        started = time.monotonic()
        pipe = FreePipe()  # closed at the stop: the child runs unpaced from then on
        try:
            child = subprocess.Popen(
                list(self.command(job.incident_id)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env={**env, **pipe.env()},
                pass_fds=(pipe.read_fd,),
                text=True,
            )
            pipe.started()
            stopped = ""
            while True:
                if self._stopping.is_set():
                    pipe.free()
                try:
                    out, err = child.communicate(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    stopped = self._over_bounds(child.pid, time.monotonic() - started)
                    if stopped:
                        child.kill()
                        out, err = child.communicate()
                        break
        finally:
            pipe.close()
        seconds = round(time.monotonic() - started, 3)
        if stopped:
            status = "stopped" if stopped == STOPPED else "failed"
            return AttributionRecord(job.incident_id, job.step, status, stopped, seconds)
        if child.returncode != 0:
            lines = [line for line in err.splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit status {child.returncode}"
            return AttributionRecord(
                job.incident_id, job.step, "failed", f"attribution failed: {last}", seconds
            )
        try:
            data = json.loads(out)
        except ValueError:
            return AttributionRecord(
                job.incident_id, job.step, "failed", "attribution failed: no JSON", seconds
            )
        note = str(data.get("note", ""))
        return AttributionRecord(job.incident_id, job.step, "done", note, seconds, data)

    def _over_bounds(self, pid: int, elapsed: float) -> str:
        """Why a running child must stop now ('' when it may go on)."""
        config = self.config
        if self._stopping.is_set() and time.monotonic() >= self._deadline:
            return STOPPED
        if elapsed > config.max_seconds:
            return (
                f"attribution stopped after {elapsed:.0f} s: over [forensics.attribution] "
                f"max_seconds = {config.max_seconds:g}"
            )
        rss = rss_mib(pid)
        if rss is not None and rss > config.max_rss_mib:
            return (
                f"attribution stopped at {rss:.0f} MiB resident: over [forensics.attribution] "
                f"max_rss_mib = {config.max_rss_mib}"
            )
        return ""

    def _save(self, record: AttributionRecord) -> None:
        if self._store is None:
            self._store = Store(
                self.run_dir, self.store_url, create=False, busy_timeout_ms=self.busy_timeout_ms
            )
        save_attribution(self._store, record)
        self.totals[record.status] += 1
        if self.on_done is not None:
            self.on_done(record)


def rss_mib(pid: int) -> float | None:
    """The resident memory of process `pid` in MiB (None: not readable, e.g. not Linux)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


# ----------------------------------------------------------------- the child process
def _orphaned(parent: int) -> None:
    """Exit when the daemon that started this process is gone (its result has no reader)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def lower_priority(nice: int, idle: bool) -> None:
    """This process below the trainer: `nice` added to its niceness, and with `idle` Linux's
    SCHED_IDLE class, where it runs only on a core no other process wants and a waking
    trainer thread preempts it at once (nice alone waits for its slice). Where either call is
    missing or refused, the process runs as it is."""
    with contextlib.suppress(OSError):
        os.nice(nice)
    if idle:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def idle_class() -> bool:
    """Whether this process runs in Linux's SCHED_IDLE class (stored with the attribution)."""
    try:
        return os.sched_getscheduler(0) == os.SCHED_IDLE
    except (AttributeError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    """The child: attribute one incident, print `StepAttribution.to_dict()` as one JSON line
    (exit 0); bad input: one line on stderr, exit 2; anything else: exit 1."""
    started = time.monotonic() - time.process_time()  # the start as if it ran all along
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--incident", type=int, required=True)
    parser.add_argument("--store-url", default="")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nice", type=int, default=19)
    parser.add_argument("--idle", action="store_true", help="Linux: the SCHED_IDLE class")
    parser.add_argument("--device", default="")
    parser.add_argument("--run-fraction", type=float, default=1.0)
    args = parser.parse_args(argv)
    lower_priority(args.nice, args.idle)
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    import torch

    torch.set_num_threads(args.threads)
    pace = Pace.from_env(args.run_fraction, started)
    pace.pace()  # the imports' CPU counts too
    from grpod.forensics.attribution import attribute

    pace.pace()
    pace.install()

    try:
        result = attribute(
            args.run_dir,
            incident_id=args.incident,
            store_url=args.store_url,
            threads=args.threads,
            device=args.device,
        )
    except ForensicsError as exc:
        print(f"incident {args.incident}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                **result.to_dict(),
                "paced_seconds": round(pace.slept_seconds, 3),
                "idle_class": idle_class(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
