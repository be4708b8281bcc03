"""Per-key rate limits on the operations of the API layer, with Flask-Limiter.

Every API key has one budget, shared by all the operations of the API layer (api.py), counted in
fixed windows: the key's own limit (`flask keys set-limit`), else RATE_LIMIT. Beyond it: 429 with
Retry-After. Every limited response carries RateLimit-Limit, RateLimit-Remaining and
RateLimit-Reset (seconds until the window resets).

The check runs after authentication (api.Policies.admit is registered first), so it counts known
keys only: a request without a valid key is answered 401 at less cost than counting it would take.

Counts live in RATELIMIT_STORAGE_URI. redis:// shares one count among every worker and instance,
so the limit configured is the limit a client gets; the production and staging settings use the
machine's Redis. memory:// counts in each worker process: exact for one process (the development
server), but under gunicorn the real limit is the limit times the workers times the instances,
which the workers say in their log at boot and /readyz says while they serve (counting()). If the
storage fails, requests are served unlimited and the failure is logged: a broken Redis must not
take the store down. Nothing outside the operations that need a key is ever limited.
"""

import math
import time

from flask import current_app, g
from flask_limiter import Limit, Limiter
from limits import parse_many

from animal_store.auth import hash_key, presented_key

# What /readyz says of the counts (counting()).
SHARED, PER_PROCESS, UNREACHABLE, OFF = "shared", "per process", "storage unreachable", "off"


def rate_limit_key() -> str:
    # The key's hash, never the key: unique, so no two keys (nor two test runs on one Redis)
    # ever share a count. Only authenticated requests reach the check (api.Policies.admit).
    return "key:" + hash_key(presented_key()).hex()


def key_limit() -> str:
    return g.get("api_key_rate_limit") or current_app.config["RATE_LIMIT"]


def check_limit(text: str) -> str:
    """Return a limit in Flask-Limiter's notation ("100/second", "6000 per minute") unchanged,
    or raise ValueError saying what is wrong with it."""
    try:
        parse_many(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a rate limit: write it like '100/second' or '6000 per minute'"
        ) from None
    return text


def init_rate_limits(app, applies) -> None:
    """Limit the requests for which `applies()` is true, per key; a Limiter per app, as each app
    has its own storage."""
    check_limit(app.config["RATE_LIMIT"])
    limiter = Limiter(
        rate_limit_key,
        default_limits=[
            Limit(key_limit, scope="api", shared=True, exempt_when=lambda: not applies()),
        ],
        strategy="fixed-window",
        # The RateLimit-* headers are ours (below): Flask-Limiter's Reset is a timestamp.
        headers_enabled=False,
        swallow_errors=True,
        key_prefix="animal-store",
    )
    limiter.init_app(app)
    app.extensions["animal_store_limiter"] = limiter

    @app.after_request
    def add_rate_limit_headers(response):
        if not limiter.enabled:
            return response
        limit = limiter.current_limit
        if limit is None:
            return response
        try:
            reset_at, remaining = limit.window
        # The storage failed since the check (Redis went away): the headers are not worth a 500.
        except Exception:
            current_app.logger.warning("Rate limit storage failed reading the window")
            return response
        reset_in = max(0, math.ceil(reset_at - time.time()))
        response.headers["RateLimit-Limit"] = str(limit.limit.amount)
        response.headers["RateLimit-Remaining"] = str(remaining)
        response.headers["RateLimit-Reset"] = str(reset_in)
        if response.status_code == 429:
            response.headers["Retry-After"] = str(max(1, reset_in))
        return response


def counting(app) -> str:
    """Say how the limits are counted now: shared, per process, storage unreachable, or off."""
    limiter = app.extensions["animal_store_limiter"]
    if not limiter.enabled:
        return OFF
    if app.config["RATELIMIT_STORAGE_URI"].startswith("memory://"):
        return PER_PROCESS
    try:
        reachable = limiter.storage.check()
    except Exception:
        reachable = False
    return SHARED if reachable else UNREACHABLE


def warn_if_counted_apart(app, workers: int) -> None:
    """Say at a worker's boot that the configured limit cannot hold: its counts are its own."""
    if workers > 1 and counting(app) == PER_PROCESS:
        app.logger.warning(
            "Rate limits are counted in each worker's memory (RATELIMIT_STORAGE_URI=memory://): "
            "with %d workers a key may make up to %d times its limit, and more with several "
            "instances. Point RATELIMIT_STORAGE_URI at a Redis that every worker shares.",
            workers,
            workers,
        )
