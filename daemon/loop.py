"""The training service: rollout -> guarded step -> metrics and log -> record -> checkpoint.

`Daemon(plan).run()` returns the exit code: 0 finished or stopped (SIGTERM/SIGINT after the
step in flight, a checkpoint and a drained recorder), 3 HALT (after a checkpoint), 2 a reward
that failed mid-run (after a checkpoint; one line on stderr), 1 a failure in the loop,
128+signum when a second stop signal abandoned the step in flight.
Resume: the latest checkpoint the store knows is restored (model, optimizer, schedule, data
cursor, guard state); steps the store recorded after it are re-run and recorded as re-runs.

The loop's jobs are components, each in its own module: what a start creates (startup.py),
a step's failure paths (failed_step.py), what happens to a decided step (sink.py: records,
metrics, status view; console.py: its log line), checkpoints (checkpoints.py), held-out
evaluation (evaluation.py), what a run records of itself (runinfo.py), SIGHUP's reload of
the guards (config.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from grpod.base import torchrun
from grpod.base.oneline import say
from grpod.daemon import distributed, logs
from grpod.daemon.checkpoints import Checkpoints
from grpod.daemon.config import GrpodConfig, reload_guards
from grpod.daemon.console import StepConsole, sample_decoder
from grpod.daemon.errors import BAD_INPUT_ERRORS, failure_reason
from grpod.daemon.evaluation import Evaluations
from grpod.daemon.exitcodes import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_HALT, EXIT_OK, exit_by_signal
from grpod.daemon.failed_step import take_step
from grpod.daemon.health import Health, HealthServer
from grpod.daemon.metrics import Metrics, RankMetrics, prepare_multiproc_dir, serving_registry
from grpod.daemon.notify import Notifier
from grpod.daemon.progress import Progress, wanted
from grpod.daemon.retention import Retention
from grpod.daemon.rundir import Plan
from grpod.daemon.runinfo import device_name, software_versions
from grpod.daemon.signals import AbandonStep, Signals
from grpod.daemon.sink import NoRecorder, Recorder, StepSink
from grpod.daemon.startup import attribute_incidents, open_run_dir, start_sampler
from grpod.daemon.status_view import StatusView
from grpod.engine import Engine
from grpod.engine.config import VLLM_BACKENDS
from grpod.engine.grpo.eval import Evaluator
from grpod.engine.verdict import Action
from grpod.forensics.incident_attribution import AttributionRecord, IncidentAttributor
from grpod.forensics.ledger import LedgerSpec
from grpod.guards import GuardPolicy


class Daemon:
    """One `grpod run` process: `Daemon(resolve_plan(config, run_dir, {})).run()` -> exit code.
    Every rank under torchrun runs one; rank 0 owns the run dir, the store and the step metrics.
    """

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
            around_write=self._around_line,
            drop_events=frozenset({"step"}) if self.progress else frozenset(),
        )
        self.notifier = Notifier()
        self.signals = Signals()
        self.health = Health(cfg.health_max_step_age_seconds)
        self.versions = software_versions()
        self.registry = CollectorRegistry()
        self.metrics: Metrics | None = None  # rank 0's, made in _start
        self.rank_metrics: RankMetrics | None = None  # every rank's own
        self.server: HealthServer | None = None
        if cfg.metrics and torchrun.local_rank() == 0:  # bound before anything is created
            self.server = HealthServer.bind(
                cfg.metrics_host,
                cfg.metrics_port,
                serving_registry(self.registry),
                self.health,
                log=self.log.bind(run_id=plan.run_id, rank=self.rank),  # its threads' context
            )
        self.status = StatusView(  # under torchrun rank 0 writes the run dir's status.json
            self.run_dir if self.rank == 0 else None,
            plan.run_id,
            next_step=lambda: self.engine.step if self.engine else 0,
            notify=self.notifier.status,
            on_error=self._status_not_written,
        )
        self.status.metrics_url = None if self.server is None else self.server.metrics_url
        self.engine: Engine | None = None
        self.policy: GuardPolicy | None = None
        self.recorder: Recorder | None = None  # rank 0's flight recorder (NoRecorder elsewhere)
        self.attributor: IncidentAttributor | None = None  # rank 0's: incidents' attribution
        self.sink: StepSink | None = None  # what happens to a decided step, made in _start
        self.checkpoints: Checkpoints | None = None
        self.evaluations: Evaluations | None = None
        self.input_failure: str | None = None  # a reward's failure: stop with exit 2
        self.system_failure: str | None = None  # the rollout server's: stop with exit 1

    # ----------------------------------------------------------------- lifecycle
    def run(self) -> int:
        """Start (or resume), train until max_steps / a stop / HALT, shut down; exit code."""
        self.signals.install()
        logs.bind_run(self.plan.run_id, self.rank)
        try:
            self._start()
        except BaseException as exc:
            bad_input = isinstance(exc, (*BAD_INPUT_ERRORS, KeyboardInterrupt, SystemExit))
            if not bad_input:  # said first: under torchrun the agent may end us while we clean up
                self._failed_to_start(exc)
            if self.recorder is not None:
                with contextlib.suppress(Exception):
                    self.recorder.close()
            if self.attributor is not None:
                self.attributor.close(0.0)
            self._close_quietly()
            if not self.plan.resume and self.run_dir.held is not None:
                self.run_dir.discard()  # a fresh run that never started must not be resumed
            if bad_input:
                raise  # bad input: one line and exit 2 at the CLI
            return EXIT_FAILURE
        try:
            return self._loop()
        except AbandonStep:
            return self._abandon("the step in flight was dropped")
        except Exception as exc:  # not the input's (a full disk): one line, exit 1
            reason = failure_reason(exc)
            self.log.error("failed", error=reason)
            say(f"grpod run: error: failed at step {self.engine.step}: {reason}")
            return self._shutdown(EXIT_FAILURE, f"failed: {reason}", checkpoint=False)
        finally:
            self.signals.restore()
            logs.clear()

    def _failed_to_start(self, exc: BaseException) -> None:
        """A system failure before the first step (a full disk): one line (exit 1), said
        first: under torchrun the agent may end this rank right after."""
        reason = failure_reason(exc)
        say(f"grpod run: error: cannot start: {reason}")
        self.log.error("failed", error=reason)

    def _start(self) -> None:
        plan, cfg = self.plan, self.config
        self.notifier.extend_timeout(cfg.daemon.checkpoint_timeout_seconds)
        if cfg.engine.rollout_backend in VLLM_BACKENDS:  # vLLM's own log lines, as JSON events
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
            logs.forward_library_logs(self.log, logs.VLLM_LOGGERS, cfg.daemon.log_level)
        self.engine = Engine(cfg.engine)  # before the run dir: a bad engine config creates nothing
        if cfg.engine.rollout_backend in VLLM_BACKENDS:  # before the run dir, as the engine
            start_sampler(self.engine, cfg.engine, self.notifier, self.log)
        evaluator = Evaluator(self.engine) if cfg.engine.eval_every else None
        self.policy = GuardPolicy(cfg.guards)
        self.recorder = open_run_dir(plan, self.log) if self.rank == 0 else NoRecorder()
        if self.rank == 0:
            self.attributor = attribute_incidents(
                plan, self.recorder, self.log, self._attributed, self.engine.device.type
            )
        distributed.barrier()
        self._start_services(evaluator)
        restored, self.sink.rerun_through = self.checkpoints.restore()
        if self.progress is not None:
            self.progress.start = self.engine.step
        ledger = LedgerSpec(  # every prompt's fate (forensics/ledger.py), from this step on
            cfg.engine.prompts_per_step,
            cfg.engine.epochs,
            self.engine.task.epoch_size,
            cfg.engine.seed,
        )
        self.recorder.start_run(
            plan.run_id,
            cfg.to_json(),
            self.versions,
            device_name(),
            ledger=ledger,
            next_step=self.engine.step,
        )
        if self.server is not None:
            self.server.start()
        self.log.info(
            "started",
            run_dir=str(plan.run_dir.path),
            resumed_from=restored,
            next_step=self.engine.step,
            rerun_through=self.sink.rerun_through,
            max_steps=cfg.daemon.max_steps,
            metrics=self.status.metrics_url,
            pid=os.getpid(),
        )
        if self.checkpoints.step < 0:
            self.checkpoints.save("initial")  # replay of the first steps needs one before them
        self.health.beat()
        self.status.write("running")
        self.notifier.ready(self.status.line())

    def _start_services(self, evaluator: Evaluator | None) -> None:
        """The metrics, the step sink, checkpoints and evaluation. Rank 0: the step's
        metrics; every rank: its own. Under torchrun the node's local rank 0 first empties
        its multiprocess directory; no rank has a metric before that."""
        cfg = self.config
        if distributed.world_size() > 1 and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            if torchrun.local_rank() == 0:
                prepare_multiproc_dir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
            distributed.barrier()
        samples = sample_decoder(self.engine, cfg.engine.stop, cfg.daemon.log_samples)
        console = StepConsole(self.log, self.progress, samples)
        self.sink = StepSink.publishing(
            self.recorder,
            self.registry,
            self.versions,
            self.rank,
            status=self.status,
            health=self.health,
            announce=console.announce,
            hold_seconds=cfg.daemon.publish_hold_seconds,
        )
        self.metrics, self.rank_metrics = self.sink.metrics, self.sink.rank_metrics
        self.checkpoints = Checkpoints(
            self.engine,
            self.policy,
            self.run_dir,
            self.plan.run_id,
            self.sink,
            retention=Retention(cfg.forensics) if self.rank == 0 else None,
            notifier=self.notifier,
            log=self.log,
            timeout_seconds=cfg.daemon.checkpoint_timeout_seconds,
        )
        if evaluator is not None:
            self.evaluations = Evaluations(
                evaluator,
                self.recorder,
                self.metrics,
                self.log,
                temperature=cfg.engine.eval_temperature,
                on_error=cfg.engine.eval_on_error,
                policy=self.policy,
            )

    def _loop(self) -> int:
        max_steps = self.config.daemon.max_steps
        every = self.config.daemon.checkpoint_every
        self.engine.set_horizon(max_steps)  # async steps sample nothing past the last step
        while not distributed.agree_stop(self.signals.stop_requested) and not (
            max_steps and self.engine.step >= max_steps
        ):
            if self.signals.take_reload():  # SIGHUP: the guards' thresholds, nothing else
                self.config = reload_guards(
                    self.config, self.plan.config_source, self.policy, self.log
                )
            with logs.step_context(self.engine.step):
                action = self._step()
            if self.signals.abandon_signal is not None:
                break  # a second stop signal while recording: exit now, no checkpoint
            if self.input_failure is not None:  # a reward that failed: checkpoint, exit 2
                return self._shutdown(EXIT_BAD_INPUT, self.input_failure)
            if self.system_failure is not None:  # the rollout server: checkpoint, exit 1
                say(f"grpod run: error: {self.system_failure}")
                return self._shutdown(EXIT_FAILURE, f"failed: {self.system_failure}")
            if action == Action.HALT:
                return self._shutdown(
                    EXIT_HALT, f"HALT at step {self.engine.step - 1}: {self.status.last_verdict}"
                )
            if self.engine.step % every == 0:
                self.checkpoints.save("periodic")
            if (
                self.evaluations is not None
                and self.engine.step % self.config.engine.eval_every == 0
            ):
                self.input_failure = self.evaluations.run(self.engine.step)
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
        """Roll out, train, decide (a failed rollout: a skipped step), then publish."""
        self.notifier.watchdog()
        self.signals.abortable = True
        decided = take_step(self.engine, self.policy)
        self.signals.abortable = False
        self.input_failure, self.system_failure = decided.input_failure, decided.system_failure
        ahead = self.engine.take_ahead_stats()  # None on policy: the result as decided
        result = (
            decided.result if ahead is None else dataclasses.replace(decided.result, ahead=ahead)
        )
        result = self.sink.publish(result, self.policy.gradnorm_vtc_correlation)
        self.notifier.watchdog()
        return result.verdict.action

    # ----------------------------------------------------------------- shutdown
    def _shutdown(self, code: int, reason: str, checkpoint: bool = True) -> int:
        self.signals.abortable = False
        try:  # the held steps' metrics and lines, before anything about the stop
            self.sink.close()
        except Exception as exc:  # a burst after the last step failed: a failed run
            self.log.error("publish failed", error=str(exc))
            code = code or EXIT_FAILURE
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
            say(f"grpod run: error: {reason}")
        self.notifier.stopping(f"{state}: {reason}")
        self.health.stop(reason)
        if self.metrics is not None:
            self.metrics.halted.set(int(code == EXIT_HALT))
        (self.log.error if code == EXIT_HALT else self.log.info)(
            "stopping", reason=reason, exit_code=code
        )
        if checkpoint:
            self.checkpoints.save("halt" if code == EXIT_HALT else "stop")
        drained = time.perf_counter()
        try:
            self.recorder.close()
        except Exception as exc:  # a store that failed must not hide the reason we stop
            self.log.error("recorder close failed", error=str(exc))
            code = code or EXIT_FAILURE
        self.sink.observe_recorder(0)  # its uncommitted steps: 0 unless the close failed
        if self.attributor is not None:  # bounded: what is left says "daemon stopped"
            self.attributor.close(None if checkpoint else 0.0)
        self.status.write(state, reason=reason, exit_code=code)
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

    @contextlib.contextmanager
    def _around_line(self) -> Iterator[None]:
        """Around any line: the sink's held step lines first (their burst redraws the
        progress bar), then the bar clears; no burst redraws it before the line is out."""
        with contextlib.nullcontext() if self.sink is None else self.sink.line_turn():
            if self.progress is not None:
                self.progress.clear()
            yield

    def _attributed(self, record: AttributionRecord) -> None:
        if self.metrics is not None:
            self.metrics.observe_attribution(record)

    # ----------------------------------------------------------------- status
    def _status_not_written(self, exc: OSError) -> None:
        """A live view: a full disk must not turn a stop into a traceback."""
        self.log.warning("status not written", error=failure_reason(exc))
