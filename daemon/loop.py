"""The training service: rollout -> guarded step -> metrics and log -> record -> checkpoint.

`Daemon(plan).run()` returns the exit code: 0 finished or stopped (SIGTERM/SIGINT after the
step in flight, a checkpoint and a drained recorder), 3 HALT (after a checkpoint), 2 a reward
that failed mid-run (after a checkpoint; one line on stderr), 1 a failure in the loop,
128+signum when a second stop signal abandoned the step in flight.
Resume: the latest checkpoint the store knows is restored (model, optimizer, schedule, data
cursor, guard state); steps the store recorded after it are re-run and recorded as re-runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.stateful import Stateful

from grpod import torchrun
from grpod.daemon import distributed, logs
from grpod.daemon.config import GrpodConfig, load_config
from grpod.daemon.errors import BAD_INPUT_ERRORS, ConfigError
from grpod.daemon.exitcodes import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_HALT,
    EXIT_OK,
    exit_by_signal,
)
from grpod.daemon.health import Health, HealthServer
from grpod.daemon.metrics import (
    Metrics,
    RankMetrics,
    prepare_multiproc_dir,
    serving_registry,
)
from grpod.daemon.notify import Notifier
from grpod.daemon.progress import Progress, wanted
from grpod.daemon.retention import Retention
from grpod.daemon.rundir import Plan, link_latest
from grpod.daemon.signals import AbandonStep, Signals
from grpod.engine import Engine, distcp
from grpod.engine.batch import TransportBatch
from grpod.engine.config import VLLM_BACKENDS
from grpod.engine.errors import RewardError, SamplerError
from grpod.engine.eval import Evaluator
from grpod.engine.samples import decode_samples
from grpod.engine.step import StepResult, decide_step
from grpod.engine.verdict import Action, Finding, Outcome, Verdict
from grpod.forensics.recorder import FlightRecorder
from grpod.forensics.resume import choose_checkpoint
from grpod.guards import GuardPolicy
from grpod.oneline import one_line

STATUS_INTERVAL_SECONDS = 1.0  # status.json and STATUS= at most this often while running


class Daemon:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.config: GrpodConfig = plan.config
        self.run_dir = plan.run_dir
        cfg = self.config.daemon
        self.rank = torchrun.rank()
        self.progress = Progress(cfg.max_steps) if wanted(cfg.progress) else None
        self.log = logs.make_logger(
            cfg.log_format,
            cfg.log_level,
            before_write=self.progress.clear if self.progress else None,
            drop_events=frozenset({"step"}) if self.progress else frozenset(),
        )
        self.notifier = Notifier()
        self.signals = Signals()
        self.health = Health(cfg.health_max_step_age_seconds)
        self.versions = _versions()
        self.registry = CollectorRegistry()
        self.metrics: Metrics | None = None  # rank 0's, made in _start
        self.rank_metrics: RankMetrics | None = None  # every rank's own
        self.server: HealthServer | None = None
        if cfg.metrics and torchrun.local_rank() == 0:
            try:  # bound before anything is created: a taken port is a config error
                self.server = HealthServer(
                    cfg.metrics_host, cfg.metrics_port, serving_registry(self.registry), self.health
                )
            except OSError as exc:
                raise ConfigError(
                    f"daemon.metrics_port: cannot bind {cfg.metrics_host}:{cfg.metrics_port}: "
                    f"{exc.strerror or exc}"
                ) from None
        self.engine: Engine | None = None
        self.evaluator: Evaluator | None = None
        self.policy: GuardPolicy | None = None
        self.recorder: FlightRecorder | None = None
        self.last_recorded = -1  # the highest step the store held at start: re-runs up to it
        self.checkpointed_step = -1
        self.last_verdict = "none"
        self.last_step: int | None = None  # the last step this process finished
        self.input_failure: str | None = None  # a reward's failure: stop with exit 2
        self.system_failure: str | None = None  # the rollout server's: stop with exit 1
        self._status_written = -math.inf

    # ----------------------------------------------------------------- lifecycle
    def run(self) -> int:
        """Start (or resume), train until max_steps / a stop / HALT, shut down; exit code."""
        self.signals.install()
        logs.bind_run(self.plan.run_id, self.rank)
        try:
            self._start()
        except BaseException as exc:
            if self.recorder is not None:
                with contextlib.suppress(Exception):
                    self.recorder.close()
            self._close_quietly()
            if not self.plan.resume and self.run_dir.held is not None:
                self.run_dir.discard()  # a fresh run that never started must not be resumed
            if isinstance(exc, (*BAD_INPUT_ERRORS, KeyboardInterrupt, SystemExit)):
                raise  # bad input: one line and exit 2 at the CLI
            return self._failed_to_start(exc)
        try:
            return self._loop()
        except AbandonStep:
            return self._abandon("the step in flight was dropped")
        except Exception as exc:  # not the input's (a full disk): one line, exit 1
            reason = failure_reason(exc)
            self.log.error("failed", error=reason)
            print(f"grpod run: error: failed at step {self.engine.step}: {reason}", file=sys.stderr)
            return self._shutdown(EXIT_FAILURE, f"failed: {reason}", checkpoint=False)
        finally:
            self.signals.restore()
            logs.clear()

    def _start_metrics(self) -> None:
        """Rank 0: the step's metrics; every rank: its own. Under torchrun the node's local
        rank 0 first empties its multiprocess directory; no rank has a metric before that."""
        if distributed.world_size() > 1 and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            if torchrun.local_rank() == 0:
                prepare_multiproc_dir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
            distributed.barrier()
        if self.rank == 0:
            self.metrics = Metrics(self.registry, self.versions)
        self.rank_metrics = RankMetrics(self.registry, self.rank)

    def _failed_to_start(self, exc: BaseException) -> int:
        """A system failure before the first step (a full disk): one line, exit 1."""
        reason = failure_reason(exc)
        self.log.error("failed", error=reason)
        print(f"grpod run: error: cannot start: {reason}", file=sys.stderr)
        return EXIT_FAILURE

    def _start(self) -> None:
        plan, cfg = self.plan, self.config
        self.notifier.extend_timeout(cfg.daemon.checkpoint_timeout_seconds)
        if cfg.engine.rollout_backend in VLLM_BACKENDS:  # vLLM's own log lines, as JSON events
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
            logs.forward_library_logs(self.log, logs.VLLM_LOGGERS, cfg.daemon.log_level)
        self.engine = Engine(cfg.engine)  # before the run dir: a bad engine config creates nothing
        if cfg.engine.rollout_backend in VLLM_BACKENDS:  # before the run dir, as the engine
            self._start_sampler()
        if cfg.engine.eval_every:
            self.evaluator = Evaluator(self.engine)
        self.policy = GuardPolicy(cfg.guards)
        if self.rank == 0:  # under torchrun rank 0 owns the run dir and the store
            if not plan.resume:
                plan.run_dir.create(plan.run_id, cfg)
                if plan.link_latest is not None:
                    link_latest(plan.link_latest, plan.run_dir.path)
            else:
                for name in plan.run_dir.remove_stale_temporaries():
                    self.log.warning("removed a half-written checkpoint", path=name)
            self.recorder = FlightRecorder(plan.run_dir.path, cfg.forensics)
            self.recorder.store.lock_run_dir()  # PostgreSQL: one writer per run dir across hosts
        else:
            self.recorder = NoRecorder()
        self._retention = Retention(cfg.forensics)
        distributed.barrier()
        self._start_metrics()
        restored = self._restore()
        if self.progress is not None:
            self.progress.start = self.engine.step
        self.recorder.start_run(plan.run_id, cfg.to_json(), self.versions, _device())
        if self.server is not None:
            self.server.start()
        host, port = self.server.address if self.server else ("", 0)
        self.log.info(
            "started",
            run_dir=str(plan.run_dir.path),
            resumed_from=restored,
            next_step=self.engine.step,
            rerun_through=self.last_recorded,
            max_steps=cfg.daemon.max_steps,
            metrics=f"http://{host}:{port}/metrics" if self.server else None,
            pid=os.getpid(),
        )
        if self.checkpointed_step < 0:
            self._checkpoint("initial")  # replay of the first steps needs a checkpoint before them
        self.health.beat()
        self._publish_status("running")
        self.notifier.ready(self._status_line())

    def _start_sampler(self) -> None:
        """vLLM up before READY and the run dir (what it refuses creates nothing): colocated,
        or grpod's own server (or the named one answering)."""
        self.notifier.extend_timeout(self.config.engine.vllm_server_start_timeout_seconds)
        self.notifier.status("starting vLLM")
        started = time.perf_counter()
        self.engine.start_sampler()
        client, process = (getattr(self.engine.vllm, k, None) for k in ("client", "process"))
        self.log.info(
            "rollout server" if client is not None else "vllm started",
            url=client.url if client is not None else None,
            pid=process.pid if process is not None else None,
            started=process is not None,
            seconds=round(time.perf_counter() - started, 3),
        )

    def _restore(self) -> int | None:
        """Restore the latest checkpoint the store noted; returns its step (None: fresh)."""
        path, self.last_recorded = distributed.agree(self._checkpoint_to_restore)
        if path is not None:
            extra = distcp.load(path, self._states(), self.engine.parallel)
            if "restored" in extra:
                self.log.info(
                    "restored", kept=extra["restored"], saved_world=extra.get("saved_world_size")
                )
            self.checkpointed_step = self.engine.step
            return self.engine.step
        return None

    def _checkpoint_to_restore(self) -> tuple[Path | None, int]:
        """(the newest complete checkpoint the store noted, the highest recorded step). A
        newer missing or damaged one is passed over with a warning naming it and why (its
        steps are re-run); when checkpoints exist and none is complete: exit 2."""
        store = self.recorder.store
        last = store.last_recorded_step()
        recorded = -1 if last is None else last
        choice = choose_checkpoint(store.noted_checkpoints())
        chosen = choice.checkpoint
        for checkpoint, why in choice.skipped:
            self.log.warning(
                "checkpoint missing" if why == "missing" else "skipped a damaged checkpoint",
                step=checkpoint.step,
                path=str(checkpoint.path),
                problem=why,
                resume_from=None if chosen is None else chosen.step,
            )
        if chosen is None and choice.damaged:
            checkpoint, why = choice.damaged[0]
            raise ConfigError(
                f"run dir {self.run_dir.path}: no complete checkpoint to resume from "
                f"(checkpoint step {checkpoint.step}: {why})"
            )
        return (None if chosen is None else chosen.path), recorded

    def _loop(self) -> int:
        max_steps = self.config.daemon.max_steps
        every = self.config.daemon.checkpoint_every
        self.engine.set_horizon(max_steps)  # async steps sample nothing past the last step
        while not distributed.agree_stop(self.signals.stop_requested) and not (
            max_steps and self.engine.step >= max_steps
        ):
            if self.signals.take_reload():
                self._reload_guards()
            with logs.step_context(self.engine.step):
                action = self._step()
            if self.signals.abandon_signal is not None:
                break  # a second stop signal while recording: exit now, no checkpoint
            if self.input_failure is not None:  # a reward that failed: checkpoint, exit 2
                return self._shutdown(EXIT_BAD_INPUT, self.input_failure)
            if self.system_failure is not None:  # the rollout server: checkpoint, exit 1
                print(f"grpod run: error: {self.system_failure}", file=sys.stderr)
                return self._shutdown(EXIT_FAILURE, f"failed: {self.system_failure}")
            if action == Action.HALT:
                return self._shutdown(
                    EXIT_HALT, f"HALT at step {self.engine.step - 1}: {self.last_verdict}"
                )
            if self.engine.step % every == 0:
                self._checkpoint("periodic")
            if self.evaluator is not None and self.engine.step % self.config.engine.eval_every == 0:
                self._evaluate()
                if self.input_failure is not None:  # eval_on_error = "stop"
                    return self._shutdown(EXIT_BAD_INPUT, self.input_failure)
        if self.signals.abandon_signal is not None:
            return self._abandon("after the step in flight")
        if self.signals.stop_requested:
            name = "SIGINT" if self.signals.stop_signal == 2 else "SIGTERM"
            return self._shutdown(EXIT_OK, f"stopped by {name}")
        return self._shutdown(EXIT_OK, f"finished: reached max_steps {max_steps}")

    # ----------------------------------------------------------------- one step
    def _step(self) -> Action:
        engine, policy = self.engine, self.policy
        self.notifier.watchdog()
        self.signals.abortable = True
        try:
            result = decide_step(engine, policy, engine.rollout())
        except RewardError as exc:
            if exc.batch is None:
                raise
            result = self._unscored_step(exc)
        except SamplerError as exc:
            if exc.batch is None:
                raise
            result = self._unsampled_step(exc)
        self.signals.abortable = False

        result = dataclasses.replace(result, ahead=engine.take_ahead_stats())
        rerun = result.step <= self.last_recorded
        # every rank's own numbers before the gather: once rank 0's grpod_step moves, a
        # scrape never sees a rank's a step behind
        self.rank_metrics.observe(result)
        started = time.perf_counter()
        recorded = distributed.gather_step(result)  # rank 0: every rank's batch and report
        if recorded is not None:
            self.recorder.record(recorded, rerun=rerun)
        record_seconds = time.perf_counter() - started
        result = dataclasses.replace(
            result, phase_seconds={**result.phase_seconds, "record": record_seconds}
        )
        if self.metrics is not None:
            self.metrics.observe_step(result, policy.gradnorm_vtc_correlation)
        report, verdict, outcome, phases = (
            result.report,
            result.verdict,
            result.outcome,
            result.phase_seconds,
        )
        self._observe_recorder(self.recorder.queue_depth)
        self.last_verdict = _verdict_text(verdict)
        self.last_step = report.step
        fields: dict[str, Any] = {
            "outcome": outcome,
            "verdict": verdict.action.name,
            **report.scalars(),
            "phase_seconds": {k: round(v, 6) for k, v in phases.items()},
        }
        if report.kv_cache is not None:
            fields["kv_cache"] = dataclasses.asdict(report.kv_cache)
        if report.weight_version is not None:
            fields["weight_version"] = report.weight_version
        if report.weight_sync_max_abs_logprob_diff is not None:
            fields["weight_sync_max_abs_logprob_diff"] = report.weight_sync_max_abs_logprob_diff
        if report.staleness is not None:
            fields["staleness"] = report.staleness
        for dropped in result.ahead.dropped if result.ahead is not None else ():
            self.log.warning("rollout dropped", **dataclasses.asdict(dropped))
        if report.reward_functions:
            fields["rewards"] = report.reward_functions
        if self.config.daemon.log_samples:
            fields["samples"] = decode_samples(
                result.batch,
                engine.tokenizer,
                self.config.engine.stop,
                self.config.daemon.log_samples,
            )
        if verdict.findings:
            fields["findings"] = [
                {"guard": f.guard, "action": f.action.name, "message": f.message}
                for f in verdict.findings
            ]
        if rerun:
            fields["rerun"] = True
        log = self.log.warning if verdict.action >= Action.WARN else self.log.info
        log("step", **fields)
        self.health.beat()
        self.notifier.watchdog()
        if time.monotonic() - self._status_written >= STATUS_INTERVAL_SECONDS:
            self._publish_status("running")
        if self.progress is not None:
            self.progress.update(report.step, report.reward_mean, verdict.action.name)
        return verdict.action

    def _unscored_step(self, exc: RewardError) -> StepResult:
        """A reward failed on the step in flight: nothing is trained on; the step is recorded
        as skipped with its samples (NaN rewards) under a HALT finding of the `reward` guard,
        so an incident keeps them, and the loop stops with exit 2 (the input's fault: no
        restart into the same failure). The cursor stays at the step: after a fix it runs."""
        batch = exc.batch
        finding = Finding(
            "reward", Action.HALT, str(exc), {"sample": float(exc.sample)}, kind="failed"
        )
        self.input_failure = f"step {batch.step}: {exc}"
        return self._failed_step(batch, finding)

    def _unsampled_step(self, exc: SamplerError) -> StepResult:
        """The rollout server failed (exited, hung, garbage) on the step in flight: nothing
        is trained on; the step is recorded as skipped with its prompts under a HALT finding
        of the `rollout` guard (its incident), and the loop stops with exit 1 after a
        checkpoint (not the input's fault: systemd restarts, the step runs again)."""
        finding = Finding("rollout", Action.HALT, str(exc), {}, kind="failed")
        self.system_failure = f"step {exc.batch.step}: {exc}"
        return self._failed_step(exc.batch, finding)

    def _failed_step(self, batch: TransportBatch, finding: Finding) -> StepResult:
        """`batch`'s step recorded as skipped under `finding`; the cursor stays at it."""
        report = self.engine.skip(batch)
        self.engine.step = batch.step
        phases = {**self.engine.take_phase_seconds(), "guards": 0.0}
        verdict = Verdict.of([finding])
        return StepResult(
            batch, report, verdict, Outcome.SKIPPED, phases, context=self.engine.context
        )

    # ----------------------------------------------------------------- checkpoints, reload
    def _checkpoint(self, reason: str) -> None:
        step = self.engine.step
        if step == self.checkpointed_step:
            return
        self.notifier.extend_timeout(self.config.daemon.checkpoint_timeout_seconds)
        self.notifier.status(f"checkpointing step {step}")
        started = time.perf_counter()
        path = distcp.save(  # under torchrun: collective, every rank its shards
            self.run_dir.checkpoint_path(step),
            self._states(),
            self.engine.parallel,
            extra={"run_id": self.plan.run_id},
        )
        linked = 0
        if self.rank == 0:  # under torchrun rank 0 owns the run dir: retention is its own
            linked = self._retention.link_unchanged(path)  # before its row: a complete dir
        self.recorder.note_checkpoint(step, path)  # queued after the steps before it
        seconds = time.perf_counter() - started
        self.checkpointed_step = step
        if self.metrics is not None:
            self.metrics.phase_seconds.labels("checkpoint").observe(seconds)
        self.log.info(
            "checkpoint", reason=reason, path=str(path), seconds=round(seconds, 6), linked=linked
        )
        if self.rank == 0:
            self._retention.apply(self.recorder, self.metrics, self.log)
        self.notifier.watchdog()
        self.notifier.status(self._status_line())

    def _observe_recorder(self, queue_depth: int) -> None:
        """Rank 0: the flight recorder's gauges and running totals."""
        if self.metrics is None:
            return
        self.metrics.observe_recorder(
            queue_depth,
            self.recorder.blocked_total,
            self.recorder.incidents_total,
            self.recorder.uncommitted_steps,
            incident_steps_total=self.recorder.incident_steps_total,
            incidents_open=self.recorder.open_incidents,
        )

    def _states(self) -> dict[str, Stateful]:
        """What a checkpoint holds: the engine (weights, optimizer, schedule, data cursor)
        and the guards' windows and counters."""
        return {"engine": self.engine, "guards": self.policy}

    def _evaluate(self) -> None:
        """Held-out evaluation of the policy as it stands (engine/eval.py): stored, published
        and logged; the policy, the data cursor and the next batch are untouched."""
        try:
            result = self.evaluator.run()
        except RewardError as exc:
            self._eval_failed(exc)
            return
        self.recorder.note_eval(result.to_dict())
        self.policy.observe_eval(result.step, result.rewards)  # reward_hacking's second opinion
        if self.metrics is not None:
            self.metrics.observe_eval(result.step, result.rewards)
            self.metrics.phase_seconds.labels("eval").observe(result.seconds)
        self.log.info("eval", **result.to_dict())

    def _eval_failed(self, exc: RewardError) -> None:
        """An eval reward failed: the eval is stored as failed (total NaN, the error beside
        it) and WARNed; training goes on unless `eval_on_error = "stop"` (then exit 2)."""
        step = self.engine.step
        error = f"eval at step {step}: {exc}"
        self.recorder.note_eval(
            {
                "step": step,
                "samples": 0,
                "temperature": self.config.engine.eval_temperature,
                "rewards": {"total": math.nan, "error": error},
                "completion_length_mean": 0.0,  # NOT NULL (SQLite stores NaN as NULL)
                "seconds": 0.0,
            }
        )
        if self.metrics is not None:
            self.metrics.observe_eval(step, {"total": math.nan})
        stop = self.config.engine.eval_on_error == "stop"
        self.log.warning("eval failed", error=error, action="stop" if stop else "continue")
        if stop:
            self.input_failure = error

    def _reload_guards(self) -> None:
        """SIGHUP: new guard thresholds from the config file; the engine is never reloaded."""
        source = self.plan.config_source
        try:
            fresh = load_config(source)
        except ConfigError as exc:
            self.log.error("reload failed", error=str(exc), kept="previous guards")
            return
        self.policy.reload(fresh.guards)
        ignored = [
            name
            for name in ("engine", "forensics")
            if getattr(fresh, name) != getattr(self.config, name)
        ]
        self.config = self.config.model_copy(update={"guards": fresh.guards})
        self.log.info("reloaded", source=str(source), section="guards", ignored_changes=ignored)

    # ----------------------------------------------------------------- shutdown
    def _shutdown(self, code: int, reason: str, checkpoint: bool = True) -> int:
        self.signals.abortable = False
        stops = self.signals.stop_count  # one more while shutting down ends the linger too
        if self.progress is not None:
            self.progress.finish()
        state = {
            EXIT_OK: "stopped",
            EXIT_HALT: "halted",
            EXIT_FAILURE: "failed",
            EXIT_BAD_INPUT: "refused",
        }.get(code, "abandoned")
        if code == EXIT_BAD_INPUT:  # the input's fault: one line, as the CLI's own errors
            print(f"grpod run: error: {reason}", file=sys.stderr)
        self.notifier.stopping(f"{state}: {reason}")
        self.health.stop(reason)
        if self.metrics is not None:
            self.metrics.halted.set(int(code == EXIT_HALT))
        (self.log.error if code == EXIT_HALT else self.log.info)(
            "stopping", reason=reason, exit_code=code
        )
        if checkpoint:
            self._checkpoint("halt" if code == EXIT_HALT else "stop")
        drained = time.perf_counter()
        try:
            self.recorder.close()
        except Exception as exc:  # a store that failed must not hide the reason we stop
            self.log.error("recorder close failed", error=str(exc))
            code = code or EXIT_FAILURE
        self._observe_recorder(0)  # its uncommitted steps: 0 unless the close failed
        self._publish_status(state, reason=reason, exit_code=code)
        extra: dict[str, Any] = {}
        if self.config.daemon.state_digest_on_exit:
            extra["state_digest"] = self.engine.state_digest()
        self.log.info(
            "stopped",
            reason=reason,
            exit_code=code,
            next_step=self.engine.step,
            drain_seconds=round(time.perf_counter() - drained, 6),
            **extra,
        )
        self._linger(stops)
        self._close_quietly()
        return code

    def _abandon(self, what: str) -> int:
        """A second stop signal: no checkpoint; the next start re-runs from the last one."""
        signum = self.signals.abandon_signal or signal.SIGTERM
        reason = f"second {signal.Signals(signum).name}: {what}, exiting without a checkpoint"
        return self._shutdown(exit_by_signal(signum), reason, checkpoint=False)

    def _linger(self, stops: int) -> None:
        """Keep /metrics up (with /healthz 503) for `linger_seconds`; a stop signal after the
        `stops` the shutdown began with ends it (one sent during the checkpoint included)."""
        if self.server is None:
            return
        deadline = time.monotonic() + self.config.daemon.linger_seconds
        while time.monotonic() < deadline and self.signals.stop_count == stops:
            time.sleep(0.05)

    def _close_quietly(self) -> None:
        if self.engine is not None:  # a rollout server it started stops with it
            with contextlib.suppress(Exception):
                self.engine.close()
        if self.server is not None:
            self.server.close()
            self.server = None
        self.notifier.close()

    # ----------------------------------------------------------------- status
    def _status_line(self) -> str:
        next_step = self.engine.step if self.engine else 0
        if self.last_step is None:
            return f"ready; next step {next_step}"
        return f"step {self.last_step} done, last verdict {self.last_verdict}; next {next_step}"

    def _publish_status(self, state: str, **extra: Any) -> None:
        if self.rank != 0:
            return
        self._status_written = time.monotonic()
        text = self._status_line() if state == "running" else f"{state}: {extra.get('reason', '')}"
        self.notifier.status(text)
        host, port = self.server.address if self.server else ("", 0)
        status = {
            "run_id": self.plan.run_id,
            "pid": os.getpid(),
            "state": state,
            "step": self.last_step,
            "next_step": self.engine.step,
            "checkpoint_step": self.checkpointed_step,
            "last_verdict": self.last_verdict,
            "metrics": f"http://{host}:{port}/metrics" if self.server else None,
            "updated_at": time.time(),
            **extra,
        }
        try:  # a live view: a full disk must not turn a stop into a traceback
            self.run_dir.write_status(status)
        except OSError as exc:
            self.log.warning("status not written", error=failure_reason(exc))


class NoRecorder:
    """A rank other than 0 under torchrun: rank 0 records its steps (daemon/distributed.py)."""

    queue_depth = blocked_total = incidents_total = uncommitted_steps = 0
    incident_steps_total = open_incidents = 0

    def note_eval(self, result: dict[str, Any]) -> None:
        pass

    def start_run(self, *args: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def note_checkpoint(self, step: int, path: Any) -> None:
        pass

    def close(self) -> None:
        pass


def failure_reason(exc: BaseException) -> str:
    """One line for a failure that is not the input's: an OSError's reason and file
    (`No space left on device (/var/lib/grpod/run/status.json)`), else the error quoted whole
    (safetensors' own error type for a failed write)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return one_line(exc)


def _verdict_text(verdict: Verdict) -> str:
    if not verdict.findings:
        return verdict.action.name
    worst = max(verdict.findings, key=lambda f: f.action)
    return f"{verdict.action.name} ({worst.guard}: {worst.message})"


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name, dist in (("grpod", "grpod"), ("torch", "torch"), ("transformers", "transformers")):
        try:
            versions[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def _device(device: Any = None) -> str:
    """What a run records as its device (`device`: a torch.device; default CUDA 0 or CPU)."""
    import torch

    device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
