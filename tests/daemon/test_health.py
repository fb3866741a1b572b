"""/metrics and /healthz over real HTTP on an ephemeral port."""

from __future__ import annotations

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
