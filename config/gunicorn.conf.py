"""gunicorn settings for production; `--bind` and `--workers` on the command line override them.
Start: `gunicorn -c config/gunicorn.conf.py wsgi:app`.

Settings, and the master's hooks; what the master does for the store is in
animal_store/serving/master.py, what a worker does differently from gunicorn's sync worker in
animal_store/serving/worker.py. The hooks import the package when they run, not this file: the
master holds nothing of the release past a reload (the worker class's docstring says how).
"""

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # For the checker only: nothing of Flask or the app in the master.
    from gunicorn.arbiter import Arbiter
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
# To try gthread workers, `--worker-class gthread --threads N`: measure first.
workers = int(os.environ.get("WEB_CONCURRENCY", os.cpu_count() or 1))
# gunicorn's sync worker, with the store's error answers, idle time and counts, body timeout and
# quicker end of a connection (its docstring); `--threads` does not apply to it.
worker_class = "animal_store.serving.worker.Worker"
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


def on_starting(server: "Arbiter") -> None:
    from animal_store.serving import master

    master.check_boot(server)


def when_ready(server: "Arbiter") -> None:
    from animal_store.serving import master

    master.start_metrics(server)


def on_reload(server: "Arbiter") -> None:
    from animal_store.serving import master

    master.reload(server)


def on_exit(server: "Arbiter") -> None:
    from animal_store.serving import master

    master.exit_master()


def child_exit(server: "Arbiter", worker: "Worker") -> None:
    # A dead worker's gauges (its pool's connections) stop counting; its counters stay.
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


# gunicorn's own access log is off: the app writes one JSON line per request to stdout
# (animal_store/observability/logs.py) with the request ID and key name, which gunicorn's line
# cannot carry.
accesslog = None


# gunicorn's logger without its access line, its lines as JSON (the module's docstring).
logger_class = "animal_store.serving.gunicorn_log.Logger"
errorlog = "-"
# gunicorn's error log (boot, worker exits, timeouts) as JSON lines on stdout too, like the app's.
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "animal_store.serving.gunicorn_log.JsonFormatter"}},
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
