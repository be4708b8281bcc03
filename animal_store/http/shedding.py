"""Shedding: a request that waited longer than REQUEST_QUEUE_TIMEOUT for a worker is answered
503 `service_unavailable` with Retry-After by the worker that takes it, before any key check or
query.

Under a surge the requests nginx passes on wait in gunicorn's listening socket until a worker is
free (config/gunicorn.conf.py, backlog). While the clients wait less than the queue lets them,
serving each in turn keeps the throughput at the workers' capacity, which shedding would only
lower. Past it, the queue grows faster than the workers empty it: each request would wait
longer than the last, the clients give up, and the workers serve answers no one reads. Answering
the requests that waited too long unserved, for a fraction of a request's work, empties the queue
of them at many times the rate it is served, so the ones behind are served while their clients
still wait, and a client told to retry comes back once the surge has passed. The Google SRE
book's "Handling Overload" says as much; Heroku's router, rack-timeout's wait_timeout and
Envoy's overload manager do it.

Only a worker sheds, as it takes the request: while every worker is stuck, the 503 waits for the
first one free (docs/deploy.rst, Overload says why nothing else can answer it). A request whose
client has gone by then is not run at all (serving/worker.py).

How long a request waited: nginx stamps the moment it passes it on, `X-Request-Start:
t=<seconds since the epoch, to the millisecond>` (config/nginx.conf, nginx's `$msec`; the form
Heroku's router and New Relic use), and a worker compares that with its clock as it starts on
the request. Both read the machine's clock when nginx runs beside gunicorn, as deployed. A request
without the stamp (the development server, a direct test) or with one this module cannot read,
or one from the future, is never shed; a client that writes its own through nginx is overwritten,
and one that reaches gunicorn directly can shed only its own request.
"""

import math
import time
from collections.abc import Callable

from flask import Flask, g

from animal_store.current import REQUEST
from animal_store.errors import OVERLOADED
from animal_store.extensions import settings

# Retry-After of a shed request: time for a queue that made a request wait REQUEST_QUEUE_TIMEOUT
# to empty by much (a worker sheds hundreds a second), and for a surge of minutes to ebb by the
# retry after a few.
RETRY_AFTER = "5"


def queued_since(stamp: str) -> float | None:
    """The seconds since the epoch in `t=1732700000.123` (nginx's $msec), or None."""
    prefix, _, seconds = stamp.partition("=")
    if prefix != "t":
        return None
    try:
        since = float(seconds)
    except ValueError:
        return None
    return since if math.isfinite(since) else None


def init_shedding(app: Flask) -> tuple[Callable[[], None], ...]:
    """Return the before-request step that sheds a request queued longer than
    REQUEST_QUEUE_TIMEOUT, or none where it is 0 (never)."""
    timeout = settings(app).REQUEST_QUEUE_TIMEOUT

    def shed_stale_request() -> None:
        # From the WSGI environ: the headers' view would cost every request its construction.
        stamp = REQUEST._get_current_object().environ.get("HTTP_X_REQUEST_START")
        if stamp is None:
            return
        since = queued_since(stamp)
        if since is not None and time.time() - since > timeout:
            g.request_shed = True
            raise OVERLOADED(headers={"Retry-After": RETRY_AFTER})

    return (shed_stale_request,) if timeout else ()
