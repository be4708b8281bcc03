"""gunicorn settings for production; `--bind` and `--workers` on the command line override them.
Start: `gunicorn -c config/gunicorn.conf.py wsgi:app`."""

import importlib.metadata
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import gunicorn
from gunicorn import glogging

if TYPE_CHECKING:
    # For the checker only: the master loads no more of gunicorn, and nothing of Flask or the app.
    from flask import Flask
    from gunicorn.arbiter import Arbiter
    from gunicorn.http import Request
    from gunicorn.http.wsgi import Response
    from gunicorn.workers.base import Worker

bind = os.environ.get("ANIMAL_STORE_BIND", "127.0.0.1:8000")
# One process per core, sync workers: chosen by measurement through the shipped nginx
# (docs/deploy.rst, Workers, measured). nginx buffers each request and answer and opens a
# connection per request, which is what sync workers are made for:
# - a sync worker takes a connection only when it is free, so one slow request never holds up
#   another that an idle worker could serve (gthread with one thread accepted while busy);
# - it closes each connection after the answer, and says so, so a connection never dies after
#   an answer that promised keep-alive (gthread drains at most 64 KiB of a body the app did not
#   read, then closes), and no upstream keep-alive timeout can race a POST.
# `--threads N` (N > 1) turns them into gthread workers: measure first.
workers = int(os.environ.get("WEB_CONCURRENCY", os.cpu_count() or 1))
worker_class = "sync"
# Not preloaded: each worker imports the app and opens its own database connections after the
# fork, so no connection (or SQLite file handle) is ever shared between processes. Preloading
# would save a little memory and boot time, and would need the engine disposed after each fork.
preload_app = False
# Connections that wait for a free worker in the listening socket's queue, beyond which the kernel
# drops them (nginx then waits out proxy_connect_timeout and answers 504): room for a surge of
# 4,096 clients and more. The kernel caps it at net.core.somaxconn (4096 by default), which
# docs/deploy.rst raises; animal_store_listen_queue_backlog shows what it granted.
backlog = 8192
# A worker silent for this long is killed and replaced (a request stuck past every DB timeout).
timeout = 30
# On SIGTERM, workers stop accepting, finish the requests in flight for up to this long, then exit.
graceful_timeout = 30
# gunicorn takes X-Forwarded-Proto from no one: the app decides whose forwarded headers count
# (TRUSTED_PROXIES, animal_store/http/proxies.py), for the scheme as for the host and the address.
forwarded_allow_ips = ""
# gunicorn's control socket (for gunicornc) is off unless the deployment names a path for it, such
# as /run/animal-store/gunicorn.ctl: its default, ~/.gunicorn/, would land in the checkout (the
# service user's home in docs/deploy.rst), and every instance on a machine would share it.
control_socket = os.environ.get("GUNICORN_CONTROL_SOCKET", "")
control_socket_disable = not control_socket

# Prometheus metrics summed over the workers (animal_store/observability/metrics.py,
# prometheus_client's multiprocess mode): each worker writes its figures to files in
# PROMETHEUS_MULTIPROC_DIR, which must be set before anything imports prometheus_client (the master
# does, in child_exit). A directory of this instance's own (systemd's RuntimeDirectory in
# docs/deploy.rst), emptied at start; without one, a fresh temporary directory, removed when the
# master exits. Which one was made is kept in the environment, as this file is read again on HUP.
TEMPORARY_METRICS_DIR = "GUNICORN_TEMPORARY_METRICS_DIR"
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    made = tempfile.mkdtemp(prefix="animal-store-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ[TEMPORARY_METRICS_DIR] = made


# The instance's metrics on a listener of their own, which no worker's load can block, served by
# a small process the master starts beside its workers
# (animal_store/observability/master_metrics.py). Unset: only the app's /metrics on the app's port,
# which waits behind the clients when every worker is busy. The process's PID is kept in the
# environment, as this file is read again on HUP.
METRICS_BIND = "ANIMAL_STORE_METRICS_BIND"
METRICS_PROCESS = "GUNICORN_METRICS_PROCESS"


def on_starting(server: "Arbiter") -> None:
    # A bad setting stops the boot here, in one line, before any worker starts: in the workers
    # it would be a traceback in each, and gunicorn would halt only once one of them had failed.
    # The check runs in a child process: the master imports nothing of the app, so the workers a
    # reload (HUP) forks import the release on disk, not one the master would hold in memory.
    check = os.fork()
    if check == 0:
        os._exit(check_settings(server))
    if os.waitstatus_to_exitcode(os.waitpid(check, 0)[1]) != 0:
        remove_temporary_metrics_dir()
        sys.exit(1)
    # Figures a previous run left would be added to this one's.
    for leftover in Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).glob("*.db"):
        leftover.unlink()


