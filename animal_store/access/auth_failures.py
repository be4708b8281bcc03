"""Failed key checks counted per client address, so that a flood of made-up keys stops costing
database look-ups, and a valid key from the same address is not refused for it.

A request to an operation of /v1 whose key check fails (no key, or one that is wrong, revoked or
expired) counts against its client address: request.remote_addr, the client's once
TRUSTED_PROXIES names the proxy in front (proxies.py). It counts in the rate limits' own
RateLimiter (rate_limits.py), as the budget "address:<address>" with the limit
AUTH_FAILURE_LIMIT, so the count is shared by the workers and instances through Redis, with the
same breaker while Redis hangs and the same bound on overshoot. Once an address has used its
budget, its requests are answered 429 with Retry-After and RateLimit-* before any look-up, until
the window ends, unless they carry a key the worker knows valid:

- a key in the key cache (auth.KeyCache, KEY_CACHE_SECONDS) is served as usual, never counted;
- a key whose look-up this worker found valid within the last KNOWN_VALID_SECONDS is looked up
  again, so a client is not refused for another's failures once its cache entry has expired;
  a revoked one is still refused by its look-up, then forgotten;
- a key this worker has never seen valid is refused: without the look-up that the budget spares
  the database, it cannot be told from a made-up one (docs/operations.rst, Rate limits).

Each worker also remembers, KEY_MISS_CACHE_SECONDS, the keys its look-up did not find: the same
made-up key again is refused 401 without a query. A key that became valid after it was tried
would be refused for at most that long; keys are 256 random bits, so none is tried before it is
made, and a revoked key never becomes valid again.
"""

import ipaddress
import threading
from collections.abc import Iterable

from cachetools import TTLCache
from flask import Flask, request

from animal_store import errors
from animal_store.access.rate_limits import REFUSALS, RateLimiter
from animal_store.extensions import settings
from animal_store.settings_schema import Settings

# Hashes of the keys a worker's look-ups found valid, kept this long (a day) and at most this
# many, least recently used dropped first: a valid key is let through to its look-up from an
# address over its budget. Only look-ups fill it, so a flood cannot.
KNOWN_VALID_SECONDS = 24 * 60 * 60
KNOWN_VALID_KEYS = 10_000


class AuthFailures:
    """An app's count of failed key checks by client address, and what each worker remembers of
    the keys it looked up."""

    def __init__(self, config: "Settings", limiter: RateLimiter) -> None:
        self.limiter = limiter
        self.limit = config.AUTH_FAILURE_LIMIT
        self.exempt = exempt_networks(config.AUTH_FAILURE_EXEMPT)
        self.known_valid: TTLCache[bytes, bool] = TTLCache(
            KNOWN_VALID_KEYS, ttl=KNOWN_VALID_SECONDS
        )
        miss_seconds = config.KEY_MISS_CACHE_SECONDS
        self.misses: TTLCache[bytes, bool] | None = None
        if miss_seconds > 0 and config.KEY_MISS_CACHE_SIZE > 0:
            self.misses = TTLCache(config.KEY_MISS_CACHE_SIZE, ttl=miss_seconds)
        # TTLCache is not thread-safe, and the development server serves on threads.
        self.lock = threading.Lock()

    def budget(self) -> str | None:
        """Return the budget of the request's address; None when its failures are not limited."""
        if self.limit is None:
            return None
        address = request.remote_addr
        if self.exempt and is_exempt(address, self.exempt):
            return None
        return f"address:{address}"

    def check(self, key_hash: bytes | None) -> None:
        """Before a look-up, or the refusal of a request without a key: answer 429 if the
        request's address has used its budget and the worker does not know the key valid."""
        budget = self.budget()
        if budget is None:
            return
        if key_hash is not None:
            with self.lock:
                if key_hash in self.known_valid:
                    return
        window = self.limiter.exceeded(budget, self.limit)
        if window is not None:
            REFUSALS.labels("auth_failures").inc()
            raise errors.TOO_MANY_AUTH_FAILURES(limit=str(window.limit), headers=window.headers())

    def failed(self, key_hash: bytes | None, looked_up: bool) -> None:
        """Count a failed check against the request's address; remember a key the look-up did
        not find (once: the bound on a miss runs from its look-up), forget it as valid."""
        budget = self.budget()
        if budget is not None:
            self.limiter.count(budget, self.limit)
        if key_hash is not None:
            with self.lock:
                self.known_valid.pop(key_hash, None)
                if looked_up and self.misses is not None:
                    self.misses[key_hash] = True

    def found_valid(self, key_hash: bytes) -> None:
        with self.lock:
            self.known_valid[key_hash] = True

    def known_missing(self, key_hash: bytes) -> bool:
        """Tell whether the worker looked this key up lately and did not find it."""
        if self.misses is None:
            return False
        with self.lock:
            return key_hash in self.misses


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def exempt_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """Parse AUTH_FAILURE_EXEMPT once: addresses and networks ("192.0.2.7", "10.0.0.0/8")."""
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def is_exempt(address: str | None, networks: tuple[Network, ...]) -> bool:
    if address is None:  # a server that gives no peer address: as ip_address(None), no match
        return False
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(parsed in network for network in networks)


def init_auth_failures(app: Flask, limiter: RateLimiter) -> AuthFailures:
    """Count the app's failed key checks in its rate limiter; auth.authenticate consults it."""
    failures = AuthFailures(settings(app), limiter)
    app.extensions["animal_store_auth_failures"] = failures
    return failures
