"""Bearer API keys: how they are made, stored (as hashes only) and checked on each request."""

import hashlib
import secrets
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cachetools import TTLCache
from flask import current_app, g, request

from animal_store import errors
from animal_store.access import last_used
from animal_store.access.auth_failures import AuthFailures
from animal_store.current import APP, REQUEST, G
from animal_store.data import store
from animal_store.data.models import ApiKey
from animal_store.extensions import db, settings

# What a key may do: `read` lists and gets animals, `write` creates them (api.SCOPE_OF_METHOD).
SCOPES = ("read", "write")
# A recognisable prefix lets people and secret scanners spot a leaked key.
KEY_PREFIX = "ask_"
VISIBLE_PREFIX_LENGTH = len(KEY_PREFIX) + 6
REALM = 'Bearer realm="animal-store"'


def new_key() -> str:
    """Return a fresh key: the prefix and 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def issue_key(
    name: str,
    rate_limit: str | None = None,
    scopes: tuple[str, ...] = SCOPES,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Store a new key under this name and return it with the key, which is never stored."""
    key = new_key()
    api_key = ApiKey(
        name=name,
        prefix=key[:VISIBLE_PREFIX_LENGTH],
        key_hash=hash_key(key),
        created_at=datetime.now(UTC),
        rate_limit=rate_limit,
        scopes=",".join(scopes),
        expires_at=expires_at,
    )
    db.session.add(api_key)
    return api_key, key


def rotate_key(api_key: ApiKey, grace: timedelta) -> str:
    """Give the key a new secret and return it; the old one works until `grace` has passed.

    Name, scopes, expiry and rate limit stay. A key rotated again within its grace drops the
    older key at once: only the last replaced one is kept.
    """
    key = new_key()
    api_key.previous_key_hash, api_key.previous_prefix = api_key.key_hash, api_key.prefix
    api_key.previous_key_expires_at = datetime.now(UTC) + grace
    api_key.key_hash, api_key.prefix = hash_key(key), key[:VISIBLE_PREFIX_LENGTH]
    return key


@dataclass
class CachedKey:
    id: int
    name: str
    # The name of the key's rate-limit budget: its hash, unique, so no two keys (nor two test
    # runs on one Redis) ever share a count.
    budget: str
    rate_limit: str | None  # None: the service's RATE_LIMIT
    scopes: frozenset[str]
    expires_at: datetime | None  # this key's: a replaced key's grace ends it sooner
    last_used_at: datetime | None

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class KeyCache:
    """Valid keys by hash, per process: most requests are authenticated without a query.

    Only valid keys are kept, so a new key works at once; a revoked key goes on working in a
    process that has it cached for at most `ttl` seconds, and a key's old rate limit holds as
    long. At most `size` keys, least recently used dropped first (cachetools' TTLCache). A lock,
    because TTLCache is not thread-safe and a worker may serve requests on several threads.
    """

    def __init__(self, ttl: float, size: int, resolution: float) -> None:
        self.enabled = ttl > 0 and size > 0
        # How often a key's last-used time is written (KEY_LAST_USED_RESOLUTION), for record_use.
        self.resolution = timedelta(seconds=resolution)
        self.entries: TTLCache[bytes, CachedKey] = TTLCache(maxsize=max(size, 1), ttl=max(ttl, 0))
        self.lock = threading.Lock()

    def get(self, key_hash: bytes) -> CachedKey | None:
        with self.lock:
            return self.entries.get(key_hash)

    def put(self, key_hash: bytes, entry: CachedKey) -> None:
        if self.enabled:
            with self.lock:
                self.entries[key_hash] = entry


# Where each process keeps its valid keys (failover.py forgets them by removing the entry).
KEY_CACHE = "animal_store_key_cache"


def key_cache() -> KeyCache:
    """Return this app's key cache, made on first use so each process (worker) has its own."""
    cache: KeyCache | None = APP._get_current_object().extensions.get(KEY_CACHE)
    if cache is None:
        config = settings(current_app)
        cache = current_app.extensions.setdefault(
            KEY_CACHE,
            KeyCache(
                config.KEY_CACHE_SECONDS, config.KEY_CACHE_SIZE, config.KEY_LAST_USED_RESOLUTION
            ),
        )
    return cache


