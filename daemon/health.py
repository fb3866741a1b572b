"""The HTTP endpoint: GET /metrics (Prometheus text) and GET /healthz (200 or 503).

/healthz is 200 while the training loop is alive and its last step is recent, 503 otherwise
(before the first step the start time counts as the last step, so loading has the same
grace). The server runs in a daemon thread and may outlive the loop for `linger_seconds`,
answering 503, so a scraper sees the final values and the stop.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from grpod.daemon.errors import ConfigError


class Health:
    """Liveness of the training loop, as /healthz reports it."""

    def __init__(self, max_step_age_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.max_step_age_seconds = max_step_age_seconds
        self._clock = clock
        self._last_beat = clock()
        self.alive = True
        self.reason = "starting"

    def beat(self) -> None:
        """The loop finished a step (or restored): it is alive now."""
        self._last_beat = self._clock()
        self.reason = "ok"

    def stop(self, reason: str) -> None:
        self.alive = False
        self.reason = reason

    def check(self) -> tuple[bool, str]:
        if not self.alive:
            return False, f"loop stopped: {self.reason}"
        age = self._clock() - self._last_beat
        if age > self.max_step_age_seconds:
            return False, f"last step {age:.0f}s ago (limit {self.max_step_age_seconds:g}s)"
        return True, self.reason


class HealthServer:
    """A small threaded HTTP server for /metrics and /healthz, bound at construction."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Health,
        log: Any = None,
    ) -> None:
        """`log`: where a failed request is said (the daemon's JSON logger; default structlog's
        own, for a front end that configures none)."""
        handler = _handler(registry, health)
        server_class = _V6Server if ":" in host else _Server
        self._server = server_class((host, port), handler)  # OSError if the port is taken
        self._server.daemon_threads = True
        self._server.log = structlog.get_logger("grpod") if log is None else log
        self._thread: threading.Thread | None = None

    @classmethod
    def bind(
        cls,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Health,
        log: Any = None,
        setting: str = "daemon.metrics_port",
    ) -> HealthServer:
        """The server, bound: a port it cannot bind is the config's error (exit 2), said
        before anything is created, naming the `setting` that chose the port."""
        try:
            return cls(host, port, registry, health, log=log)
        except OSError as exc:
            raise ConfigError(
                f"{setting}: cannot bind {host}:{port}: {exc.strerror or exc}"
            ) from None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def metrics_url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/metrics"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    log: Any  # HealthServer's `log`

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Never socketserver's traceback on stderr, between the JSON log's lines: a scraper
        that hung up before its answer (its timeout, under load) is nothing to report; any
        other failure of a request is one `metrics request failed` line."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            return
        self.log.warning("metrics request failed", client=str(client_address[0]), error=repr(error))


class _V6Server(_Server):
    address_family = socket.AF_INET6


def _handler(registry: CollectorRegistry, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, reason = health.check()
                self._reply(200 if ok else 503, f"{reason}\n".encode(), "text/plain")
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # scrapes are not events; the JSON log stays one line per event

    return Handler
