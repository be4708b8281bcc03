"""Per-key rate limits on the operations of the API layer: counted in each worker's memory, shared
through Redis every few tens of milliseconds.

Every API key has one budget, shared by all the operations of the API layer (api/), counted in
fixed windows: the key's own limit (`flask keys set-limit`), else RATE_LIMIT. Beyond it: 429 with
Retry-After. Every limited response carries RateLimit-Limit, RateLimit-Remaining and
RateLimit-Reset (seconds until the window resets).

The layer counts a request after its key is checked (api.Policies.admit), so only known keys are
counted. A failed check counts against the client's address instead, in this same limiter
(auth_failures.py: the budget "address:<address>", the limit AUTH_FAILURE_LIMIT).

A request costs a local increment: each worker counts in its own memory and decides on the
shared total it last read plus what it counted since. The first request a worker serves once
RATELIMIT_SYNC_INTERVAL seconds have passed since its last sync is counted, then writes the
worker's counts to Redis (RATELIMIT_STORAGE_URI) and reads back the totals, all of its open
windows in one round trip, as Kong's `sync_rate` and APISIX's `sync_interval` do, then decided.
So:

- one request in a sync interval pays a round trip, the others none;
- a key may pass its limit by what it sends to each worker in one sync interval, since that is
  what a worker may have admitted and not yet told (docs/operations.rst has the bound); an
  interval of 0 syncs on every request: exact, at a round trip each;
- a worker learns the window's end, when another opened it, at its first sync.

The sync is inline, not on a thread of its own: a thread that wakes while the worker serves
waits for the GIL, and each time the worker releases the GIL around a socket call the two trade
wake-ups, which cost the worker a sixth of its CPU (docs/benchmarks.rst).

A circuit breaker keeps a sick Redis off the request path: a sync that fails, or waits longer than
RATELIMIT_STORAGE_OPTIONS' socket timeout (0.1 s), opens it, and the worker counts alone (the
limit holds per process, as with memory://) until its next try, RATELIMIT_RETRY_INTERVAL later
and twice as long after each failure, up to 4 s: one request a worker per interval waits out the
timeout. The log says so once, /readyz says so while it lasts (counting()), and the first sync
that succeeds adds the hits counted meanwhile to the windows still open. memory:// counts in each
process only: exact for the development server, the limit times the workers under gunicorn.

redis+sentinel:// counts in the master Redis Sentinels name (storage_client()): each connection
asks them, and one that fails or finds its Redis demoted is closed, so the breaker's next try
finds the new master; its tries double up to 2 s only, so a failover is followed within seconds.
A sync also asks the Sentinels once a second (follow_master()): a planned failover leaves the old
master answering, and taking counts no other worker reads, until Sentinel demotes it. STORAGE
says which Redis the workers count in.

Why our own counter rather than `limits`' storages (which this module used, after Flask-Limiter):
they count on the request path, a round trip per request, a tenth of a worker's CPU, and with
Redis hung every request waited out the socket timeout (issue "Degrade, don't stall"). `limits`
still parses the limits and names the windows.
"""

import contextlib
import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import Any, NamedTuple

import redis
from cachetools import TLRUCache
from flask import Flask
from limits import RateLimitItem, parse_many
from prometheus_client import Counter, Gauge
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from animal_store import errors
from animal_store.extensions import settings
from animal_store.settings_schema import SENTINEL_SCHEME, Settings, parse_sentinel_uri

# What /readyz says of the counts (counting()).
SHARED, PER_PROCESS, UNREACHABLE, OFF = "shared", "per process", "storage unreachable", "off"
KEY_PREFIX = "animal-store"
# Windows a worker counts at once, the least recently used dropped first; a key has one open
# window per limit.
KNOWN_WINDOWS = 10_000
# The breaker's retry interval doubles from RATELIMIT_RETRY_INTERVAL up to this (seconds).
MAX_RETRY_INTERVAL = 4.0
# Through Sentinels, up to this: a failover is what the breaker waits for, and the new master
# must be counted in within the 10 s docs/deploy.rst promises (the shipped Sentinels promote one
# about 4 s after the master stops answering). A try costs what it does with one Redis.
SENTINEL_MAX_RETRY_INTERVAL = 2.0
# Through Sentinels, a worker asks them which Redis is master at most this often (seconds), at a
# sync: on a planned failover the old master takes writes until Sentinel demotes it, 8 s or more
# after the new one is promoted, and a worker's connection to it would count there meanwhile.
MASTER_CHECK_INTERVAL = 1.0
# /readyz trusts a sync this recent to tell that Redis answers; after a longer silence it asks.
HEALTH_INTERVAL = 1.0

