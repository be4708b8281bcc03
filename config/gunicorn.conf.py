"""gunicorn settings for production; `--bind`, `--workers` and `--threads` on the command line
override them. Start: `gunicorn -c config/gunicorn.conf.py wsgi:app`."""

import os

bind = os.environ.get("ANIMAL_STORE_BIND", "127.0.0.1:8000")
# One process per core, chosen by measurement (docs/deploy.rst). gthread workers keep client
# connections alive; one thread each by default, because on our 2 cores with the database on the
# same machine, 4 threads per worker made every operation slower (they only contend for the GIL
# and the cores): list 998 against 418 req/s on PostgreSQL, create 802 against 569 on SQLite.
# Raise GUNICORN_THREADS where requests mostly wait on a remote database.
workers = int(os.environ.get("WEB_CONCURRENCY", os.cpu_count() or 1))
worker_class = "gthread"
threads = int(os.environ.get("GUNICORN_THREADS", 1))
# Not preloaded: each worker imports the app and opens its own database connections after the
# fork, so no connection (or SQLite file handle) is ever shared between processes. Preloading
# would save a little memory and boot time, and would need the engine disposed after each fork.
preload_app = False
# A worker silent for this long is killed and replaced (a request stuck past every DB timeout).
timeout = 30
# On SIGTERM, workers stop accepting, finish the requests in flight for up to this long, then exit.
graceful_timeout = 30
keepalive = 5
# gunicorn takes X-Forwarded-Proto from no one: the app decides whose forwarded headers count
# (TRUSTED_PROXIES, animal_store/proxies.py), for the scheme as for the host and the address.
forwarded_allow_ips = ""
# gunicorn's control socket (for gunicornc) is off unless the deployment names a path for it, such
# as /run/animal-store/gunicorn.ctl: its default, ~/.gunicorn/, would land in the checkout (the
# service user's home in docs/deploy.rst), and every instance on a machine would share it.
control_socket = os.environ.get("GUNICORN_CONTROL_SOCKET", "")
control_socket_disable = not control_socket

# gunicorn's own access log is off: the app writes one JSON line per request to stdout
# (animal_store/logs.py) with the request ID and key name, which gunicorn's line cannot carry.
accesslog = None
errorlog = "-"
# gunicorn's error log (boot, worker exits, timeouts) as JSON lines on stdout too, like the app's.
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "animal_store.logs.JsonFormatter"}},
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
    },
}


def post_worker_init(worker):
    # Said once a worker has loaded the app and takes requests, so an operator (or a test) can
    # tell a server whose workers have all started from one whose first worker alone serves.
    worker.log.info("Worker ready (pid: %s)", worker.pid)
    # Loud when the rate limits cannot hold: counted in each worker's memory. (Only for the
    # store: benchmarks/ceiling.py, a bare WSGI function, runs under this file too.)
    if hasattr(worker.wsgi, "extensions"):
        from animal_store.rate_limits import warn_if_counted_apart

        warn_if_counted_apart(worker.wsgi, worker.cfg.workers)


def post_fork(server, worker):
    # Requests gunicorn cannot parse (headers or URL over its limits, broken chunked bodies) are
    # answered by gunicorn itself: with the API's error object rather than an HTML page.
    # Imported here, in the worker, which loads the app anyway: the master stays free of it.
    from animal_store import gunicorn_errors

    gunicorn_errors.install()