def auth_failures() -> AuthFailures | None:
    """Return the app's count of failed key checks by address (auth_failures.py): past its
    budget, a request without a key this worker knows valid is refused 429 before any look-up.
    Asked only once a check is failing or must go to the database."""
    return current_app.extensions.get("animal_store_auth_failures")


def presented_key() -> str | None:
    """Return the key from `Authorization: Bearer <key>`; the scheme is case-insensitive."""
    # The header as the WSGI environ holds it: no look-up through the request's headers.
    scheme, _, credentials = (
        REQUEST._get_current_object().environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    )
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


def authenticate(scope: str) -> CachedKey:
    """Let the request through only with a valid key, unrevoked, unexpired and with `scope`, and
    return what is known of it; runs before everything else."""
    key = presented_key()
    if key is None:
        g.auth_failure = "missing"  # for the metrics (metrics.py)
        failures = auth_failures()
        if failures is not None:
            failures.check(None)
            failures.failed(None, looked_up=False)
        raise errors.UNAUTHORIZED(headers={"WWW-Authenticate": REALM})
    key_hash = hash_key(key)
    cache = key_cache()
    entry = cache.get(key_hash)
    if entry is None:
        failures = auth_failures()
        if failures is not None:
            failures.check(key_hash)
        missing = failures is not None and failures.known_missing(key_hash)
        entry = None if missing else look_up_key(key_hash)
        if entry is None:
            # Unknown and revoked keys are not in the key cache: a worker remembers them only
            # KEY_MISS_CACHE_SECONDS, as misses.
            g.auth_failure = "invalid"
            if failures is not None:
                failures.failed(key_hash, looked_up=not missing)
            raise errors.INVALID_KEY(
                headers={"WWW-Authenticate": f'{REALM}, error="invalid_token"'}
            )
        if failures is not None and not entry.expired(datetime.now(UTC)):
            failures.found_valid(key_hash)
        cache.put(key_hash, entry)
    now = datetime.now(UTC)
    if entry.expired(now):
        # Cached or not, an expired key is refused from the moment it expires.
        g.auth_failure = "expired"
        failures = auth_failures()
        if failures is not None:
            failures.check(key_hash)
            failures.failed(key_hash, looked_up=False)
        raise errors.INVALID_KEY(headers={"WWW-Authenticate": f'{REALM}, error="invalid_token"'})
    # Its name for the logs and its id for the Idempotency-Keys, which are scoped to it; the
    # visible prefix of the key presented (a rotated key's old one in its grace has its own).
    context = G._get_current_object()
    context.api_key, context.api_key_prefix = entry, key[:VISIBLE_PREFIX_LENGTH]
    record_use(entry, now, cache.resolution)
    if scope not in entry.scopes:
        g.auth_failure = "scope"
        raise errors.MISSING_SCOPE(method=request.method, path=request.path, scope=scope)
    return entry


def look_up_key(key_hash: bytes) -> CachedKey | None:
    row = store.find_key(key_hash)
    if row is None:
        return None
    expiries = [row["expires_at"]]
    if not row["current"]:  # the key a rotation replaced, in its grace
        expiries.append(row["previous_key_expires_at"])
    return CachedKey(
        id=row["id"],
        name=row["name"],
        budget=key_hash.hex(),
        rate_limit=row["rate_limit"],
        scopes=frozenset(row["scopes"].split(",")),
        expires_at=min((moment for moment in expiries if moment is not None), default=None),
        last_used_at=row["last_used_at"],
    )


def record_use(entry: CachedKey, now: datetime, resolution: timedelta) -> None:
    """Have the key's last-used time written at most once per `resolution`, by this process's
    writer (last_used.py): the request neither waits on the write nor fails with it."""
    if entry.last_used_at is not None and now - entry.last_used_at < resolution:
        return
    last_used.note_use(entry.id, now, resolution)
    entry.last_used_at = now
