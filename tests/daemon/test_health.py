"""/metrics and /healthz over real HTTP on an ephemeral port."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Gauge

from grpod.daemon.health import Health, HealthServer
from tests.daemon.helpers import http_get


def test_healthz_and_metrics() -> None:
    now = [100.0]
    health = Health(max_step_age_seconds=10, clock=lambda: now[0])
    registry = CollectorRegistry()
    Gauge("grpod_step", "x", registry=registry).set(4)
    server = HealthServer("127.0.0.1", 0, registry, health)
    server.start()
    base = f"http://127.0.0.1:{server.address[1]}"
    try:
        assert http_get(base + "/healthz")[0] == 200  # starting: the start time counts
        now[0] = 111.0
        code, body = http_get(base + "/healthz")
        assert code == 503 and "last step 11s ago" in body
        health.beat()
        assert http_get(base + "/healthz")[0] == 200
        assert "grpod_step 4.0" in http_get(base + "/metrics")[1]
        health.stop("finished")
        assert http_get(base + "/healthz") == (503, "loop stopped: finished\n")
        assert http_get(base + "/nothing")[0] == 404
    finally:
        server.close()


def test_a_scraper_that_hangs_up_or_a_failing_scrape_prints_no_traceback(capfd) -> None:
    import socket
    import struct

    import structlog

    registry = CollectorRegistry()
    big = Gauge("grpod_test_series", "x", ["i"], registry=registry)
    for i in range(40000):  # an answer larger than the socket buffers
        big.labels(str(i)).set(i)
    server = HealthServer("127.0.0.1", 0, registry, Health(max_step_age_seconds=10))
    server.start()
    base = f"http://127.0.0.1:{server.address[1]}"
    try:
        for _ in range(3):  # a scraper past its timeout: asks, then resets the connection
            client = socket.create_connection(server.address)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            client.close()
        assert http_get(base + "/healthz")[0] == 200  # still serving
    finally:
        server.close()

    class Failing:
        def collect(self):
            raise RuntimeError("collector broke")

    failing = CollectorRegistry()  # a server of its own: no reset request of the first reaches it
    failing.register(Failing())
    server = HealthServer("127.0.0.1", 0, failing, Health(max_step_age_seconds=10))
    server.start()
    try:  # the request fails before any answer
        with structlog.testing.capture_logs() as logged, contextlib.suppress(OSError):
            http_get(f"http://127.0.0.1:{server.address[1]}/metrics")
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
    assert [e["event"] for e in logged] == ["metrics request failed"]
    assert "collector broke" in logged[0]["error"]