def check_settings(server: "Arbiter") -> int:
    """Import the release, check the settings as create_app() does and the database's login;
    log what is wrong and return 1, or return 0."""
    log = cast(glogging.Logger, server.log)
    try:
        # Every module the workers import: a release that cannot be imported (a dependency the
        # lock gained but pip did not install) is said here once, not by each worker in turn.
        import animal_store.factory  # noqa: F401
    except BaseException:
        log.exception("The release cannot be imported")
        return 1
    else:
        from animal_store.data.database import check_login
        from animal_store.settings import SettingsError, check_environment

        try:
            config = check_environment()
        except SettingsError as error:
            # The arbiter has its log by the time it calls on_starting. A record a setting: one
            # JSON line each, as `flask` prints one line each.
            for line in error.format_message().splitlines():
                log.error("%s", line)
            return 1
        except BaseException:
            log.exception("The app cannot load its settings")
            return 1
        # A password the database refuses is a wrong setting too, said once here rather than
        # as a 503 for every request of workers that look ready. A database that does not
        # answer is said and ridden out.
        login = check_login(config)
        if login is not None:
            level, message = login
            log.log(level, "%s", message)
            if level == logging.ERROR:
                return 1
    finally:
        # The check's process ends with os._exit, which flushes nothing.
        sys.stdout.flush()
    return 0


def when_ready(server: "Arbiter") -> None:
    # The listening sockets exist and no worker yet: a metrics listener that cannot start stops
    # the boot, in one line, as a bad setting does.
    failure = start_metrics_process(server)
    if failure:
        cast(glogging.Logger, server.log).error("%s", failure)
        remove_temporary_metrics_dir()
        sys.exit(1)


def start_metrics_process(server: "Arbiter") -> str | None:
    """Start the metrics' process if ANIMAL_STORE_METRICS_BIND names its address; return why it
    could not start, or None."""
    bind = os.environ.get(METRICS_BIND)
    if not bind:
        return None
    listeners = [listener.fileno() for listener in server.LISTENERS]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "animal_store.observability.master_metrics",
            f"--bind={bind}",
            f"--master={os.getpid()}",
            *(f"--listener={fd}" for fd in listeners),
        ],
        pass_fds=listeners,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    with process.stdout:
        # Its first line: ready, or why not. Importing prometheus_client takes a moment, more on
        # a loaded machine.
        answered = select.select([process.stdout], [], [], 60)[0]
        line = process.stdout.readline().decode().strip() if answered else ""
    if line == "ready":
        os.environ[METRICS_PROCESS] = str(process.pid)
        cast(glogging.Logger, server.log).info("Serving the metrics on http://%s/metrics", bind)
        return None
    stop_process(process.pid)
    return line or f"The metrics' process did not start on {bind} within 60 s."


def stop_metrics_process() -> None:
    pid = os.environ.pop(METRICS_PROCESS, None)
    if pid:
        stop_process(int(pid))


def stop_process(pid: int) -> None:
    """Stop a child of the master and reap it, so that its port is free when this returns."""
    for stop in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, stop)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                return  # gunicorn reaped it: it had ended
            time.sleep(0.01)


def on_reload(server: "Arbiter") -> None:
    # The metrics' process runs the release on disk, as the new workers do.
    stop_metrics_process()
    failure = start_metrics_process(server)
    if failure:
        cast(glogging.Logger, server.log).error("%s", failure)
    # A master started by release 1.0.0 imported the app in process (its on_starting checked the
    # settings there), and the workers forked from it would keep that code. It forgets the app,
    # and prometheus_client, whose registry holds the app's metrics: re-registered by the new
    # code, they would be duplicates. A master started by this file holds neither. (Remove in
    # the release after 1.1.0, when no 1.0.0 master is left to upgrade.)
    if "animal_store" in sys.modules:
        forgotten = {"animal_store", "prometheus_client"}
        for name in [name for name in sys.modules if name.partition(".")[0] in forgotten]:
            del sys.modules[name]
    # gunicorn itself (and prometheus_client, below) is the master's own: a new version of it
    # takes a restart (docs/operations.rst, Upgrading).
    installed = importlib.metadata.version("gunicorn")
    if installed != gunicorn.__version__:
        cast(glogging.Logger, server.log).warning(
            "gunicorn %s is installed but %s runs: restart to use it",
            installed,
            gunicorn.__version__,
        )


def on_exit(server: "Arbiter") -> None:
    stop_metrics_process()
    remove_temporary_metrics_dir()


def remove_temporary_metrics_dir() -> None:
    # A master re-executed on USR2 starts from the environment gunicorn itself started with,
    # so it makes a directory of its own: each master removes only the one it made.
    made = os.environ.get(TEMPORARY_METRICS_DIR)
    if made:
        shutil.rmtree(made, ignore_errors=True)


def child_exit(server: "Arbiter", worker: "Worker") -> None:
    # A dead worker's gauges (its pool's connections) stop counting; its counters stay.
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


