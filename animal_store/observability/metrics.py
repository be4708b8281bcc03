"""Prometheus metrics at GET /metrics, outside /v1 and without a key, with prometheus_client.

Under gunicorn every worker writes its figures to files in PROMETHEUS_MULTIPROC_DIR (gunicorn's
master sets it before any worker starts: serving/master.py) and a scrape, whichever worker
answers it, sums them over the workers, the dead ones' counters included. Without that directory
(the development server, one process) the figures are the process's own.

Labels are few and fixed: an operation is its OpenAPI operationId, any other route its endpoint's
name, "preflight" for OPTIONS and "unmatched" where no route matched; never a path, a query, a
key, its prefix or a client address.

A request costs a count in the process's memory (RequestMetrics.observe). The counts are written
to prometheus_client, which under gunicorn means the worker's files, at most every
METRICS_WRITE_INTERVAL seconds (1): by the first answer once that has passed, by the worker when
it is idle (the worker class wakes every second for it: serving/worker.py), by the worker
answering a scrape (its own counts, before it reads the files), and when a worker exits. Each
write to the files takes a lock, checks the process's PID and writes to an mmap: written on
every answer, five of them, they cost a list request a tenth of its CPU (docs/benchmarks.rst).
So a scrape may miss the last second of another worker's counts, which the next scrape has, and
a worker killed with SIGKILL loses at most its last second's counts; a scrape every 15 to 60 s
does not see the difference. 0 writes every answer at once.

How busy the workers are is counted the same way, from the time each waits for a connection
(IDLE) against the time it has run (WORKER_SECONDS), rather than by a gauge of the requests in
progress, which took two writes a request.
"""

import os
import threading
import time
from bisect import bisect_left
from collections import Counter as Counts
from collections.abc import Callable
from typing import Any, Protocol, cast

from flask import Flask, Response, current_app
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

from animal_store.current import REQUEST, G
from animal_store.data import standbys, without_primary
from animal_store.errors import OUTAGE_REASONS
from animal_store.extensions import db, settings
from animal_store.observability.master_metrics import InstanceProcesses
from animal_store.version import VERSION

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
EXTENSION = "animal_store_metrics"

