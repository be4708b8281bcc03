"""Prometheus metrics at GET /metrics, outside /v1 and without a key, with prometheus_client.

Under gunicorn every worker writes its figures to files in PROMETHEUS_MULTIPROC_DIR
(config/gunicorn.conf.py sets it before any worker starts) and a scrape, whichever worker answers
it, sums them over the workers, the dead ones' counters included. Without that directory (the
development server, one process) the figures are the process's own.

Labels are few and fixed: an operation is its OpenAPI operationId, any other route its endpoint's
name, "preflight" for OPTIONS and "unmatched" where no route matched; never a path, a query, a
key, its prefix or a client address.
"""

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

from flask import Flask, Response, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from animal_store.extensions import db
from animal_store.version import VERSION

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

REQUESTS = Counter(
    "animal_store_requests", "Requests answered, by operation and status.", ["operation", "status"]
)
DURATION = Histogram(
    "animal_store_request_duration_seconds",
    "Time from the first hook to the answer, by operation and status class (2xx, 4xx, 5xx).",
    ["operation", "status_class"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
IN_PROGRESS = Gauge(
    "animal_store_requests_in_progress",
    "Requests being answered now.",
    multiprocess_mode="livesum",
)
RATE_LIMITED = Counter("animal_store_rate_limited", "Requests refused with 429.")
REPLAYS = Counter(
    "animal_store_idempotent_replays", "Creations answered from an earlier Idempotency-Key."
)
AUTH_FAILURES = Counter(
    "animal_store_auth_failures",
    "Requests refused for their key: missing, invalid (wrong or revoked), expired, scope.",
    ["reason"],
)
# One series per release a live worker runs: two while a reload replaces the workers, one after.
BUILD_INFO = Gauge(
    "animal_store_build_info",
    "The release the live workers run, by version: 1 for each.",
    ["version"],
    multiprocess_mode="livemax",
)
POOL = Gauge(
    "animal_store_db_pool_connections",
    "The database pool's connections as a request ends: checked_out, idle.",
    ["state"],
    multiprocess_mode="livesum",
)


class ConnectionCounts(Protocol):
    """What SQLite's and PostgreSQL's pools (QueuePool) tell of their connections."""

    def checkedout(self) -> int: ...
    def checkedin(self) -> int: ...


def operation_label(endpoint: str, view: Callable[..., Any]) -> str:
    operation_id = getattr(view, "_apidoc", {}).get("manual_doc", {}).get("operationId")
    return operation_id or endpoint.rsplit(".", 1)[-1]


class RequestMetrics:
    """Each request's figures: begin() before its view, observe() on its answer (hooks.py)."""

    def __init__(self, app: Flask) -> None:
        # By endpoint; a request no route matched has none (None), and is "unmatched".
        self.operations: dict[str | None, str] = {
            e: operation_label(e, view) for e, view in app.view_functions.items()
        }
        with app.app_context():
            pool = db.engine.pool
        # SQLite's and PostgreSQL's pools count their connections; a NullPool would not.
        self.counts_connections = hasattr(pool, "checkedout")
        self.pool = cast("ConnectionCounts", pool)  # read only when it counts them
        # Each request's series, looked up once: labels() costs more than the increment itself.
        self.series: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self.pool_seen: tuple[int, int] | None = None

    def begin(self) -> None:
        IN_PROGRESS.inc()
        g.metrics_in_progress = True

    def observe(self, response: Response) -> None:
        elapsed = time.perf_counter() - g.get("request_started", time.perf_counter())
        if request.method == "OPTIONS":
            operation = "preflight"
        else:
            operation = self.operations.get(request.endpoint, "unmatched")
        status = response.status_code
        counted = self.series.get((operation, status))
        if counted is None:
            counted = self.series[operation, status] = (
                REQUESTS.labels(operation, str(status)),
                DURATION.labels(operation, f"{status // 100}xx"),
            )
        counted[0].inc()
        counted[1].observe(elapsed)
        if status == 429:
            RATE_LIMITED.inc()
        # Only a creation is replayed: no other answer's headers are searched for the mark.
        if request.method == "POST" and response.headers.get("Idempotent-Replayed") == "true":
            REPLAYS.inc()
        if reason := g.get("auth_failure"):
            AUTH_FAILURES.labels(reason).inc()
        if self.counts_connections:
            # Written only when they change: a gauge's write is a file's under gunicorn.
            connections = (self.pool.checkedout(), self.pool.checkedin())
            if connections != self.pool_seen:
                self.pool_seen = connections
                POOL.labels("checked_out").set(connections[0])
                POOL.labels("idle").set(connections[1])


def init_metrics(app: Flask) -> RequestMetrics:
    """Serve /metrics and return what counts every request of the app; after every route is
    registered, which it labels by."""
    app.add_url_rule("/metrics", "metrics", serve_metrics, methods=["GET"])
    BUILD_INFO.labels(VERSION).set(1)

    @app.teardown_request
    def end_in_progress(_error: BaseException | None = None) -> None:
        # In teardown, which runs whatever happened, so the gauge never drifts upward.
        if g.pop("metrics_in_progress", False):
            IN_PROGRESS.dec()

    return RequestMetrics(app)


def serve_metrics() -> Response:
    """The figures in Prometheus' text format: summed over the workers under gunicorn."""
    if MULTIPROCESS:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(InstanceProcesses())
    else:
        registry = REGISTRY
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


class InstanceProcesses:
    """process_* figures of the whole gunicorn instance, its master and workers summed, which
    prometheus_client's own process collector cannot give in multiprocess mode."""

    def collect(self) -> Iterator[Metric]:
        master = os.getppid()
        pids = [master, *children(master)]
        cpu = memory = fds = 0.0
        page_size, ticks = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                cpu += (int(stat[11]) + int(stat[12])) / ticks
                memory += int(stat[21]) * page_size
                fds += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                continue  # a worker that just exited
        yield CounterMetricFamily(
            "process_cpu_seconds", "User and system CPU of the instance's processes.", value=cpu
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory of the instance's processes.", memory
        )
        yield GaugeMetricFamily("process_open_fds", "Open file descriptors of the instance.", fds)
        yield GaugeMetricFamily("animal_store_processes", "gunicorn master and workers.", len(pids))


def children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found