# Requests refused 429 by the app, by reason: "rate_limit" (a key past its own limit) or
# "auth_failures" (an address past its budget of failed key checks, auth_failures.py).
REFUSALS = Counter(
    "animal_store_refusals",
    "Requests refused 429, by reason: rate_limit (a key past its limit), auth_failures (an "
    "address past its budget of failed key checks).",
    ["reason"],
)
DEGRADED_SECONDS = Counter(
    "animal_store_rate_limit_degraded_seconds",
    "Seconds the workers counted rate limits apart because Redis did not answer, summed over "
    "the workers.",
)
# The workers counting in each Redis, by address (host:port, or a Unix socket's path): each live
# worker is 1 where it last synced, 0 where it synced before or while it counts apart. A failover
# moves them all to the new master's address; none while Redis does not answer.
STORAGE = Gauge(
    "animal_store_rate_limit_storage_workers",
    "Workers counting rate limits in each Redis, by address: where they last synced (a failover "
    "moves them to the new master; 0 everywhere while they count apart).",
    ["address"],
    multiprocess_mode="livesum",
)

# One round trip for all of a worker's windows. Each window is a hash of what each worker counted
# in it (ARGV: this worker's field, then its count and the period in ms by pairs), and the answer
# is the window's total and the milliseconds left in it. A worker writes its own count, not an
# increment, so a sync that timed out and ran anyway (a Redis that hung and went on) counts
# nothing twice. The window opens with the first hit anywhere, as `limits`' fixed windows do.
SYNC_SCRIPT = """
local answers = {}
local worker = ARGV[1]
for i, key in ipairs(KEYS) do
  local mine, period = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  if mine > 0 then  -- 0: nothing new here, only the total is read
    redis.call('HSET', key, worker, mine)
    if redis.call('PTTL', key) < 0 then
      redis.call('PEXPIRE', key, period)
    end
  end
  local total = 0
  for _, count in ipairs(redis.call('HVALS', key)) do
    total = total + tonumber(count)
  end
  answers[i] = {total, redis.call('PTTL', key)}
end
return answers
"""


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


class Window(NamedTuple):
    """Where a key stands in the window of one of its limits, this request counted: a tuple,
    made for every request at a third of a frozen dataclass's cost."""

    limit: RateLimitItem
    remaining: int
    reset_at: float  # when the window ends, in Unix seconds
    exceeded: bool

    def headers(self) -> dict[str, str]:
        reset_in = max(0, math.ceil(self.reset_at - time.time()))
        headers = {
            "RateLimit-Limit": str(self.limit.amount),
            "RateLimit-Remaining": str(self.remaining),
            "RateLimit-Reset": str(reset_in),
        }
        if self.exceeded:
            headers["Retry-After"] = str(max(1, reset_in))
        return headers


class Tally:
    """One key's count in one window of one limit, as this worker knows it."""

    __slots__ = ("end", "key", "limit", "mine", "others", "storage_key", "synced")

    def __init__(self, budget: str, limit: RateLimitItem, end: float) -> None:
        self.key = (budget, limit)
        self.limit = limit
        self.storage_key = limit.key_for(KEY_PREFIX, budget)
        self.end = end  # when the window ends, as far as this worker knows
        self.mine = 0  # hits this worker counted in the window
        self.synced = 0  # of which Redis has been told
        self.others = 0  # the other workers' hits, at the last sync

    @property
    def count(self) -> int:
        return self.others + self.mine


