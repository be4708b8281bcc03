"""gunicorn settings for production; `--bind` and `--workers` on the command line override them."""

import os

bind = os.environ.get("ANIMAL_STORE_BIND", "127.0.0.1:8000")
# One sync worker per core: on 2 cores, 2 sync workers served the database-backed list faster
# than 4 (the extra workers only contend for the cores and for SQLite's write lock).
workers = int(os.environ.get("WEB_CONCURRENCY", os.cpu_count() or 1))
worker_class = "sync"
# Not preloaded: each worker imports the app and opens its own database connections after
# the fork, so no connection (or SQLite file handle) is ever shared between processes.
preload_app = False
timeout = 30
# On SIGTERM, workers finish the requests in flight for up to this long before they are killed.
graceful_timeout = 30
keepalive = 5
accesslog = "-"
errorlog = "-"