REQUESTS = Counter(
    "animal_store_requests", "Requests answered, by operation and status.", ["operation", "status"]
)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DURATION = Histogram(
    "animal_store_request_duration_seconds",
    "Time from the first hook to the answer, by operation and status class (2xx, 4xx, 5xx).",
    ["operation", "status_class"],
    buckets=DURATION_BUCKETS,
)
# Counted by the workers (serving/worker.py): the rest of their time they serve. Their
# busy share is what no request's own figure shows: gunicorn's parsing and writing, and requests
# waiting in the listening socket.
IDLE = Counter(
    "animal_store_worker_idle_seconds",
    "Seconds the workers waited for a connection, summed over them.",
)
# Their denominator, counted by the same workers only: rate(IDLE) / rate(WORKER_SECONDS) is the
# share of their time the workers were idle, right even over a window the series began in (a new
# instance), where a rate over a count of workers would read them busy.
WORKER_SECONDS = Counter(
    "animal_store_worker_seconds", "Seconds the workers have run, summed over them."
)
RATE_LIMITED = Counter("animal_store_rate_limited", "Requests refused with 429.")
REPLAYS = Counter(
    "animal_store_idempotent_replays", "Creations answered from an earlier Idempotency-Key."
)
AUTH_FAILURE_REASONS = ("missing", "invalid", "expired", "scope")  # auth.py's g.auth_failure
AUTH_FAILURES = Counter(
    "animal_store_auth_failures",
    "Requests refused for their key: missing, invalid (wrong or revoked), expired, scope.",
    ["reason"],
)
DATABASE_REFUSALS = Counter(
    "animal_store_database_refusals",
    "Requests answered 503 for the database, /readyz included, by reason: unavailable, "
    "read_only, login_refused, storage_full (errors.OUTAGE_REASONS).",
    ["reason"],
)
# The reads of listPets and getPet that reached a database (not those the worker's answers
# kept: answers.py), by the server that served them; the series "standby" only with standbys
# (DATABASE_READ_URL; data/standbys.py), so its absence says none is configured (the alert on
# standby reads relies on it). And those the primary served although standbys are configured,
# by why.
DATABASE_READS = Counter(
    "animal_store_database_reads",
    "Reads of listPets and getPet that reached a database, by the server that served them: "
    "primary, standby (only with DATABASE_READ_URL), without_primary (a standby holding every "
    "acknowledged commit, while the primary cannot answer).",
    ["server"],
)
SERVERS = ("primary", "standby", "without_primary")
READS_UNPROVEN = Counter(
    "animal_store_database_reads_unproven",
    "Reads (and key look-ups) the primary could not answer and no standby could be shown to "
    "hold every acknowledged commit for, answered 503, by reason: unanswered (a standby host "
    "did not answer), unknown (a standby has not streamed since it started), replay (not "
    "replayed in time), asynchronous (the primary was last seen committing asynchronously), "
    "down (a standby failed the read).",
    ["reason"],
)
READS_SENT_TO_PRIMARY = Counter(
    "animal_store_database_reads_sent_to_primary",
    "Reads the primary served although standbys are configured, by reason: walk (a standby "
    "lacks the position a page needs), lag, promoted, timeline (a standby streams another "
    "timeline than the primary's), down, not_found (a standby lacks the animal).",
    ["reason"],
)
# Counted from 0 on every instance, shedding or not (animal_store/http/shedding.py).
SHED = Counter(
    "animal_store_requests_shed",
    "Requests answered 503 unserved, because they waited longer than REQUEST_QUEUE_TIMEOUT for "
    "a worker.",
)
# Counted by the worker class (serving/worker.py), from 0 on every instance: requests nginx had
# given up on (its client gone) before a worker took them, neither served nor answered, so not in
# REQUESTS: an answer no client could receive is no error of the service's.
ABANDONED = Counter(
    "animal_store_requests_abandoned",
    "Requests whose connection nginx had closed (its client gone) before a worker took them: "
    "neither served nor answered, not in animal_store_requests_total.",
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
    "The database pool's connections as a worker last wrote its counts: checked_out, idle.",
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


class SeriesCounts:
    """One series' answers (an operation and status) counted since the last write."""

    __slots__ = ("buckets", "count", "seconds")

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        # By bucket, not cumulative: as prometheus_client's histogram keeps them (+Inf last).
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        self.buckets[bisect_left(DURATION_BUCKETS, seconds)] += 1

    def write(self, histogram: Histogram) -> None:
        """Add these answers to a histogram of DURATION_BUCKETS, as its observe() adds one: to
        the bucket of each answer's time, and the times to its sum (tests/test_metrics.py
        checks the text against observe()'s)."""
        histogram._sum.inc(self.seconds)
        for bucket, count in zip(histogram._buckets, self.buckets, strict=True):
            if count:
                bucket.inc(count)


class RequestMetrics:
    """Each answer's figures (observe(), an after step of hooks.py), counted in the process's
    memory and written to prometheus_client at most every METRICS_WRITE_INTERVAL (write())."""

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
        # Each series, looked up once: labels() costs more than the increment itself.
        self.series: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self.pool_seen: tuple[int, int] | None = None
        self.interval = settings(app).METRICS_WRITE_INTERVAL
        # What was counted since the last write: answers by series, and other counters' counts.
        self.answers: dict[tuple[str, int], SeriesCounts] = {}
        self.counted: Counts[Counter] = Counts()
        self.idle_seconds = 0.0
        # Since when (time.monotonic()) the run seconds are counted: only in a process that also
        # counts its idle ones (count_busy_share()), or the two would read it always busy.
        self.run_since: float | None = None
        self.due = 0.0  # when (time.monotonic()) an answer next writes
        # The development server answers on threads, and a gthread worker too.
        self.lock = threading.Lock()

    def observe(self, response: Response) -> None:
        served, context = REQUEST._get_current_object(), G._get_current_object()
        elapsed = time.perf_counter() - context.get("request_started", time.perf_counter())
        if served.method == "OPTIONS":
            operation = "preflight"
        else:
            operation = self.operations.get(served.endpoint, "unmatched")
        status = response.status_code
        reason = context.get("auth_failure")
        refusal = context.get("database_refusal")
        # "primary", "standby", or why the primary served a read standbys could have
        # (data/standbys.py); None: no read reached a database.
        read = context.get("database_read")
        # Only a creation is replayed: no other answer's headers are searched for the mark.
        replayed = served.method == "POST" and response.headers.get("Idempotent-Replayed") == "true"
        with self.lock:
            answers = self.answers.get((operation, status))
            if answers is None:
                answers = self.answers[operation, status] = SeriesCounts()
            answers.add(elapsed)
            if status == 429:
                self.counted[RATE_LIMITED] += 1
            if replayed:
                self.counted[REPLAYS] += 1
            if reason:
                self.counted[AUTH_FAILURES.labels(reason)] += 1
            if refusal:
                self.counted[DATABASE_REFUSALS.labels(refusal)] += 1
            if read in SERVERS:
                self.counted[DATABASE_READS.labels(read)] += 1
            elif read:
                self.counted[DATABASE_READS.labels("primary")] += 1
                self.counted[READS_SENT_TO_PRIMARY.labels(read)] += 1
            unproven = context.get("unproven")
            if unproven:
                self.counted[READS_UNPROVEN.labels(unproven)] += 1
            if context.get("request_shed"):
                self.counted[SHED] += 1
        self.write_if_due()

    def abandoned(self) -> None:
        """Count a request the worker class found abandoned by its client, and did not run."""
        with self.lock:
            self.counted[ABANDONED] += 1

    def write_if_due(self) -> None:
        """Write, if the interval has passed since the last write: an answer, or an idle
        gunicorn worker, finds it due."""
        if time.monotonic() >= self.due:
            self.write()

    def count_busy_share(self) -> None:
        """Count the seconds this process runs, beside those it says it is idle (idle()): a
        gunicorn sync worker, from its start."""
        self.run_since = time.monotonic()

    def idle(self, seconds: float) -> None:
        with self.lock:
            self.idle_seconds += seconds

    def write(self) -> None:
        """Write what was counted since the last write to prometheus_client: under gunicorn, to
        the worker's files, which a scrape sums."""
        with self.lock:
            answers, self.answers = self.answers, {}
            counted, self.counted = self.counted, Counts()
            idle_seconds, self.idle_seconds = self.idle_seconds, 0.0
            now = time.monotonic()
            run_since = self.run_since
            if run_since is not None:
                self.run_since = now
            self.due = now + self.interval
        for (operation, status), observed in answers.items():
            series = self.series.get((operation, status))
            if series is None:
                series = self.series[operation, status] = (
                    REQUESTS.labels(operation, str(status)),
                    DURATION.labels(operation, f"{status // 100}xx"),
                )
            series[0].inc(observed.count)
            observed.write(series[1])
        for counter, count in counted.items():
            counter.inc(count)
        if run_since is not None:
            IDLE.inc(idle_seconds)
            WORKER_SECONDS.inc(now - run_since)
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
    # Each reason's series from 0, so an alert's rate() sees the first refusal, not the second.
    for reason in OUTAGE_REASONS.values():
        DATABASE_REFUSALS.labels(reason)
    for reason in AUTH_FAILURE_REASONS:
        AUTH_FAILURES.labels(reason)
    DATABASE_READS.labels("primary")
    if settings(app).DATABASE_READ_URL is not None:
        DATABASE_READS.labels("standby")
        DATABASE_READS.labels("without_primary")
    # (At 0 without standbys too, as the alerts and the dashboard read them by reason.)
    for why in standbys.REASONS:
        READS_SENT_TO_PRIMARY.labels(why)
    for reason in without_primary.REASONS:
        READS_UNPROVEN.labels(reason)
    metrics = app.extensions[EXTENSION] = RequestMetrics(app)
    return metrics


def request_metrics(app: Flask) -> RequestMetrics:
    """Return the app's counts (a scrape, and the worker class, serving/worker.py, write them)."""
    metrics: RequestMetrics = app.extensions[EXTENSION]
    return metrics


def serve_metrics() -> Response:
    """The figures in Prometheus' text format: summed over the workers under gunicorn."""
    # This worker's own counts, up to this request: the others' are at most an interval old.
    request_metrics(current_app).write()
    if MULTIPROCESS:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(InstanceProcesses(os.getppid()))
    else:
        registry = REGISTRY
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