class RateLimiter:
    """Count requests by API key in fixed windows: here, and in Redis when RATELIMIT_STORAGE_URI
    names one."""

    def __init__(self, config: "Settings", logger: logging.Logger) -> None:
        self.logger = logger
        self.enabled = config.RATELIMIT_ENABLED
        self.uri = config.RATELIMIT_STORAGE_URI
        self.default = config.RATE_LIMIT
        self.sync_interval = float(config.RATELIMIT_SYNC_INTERVAL)
        self.retry_interval = self.retry_in = float(config.RATELIMIT_RETRY_INTERVAL)
        self.redis: redis.Redis | None = None
        self.max_retry_in = max(MAX_RETRY_INTERVAL, self.retry_interval)
        # Through Sentinels: their pool, and when (time.monotonic()) a sync next asks them.
        self.sentinel_pool: SentinelConnectionPool | None = None
        self.next_master_check = 0.0
        if self.enabled and self.uri != "memory://":
            self.redis = storage_client(self.uri, config.RATELIMIT_STORAGE_OPTIONS)
            self.script = self.redis.register_script(SYNC_SCRIPT)
            if isinstance(self.redis.connection_pool, SentinelConnectionPool):
                self.sentinel_pool = self.redis.connection_pool
                self.max_retry_in = max(SENTINEL_MAX_RETRY_INTERVAL, self.retry_interval)
        # A limit's text parsed once: a key's limit is read on every request.
        self.parsed: dict[str, list[RateLimitItem]] = {}
        # Each open window's tally by (budget, limit), until the window ends (cachetools).
        self.tallies: TLRUCache[tuple[str, RateLimitItem], Tally] = TLRUCache(
            KNOWN_WINDOWS, ttu=window_end, timer=time.time
        )
        # The development server serves each request on a thread of its own.
        self.lock = threading.Lock()
        self.sync_lock = threading.Lock()
        self.next_sync = 0.0  # when (time.monotonic()) a request next syncs
        self.last_contact: float | None = None  # when Redis last answered
        # While Redis does not answer: until when the time degraded has been counted.
        self.degraded_since: float | None = None
        # This process, and its name in the windows' hashes: both set at its first sync.
        self.pid: int | None = None
        self.worker = ""
        # The Redis this worker last synced with (STORAGE), None while it counts apart.
        self.storage_address: str | None = None

    def count(self, budget: str, limit: str | None) -> Window | None:
        """Count a request against the budget's limit (None: RATE_LIMIT), or against each of
        its limits, the shortest window first, until one is exceeded; return the window the
        headers show. None when limiting is off.

        Counted here first, then synced if a sync is due, then decided: the sync carries this
        request too, so with an interval of 0 every decision is on the exact shared count.
        """
        if not self.enabled:
            return None
        items = self.items(limit)
        now = time.time()
        counted: list[Tally] = []
        with self.lock:
            for item in items:
                tally = self.tallies.get((budget, item))
                if tally is None:  # a window opens here, or this worker first counts in it
                    tally = Tally(budget, item, now + item.get_expiry())
                    self.tallies[tally.key] = tally
                tally.mine += 1
                counted.append(tally)
                if tally.count > item.amount:
                    break
        if self.redis is not None and time.monotonic() >= self.next_sync:
            self.sync()
        shown = None
        for tally in counted:
            count, amount = tally.count, tally.limit.amount
            window = Window(tally.limit, max(0, amount - count), tally.end, count > amount)
            if window.exceeded:
                return window
            shown = shown or window
        return shown

    def exceeded(self, budget: str, limit: str | None) -> Window | None:
        """Return the first of the budget's windows whose limit its count has reached, without
        counting this request: the next hit there would be over. None when limiting is off or
        each window has room.

        On the counts as this worker last knew them, with no sync: a sync here, before a
        count() that opens a window, would leave that window unsynced until the next one."""
        if not self.enabled:
            return None
        with self.lock:
            for item in self.items(limit):
                tally = self.tallies.get((budget, item))
                if tally is not None and tally.count >= item.amount:
                    return Window(item, 0, tally.end, True)
        return None

    def items(self, limit: str | None) -> list[RateLimitItem]:
        text = limit or self.default
        items = self.parsed.get(text)
        if items is None:
            items = self.parsed[text] = sorted(parse_many(text))
        return items

    def sync(self) -> None:
        """Write this worker's counts to Redis and read back the totals and the windows' ends,
        also of the windows past half their limit, where the other workers' hits soon matter;
        with none, only ask whether Redis answers. While another thread syncs: nothing."""
        # Only a limiter with a Redis syncs (count() and state() check).
        assert self.redis is not None
        if not self.sync_lock.acquire(blocking=False):
            return
        try:
            started = time.monotonic()
            self.next_sync = started + self.sync_interval
            if self.pid != os.getpid():  # a process of its own, after a fork
                self.pid = os.getpid()
                self.worker = f"{socket.gethostname()}:{self.pid}:{secrets.token_hex(4)}"
            with self.lock:
                batch = [
                    (tally, tally.mine, tally.mine > tally.synced)
                    for tally in self.tallies.values()
                    if tally.mine > tally.synced or 2 * tally.count >= tally.limit.amount
                ]
            if self.sentinel_pool is not None and started >= self.next_master_check:
                self.follow_master(started)
            try:
                if batch:
                    answers = self.ask(batch)
                else:  # nothing to tell: only whether Redis answers (ping raises if not)
                    self.redis.ping()
                    answers = []
            except redis.RedisError as error:
                self.lost_contact(error, started)
                return
            now = time.time()
            with self.lock:
                for (tally, mine, _), (total, ttl_ms) in zip(batch, answers, strict=True):
                    current = self.tallies.get(tally.key) is tally
                    if ttl_ms < 0 and current:  # the window ended everywhere: so it does here
                        del self.tallies[tally.key]
                    tally.synced, tally.others = mine, max(0, total - mine)
                    if ttl_ms >= 0 and current:
                        tally.end = now + ttl_ms / 1000
                        self.tallies[tally.key] = tally  # its expiry moves with its end
            self.made_contact()
        finally:
            self.sync_lock.release()

    def follow_master(self, now: float) -> None:
        """Ask the Sentinels which Redis is master; when another than this worker's connection
        goes to, redis-py closes it, and this sync connects to the new one."""
        assert self.sentinel_pool is not None
        self.next_master_check = now + MASTER_CHECK_INTERVAL
        # No Sentinel answers, or none names a master that is up: the connection's Redis may
        # still answer, and the sync tells.
        with contextlib.suppress(redis.RedisError):
            self.sentinel_pool.get_master_address()

    def ask(self, batch: list[tuple[Tally, int, bool]]) -> list[list[int]]:
        args: list[str | int] = [self.worker]
        for tally, mine, news in batch:
            args += (mine if news else 0, tally.limit.get_expiry() * 1000)
        totals: list[list[int]] = self.script(
            keys=[tally.storage_key for tally, _, _ in batch], args=args
        )
        return totals

    def made_contact(self) -> None:
        self.last_contact = time.monotonic()
        self.retry_in = self.retry_interval
        assert self.redis is not None  # contact is made by a sync, with a Redis
        self.counts_in(storage_address(self.redis))
        if self.degraded_since is not None:
            DEGRADED_SECONDS.inc(self.last_contact - self.degraded_since)
            self.degraded_since = None
            self.logger.warning("Rate limit storage answers again: counts are shared.")

    def lost_contact(self, error: Exception, started: float) -> None:
        # The breaker opens: no request tries Redis again before the retry interval has passed,
        # which doubles with each failure up to MAX_RETRY_INTERVAL, so a Redis that stays hung
        # costs a worker ever less, and one that answers again is found within that.
        now = time.monotonic()
        self.next_sync = now + self.retry_in
        self.retry_in = min(2 * self.retry_in, self.max_retry_in)
        self.counts_in(None)
        if self.degraded_since is None:
            self.logger.error(
                "Rate limit storage failed; each worker counts alone until it answers: %s", error
            )
            self.degraded_since = started
        DEGRADED_SECONDS.inc(now - self.degraded_since)
        self.degraded_since = now

    def counts_in(self, address: str | None) -> None:
        """Say in STORAGE which Redis this worker counts in: a change at a failover, at a loss
        of contact and at its end, else nothing (a sync's cost is a comparison)."""
        if address == self.storage_address:
            return
        if self.storage_address is not None:
            STORAGE.labels(self.storage_address).set(0)
        if address is not None:
            STORAGE.labels(address).set(1)
        self.storage_address = address

    def state(self) -> str:
        """Say how the limits are counted now: shared, per process, storage unreachable or off;
        asking Redis (within its socket timeout) only when no sync has told it lately."""
        if not self.enabled:
            return OFF
        if self.redis is None:
            return PER_PROCESS
        now = time.monotonic()
        if self.degraded_since is not None:
            if now >= self.next_sync:  # the breaker's next try, due: an idle worker's too
                self.sync()
        elif self.last_contact is None or now - self.last_contact >= HEALTH_INTERVAL:
            self.sync()
        return UNREACHABLE if self.degraded_since is not None else SHARED


