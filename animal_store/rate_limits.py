"""Per-key rate limits on the operations of the API layer, with Flask-Limiter.

Every API key (anonymous requests: every client address) has one budget, RATE_LIMIT, shared by
all the operations of the API layer (api.py), counted in fixed windows. Beyond it: 429 with
Retry-After. Every limited response carries RateLimit-Limit, RateLimit-Remaining and
RateLimit-Reset (seconds until the window resets). Counts live in RATELIMIT_STORAGE_URI:
memory:// counts per worker process, so the real limit is RATE_LIMIT times workers times
instances; redis:// shares one count among all. If the storage fails, requests are served
unlimited and the failure is logged: a broken Redis must not take the store down. Nothing outside
the operations that need a key (health, OpenAPI, docs) is ever limited.
"""

import math
import time

from flask import current_app, request
from flask_limiter import Limit, Limiter

from animal_store.auth import hash_key, presented_key


def rate_limit_key() -> str:
    # Runs before authentication (Flask-Limiter checks in before_request), so the bucket is the
    # presented key's hash, never the key itself; a request without a key counts per address.
    key = presented_key()
    if key is not None:
        return "key:" + hash_key(key).hex()
    return "addr:" + (request.remote_addr or "unknown")


def configured_limit() -> str:
    return current_app.config["RATE_LIMIT"]


def init_rate_limits(app, applies) -> None:
    """Limit the requests for which `applies()` is true, per key; a Limiter per app, as each app
    has its own storage."""
    limiter = Limiter(
        rate_limit_key,
        default_limits=[
            Limit(configured_limit, scope="api", shared=True, exempt_when=lambda: not applies()),
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
