"""Per-key rate limits on the operations of the API layer, counted with `limits`.

Every API key has one budget, shared by all the operations of the API layer (api.py), counted in
fixed windows: the key's own limit (`flask keys set-limit`), else RATE_LIMIT. Beyond it: 429 with
Retry-After. Every limited response carries RateLimit-Limit, RateLimit-Remaining and
RateLimit-Reset (seconds until the window resets).

The layer counts a request after its key is checked (api.Policies.admit), so only known keys are
counted: a request without a valid key is answered 401 at less cost than counting it would take.

Counts live in RATELIMIT_STORAGE_URI, through `limits`' storages. redis:// shares one count among
every worker and instance, so the limit configured is the limit a client gets; the production and
staging settings use the machine's Redis. memory:// counts in each worker process: exact for one
process (the development server), but under gunicorn the real limit is the limit times the
workers times the instances, which the workers say in their log at boot and /readyz says while
they serve (counting()). If the storage fails, requests are served unlimited and the failure is
logged: a broken Redis must not take the store down.

Why not Flask-Limiter, which this module used before: for one limit it asked Redis three times a
request (count, then count and expiry again for the headers) and resolved its decorators, scopes
and exemptions on every request, together 0.8 ms of a worker's CPU per request on the benchmark
machine (docs/benchmarks.rst). Here a request costs one round trip: the count comes back from the
increment, and the window's end is known to the worker that opened the window, or asked once per
window by the others. Its settings keep the names they had (RATELIMIT_*).
"""

import math
import threading
import time
from dataclasses import dataclass

from cachetools import TLRUCache
from flask import current_app
from limits import RateLimitItem, parse_many
from limits.errors import StorageError
from limits.storage import storage_from_string

from animal_store import errors

# What /readyz says of the counts (counting()).
SHARED, PER_PROCESS, UNREACHABLE, OFF = "shared", "per process", "storage unreachable", "off"
KEY_PREFIX = "animal-store"
# Windows whose end a worker remembers; an API key has one open window per limit.
KNOWN_WINDOWS = 10_000


def check_limit(text: str) -> str:
    """Return a limit in `limits`' notation ("100/second", "6000 per minute") unchanged, or
    raise ValueError saying what is wrong with it."""
    try:
        parse_many(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a rate limit: write it like '100/second' or '6000 per minute'"
        ) from None
    return text


@dataclass(frozen=True)
class Window:
    """Where a key stands in the window of one of its limits, this request counted."""

    limit: RateLimitItem
    remaining: int
    reset_at: float  # when the window ends, in Unix seconds
    exceeded: bool

    def headers(self) -> dict:
        reset_in = max(0, math.ceil(self.reset_at - time.time()))
        headers = {
            "RateLimit-Limit": str(self.limit.amount),
            "RateLimit-Remaining": str(self.remaining),
            "RateLimit-Reset": str(reset_in),
        }
        if self.exceeded:
            headers["Retry-After"] = str(max(1, reset_in))
        return headers


class RateLimiter:
    """Count requests by API key in fixed windows, in the storage RATELIMIT_STORAGE_URI names."""

    def __init__(self, config):
        self.enabled = config["RATELIMIT_ENABLED"]
        self.uri = config["RATELIMIT_STORAGE_URI"]
        self.default = check_limit(config["RATE_LIMIT"])
        self.storage = None
        if self.enabled:
            options = config["RATELIMIT_STORAGE_OPTIONS"] if self.uri.startswith("redis") else {}
            self.storage = storage_from_string(self.uri, wrap_exceptions=True, **options)
        # A limit's text parsed once: a key's limit is read on every request.
        self.parsed = {}
        # Each open window's end by its storage key, until it passes (cachetools' TLRUCache).
        self.window_ends = TLRUCache(
            KNOWN_WINDOWS, ttu=lambda _key, end, _now: end, timer=time.time
        )
        # The development server serves each request on a thread of its own.
        self.lock = threading.Lock()

    def count(self, budget: str, limit: str | None) -> Window | None:
        """Count a request against the budget's limit (None: RATE_LIMIT), or against each of
        its limits, the shortest window first, until one is exceeded; return the window the
        headers show. None when limiting is off, or when the storage failed: then the request
        is served unlimited and the failure logged."""
        if not self.enabled:
            return None
        text = limit or self.default
        items = self.parsed.get(text)
        if items is None:
            items = self.parsed[text] = sorted(parse_many(text))
        shown = None
        try:
            for item in items:
                window = self.hit(item, item.key_for(KEY_PREFIX, budget))
                shown = shown or window
                if window.exceeded:
                    return window
        except StorageError as error:
            current_app.logger.error(
                "Rate limit storage failed; serving without limits: %s", error.storage_error
            )
            return None
        return shown

    def hit(self, item: RateLimitItem, key: str) -> Window:
        now = time.time()
        count = self.storage.incr(key, item.get_expiry())
        with self.lock:
            if count == 1:  # this request opened the window, which ends a whole period on
                end = self.window_ends[key] = now + item.get_expiry()
            else:
                end = self.window_ends.get(key)
        if end is None:  # a window another worker opened: asked once, then remembered
            end = self.storage.get_expiry(key)
            with self.lock:
                self.window_ends[key] = end
        return Window(item, max(0, item.amount - count), end, count > item.amount)


def window_end(_key, end: float, _now: float) -> float:
    return end


def count_request(limiter: RateLimiter, budget: str, limit: str | None) -> Window | None:
    """Count the request; over the limit, answer 429 with the window's headers."""
    window = limiter.count(budget, limit)
    if window is not None and window.exceeded:
        raise errors.TOO_MANY_REQUESTS(limit=str(window.limit), headers=window.headers())
    return window


def init_rate_limits(app) -> RateLimiter:
    """Make the app's limiter: one per app, as each app has its own storage."""
    limiter = app.extensions["animal_store_rate_limits"] = RateLimiter(app.config)
    return limiter


def counting(app) -> str:
    """Say how the limits are counted now: shared, per process, storage unreachable, or off."""
    limiter = app.extensions["animal_store_rate_limits"]
    if not limiter.enabled:
        return OFF
    if limiter.uri.startswith("memory://"):
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