def storage_client(uri: str, options: dict[str, Any]) -> redis.Redis:
    """Make the client of RATELIMIT_STORAGE_URI: one Redis, or the master Redis Sentinels name.

    It connects on first use, in the worker: a Redis or Sentinels that are down never stop the
    boot. No retries of redis-py's own (by default 3, backing off up to 10 s): the breaker is the
    retry, and theirs would multiply the wait of a request.

    Through Sentinels, every connection the pool opens asks them for the master first (the one
    that answered first asked next time), and a connection whose Redis fails or turns replica
    (Sentinel kills its clients on a failover; a write to a replica is refused) is closed: the
    breaker's next try asks the Sentinels again. The options (timeouts) hold for the Sentinels
    and the master alike, so a hung Sentinel costs a try its socket timeout, as a hung master
    does. A connection that lives, lives on the master: the request path is the same as with
    one Redis."""
    no_retries = Retry(NoBackoff(), 0)
    if not uri.startswith(SENTINEL_SCHEME + "://"):
        return redis.Redis.from_url(uri, retry=no_retries, **options)
    where = parse_sentinel_uri(uri)
    # The URL's password is the Sentinels' and the Redis', as `limits` has it.
    options = {"username": where.username, "password": where.password, **options}
    # redis-py's Sentinel is untyped.
    sentinels = Sentinel(where.sentinels, sentinel_kwargs={**options, "retry": no_retries})
    master: redis.Redis = sentinels.master_for(
        where.service_name, db=where.db, retry=no_retries, **options
    )
    return master