# gunicorn's own access log is off: the app writes one JSON line per request to stdout
# (animal_store/observability/logs.py) with the request ID and key name, which gunicorn's line
# cannot carry.
accesslog = None


class Logger(glogging.Logger):
    """gunicorn's logger without its access line. `accesslog = None` is not enough: given a
    logging config (logconfig_dict, below), gunicorn builds the line's fields for every request
    anyway, a tenth of a worker's CPU on a list request (docs/benchmarks.rst)."""

    def access(
        self,
        resp: "Response",
        req: "Request",
        environ: MutableMapping[str, Any],
        request_time: timedelta,
    ) -> None:
        pass


class JsonFormatter(logging.Formatter):
    """gunicorn's own lines (boot, reloads, workers started and stopped) as JSON, with the keys
    of the app's (animal_store/observability/logs.py): the master imports nothing of the app, so the
    formatter is here, and a reload reads it anew with the rest of this file."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, separators=(",", ":"), default=str)


logger_class = Logger
errorlog = "-"
# gunicorn's error log (boot, worker exits, timeouts) as JSON lines on stdout too, like the app's.
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": JsonFormatter}},
    "handlers": {
        "stdout": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "stream": "ext://sys.stdout",
        }
    },
    "root": {"level": "INFO", "handlers": ["stdout"]},
    "loggers": {
        "gunicorn.error": {"level": "INFO", "handlers": ["stdout"], "propagate": False},
        "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": False},
        # Each worker imports Flask-Migrate, and Alembic says at INFO each plugin it sets up:
        # noise here, where no migration runs (`flask db upgrade` logs as alembic.ini says).
        "alembic": {"level": "WARNING"},
    },
}


def post_worker_init(worker: "Worker") -> None:
    # Said once a worker has loaded the app and takes requests, so an operator (or a test) can
    # tell a server whose workers have all started from one whose first worker alone serves.
    # It names the release the worker imported, which a reload changes (docs/operations.rst).
    from animal_store.version import VERSION

    worker.log.info(
        "Worker ready (pid: %s): animal-store %s",
        worker.pid,
        VERSION,
        extra={"fields": {"version": VERSION}},
    )
    # (Only for the store: benchmarks/ceiling.py and floor.py run under this file too.)
    if "animal_store_rate_limits" not in getattr(worker.wsgi, "extensions", {}):
        return
    app = cast("Flask", worker.wsgi)
    # Loud when the rate limits cannot hold: counted in each worker's memory.
    from animal_store.access.rate_limits import warn_if_counted_apart

    warn_if_counted_apart(app, worker.cfg.workers)
    write_counts_when_idle(app, worker)


def write_counts_when_idle(app: "Flask", worker: "Worker") -> None:
    """Have the worker write the requests it counted in memory
    (animal_store/observability/metrics.py) when they are due though no request comes, so an idle
    worker's last second reaches the scrapes; and have a sync worker count the time it waits for a
    connection: its idle time."""
    from gunicorn.workers.sync import SyncWorker

    from animal_store.observability.metrics import request_metrics

    metrics = request_metrics(app)
    notify = worker.notify

    def notify_and_write() -> None:
        notify()
        metrics.write_if_due()

    # The worker calls notify() between requests and when it wakes from waiting for one.
    worker.notify = notify_and_write  # type: ignore[method-assign]
    if not isinstance(worker, SyncWorker):
        return  # gthread wakes every second already; its idle time is not counted
    # It waits for a connection up to half the timeout (15 s); a second at most, so an idle
    # worker's counts are written within two seconds of its last request. A wake-up a second
    # costs nothing measurable.
    worker.timeout = min(worker.timeout, 1)
    metrics.count_busy_share()
    wait = worker.wait

    def wait_and_count(timeout: int) -> Any:
        # Its one wait for a connection: between requests it does not wait at all.
        started = time.monotonic()
        try:
            return wait(timeout)
        finally:
            metrics.idle(time.monotonic() - started)

    worker.wait = wait_and_count  # type: ignore[method-assign]


def worker_exit(server: "Arbiter", worker: "Worker") -> None:
    # A worker that stops (a reload, a restart, max_requests) writes what it counted last. One
    # that could not load the app has no `wsgi`, and nothing counted: gunicorn has logged why.
    if "animal_store_metrics" in getattr(getattr(worker, "wsgi", None), "extensions", {}):
        from animal_store.observability.metrics import request_metrics

        request_metrics(cast("Flask", worker.wsgi)).write()


def post_fork(server: "Arbiter", worker: "Worker") -> None:
    # Requests gunicorn cannot parse (headers or URL over its limits, broken chunked bodies) are
    # answered by gunicorn itself: with the API's error object rather than an HTML page.
    # Imported here, in the worker, which loads the app anyway: the master stays free of it.
    from animal_store.serving import gunicorn_errors

    gunicorn_errors.install()