def storage_address(client: redis.Redis) -> str:
    """The address of the Redis a client's connections go to: the master the Sentinels last
    named, else the URL's host and port or socket path."""
    pool = client.connection_pool
    host, port = getattr(pool, "master_address", None) or (
        pool.connection_kwargs.get("host"),
        pool.connection_kwargs.get("port"),
    )
    if host is None:
        return str(pool.connection_kwargs.get("path"))
    return f"{host}:{port}"


def window_end(_key: tuple[str, RateLimitItem], tally: Tally, _now: float) -> float:
    return tally.end


def count_request(limiter: RateLimiter, budget: str, limit: str | None) -> Window | None:
    """Count the request; over the limit, answer 429 with the window's headers."""
    window = limiter.count(budget, limit)
    if window is not None and window.exceeded:
        REFUSALS.labels("rate_limit").inc()
        raise errors.TOO_MANY_REQUESTS(limit=str(window.limit), headers=window.headers())
    return window


def init_rate_limits(app: Flask) -> RateLimiter:
    """Make the app's limiter: one per app, as each app has its own storage."""
    # Each reason's series from 0, so a rate() over it reads 0 before the first refusal rather
    # than nothing, and sees that first one.
    for reason in ("rate_limit", "auth_failures"):
        REFUSALS.labels(reason)
    limiter = app.extensions["animal_store_rate_limits"] = RateLimiter(settings(app), app.logger)
    return limiter


def counting(app: Flask) -> str:
    """Say how the limits are counted now: shared, per process, storage unreachable, or off."""
    limiter: RateLimiter = app.extensions["animal_store_rate_limits"]
    return limiter.state()


def warn_if_counted_apart(app: Flask, workers: int) -> None:
    """Say at a worker's boot that the configured limit cannot hold: its counts are its own."""
    limiter: RateLimiter = app.extensions["animal_store_rate_limits"]
    if workers > 1 and limiter.enabled and limiter.redis is None:
        app.logger.warning(
            "Rate limits are counted in each worker's memory (RATELIMIT_STORAGE_URI=memory://): "
            "with %d workers a key may make up to %d times its limit, and more with several "
            "instances. Point RATELIMIT_STORAGE_URI at a Redis that every worker shares.",
            workers,
            workers,
        )
