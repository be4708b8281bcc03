"""Each API key's floor: where the primary's WAL stood once its last creation was acknowledged, so
that its reads on a standby see what it wrote (standbys.py), through any instance.

A creation reads the primary's WAL insert position on its own connection once it has committed:
the commit record lies below it. The floor is raised to it in Redis (the rate limits' Redis,
RATELIMIT_STORAGE_URI), by a script that keeps the higher of the two: two creations of one key
racing, each through its own instance, leave the higher position, whichever writes last, and no
read ever lowers or deletes a floor (nothing "unsticks", so no write can slip between a check and
an unsticking). A floor lives FLOOR_DAYS after the key's last creation: one small string a key.

Redis that does not answer never fails a request. A read that cannot learn its key's floor goes to
the primary ("no floor known"); a creation whose floor cannot be written keeps it here, as the
process's own floor for the key (its own reads use it), and writes it at the next contact. Until
then another instance, which cannot know it, may read that key's creation on a standby that has
not replayed it: the one gap, as long as this process cannot reach a Redis another one can
(docs/deploy.rst, Reads on the standbys). After a failure the process leaves Redis alone for
RATELIMIT_RETRY_INTERVAL, so a hung Redis costs one request its socket timeout, not all of them.
"""

import threading
import time

import redis
from cachetools import LRUCache
from flask import Flask
from redis.backoff import NoBackoff
from redis.retry import Retry

from animal_store.extensions import settings

KEY_PREFIX = "animal-store:floor:"
FLOOR_DAYS = 7
# Keys whose floor a process keeps itself (its own creations'), the least recently used dropped
# first: a dropped one is still in Redis.
OWN_FLOORS = 100_000
# Raise KEYS[1] to ARGV[1] (a position in bytes), never lower it; the lifetime starts again.
# Lua's numbers are doubles: positions are exact up to 2**53 bytes of WAL (8 PiB).
RAISE = """
local floor = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > floor then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 1
"""


class Floors:
    """The floors as this process knows them: shared in Redis, and its own creations'."""

    def __init__(self, app: Flask) -> None:
        config = settings(app)
        # No retries of redis-py's own: the pause after a failure is the retry (rate_limits.py).
        self.redis = redis.Redis.from_url(
            config.RATELIMIT_STORAGE_URI,
            retry=Retry(NoBackoff(), 0),
            **config.RATELIMIT_STORAGE_OPTIONS,
        )
        self.raise_script = self.redis.register_script(RAISE)
        self.retry_interval = float(config.RATELIMIT_RETRY_INTERVAL)
        self.own: LRUCache[str, int] = LRUCache(OWN_FLOORS)
        # Floors this process could not write to Redis yet.
        self.unwritten: dict[str, int] = {}
        self.paused_until = 0.0
        self.lock = threading.Lock()

    def raise_floor(self, key: str, position: int) -> None:
        """Raise the key's floor to `position`, here and in Redis (later, if it does not
        answer)."""
        with self.lock:
            self.own[key] = max(position, self.own.get(key, 0))
        if time.monotonic() >= self.paused_until:
            try:
                self.write(key, position)
                return
            except redis.RedisError:
                self.pause()
        with self.lock:
            self.unwritten[key] = max(position, self.unwritten.get(key, 0))

    def floor(self, key: str) -> int | None:
        """Return the key's floor (0: none), or None when Redis does not answer."""
        if time.monotonic() < self.paused_until:
            return None
        try:
            self.write_unwritten()
            shared = self.redis.get(KEY_PREFIX + key)
        except redis.RedisError:
            self.pause()
            return None
        with self.lock:
            own = self.own.get(key, 0)
        return max(int(shared or 0), own)

    def write(self, key: str, position: int) -> None:
        self.raise_script(keys=[KEY_PREFIX + key], args=[position, FLOOR_DAYS * 86_400])

    def write_unwritten(self) -> None:
        while self.unwritten:
            with self.lock:
                if not self.unwritten:
                    return
                key, position = self.unwritten.popitem()
            try:
                self.write(key, position)
            except redis.RedisError:
                with self.lock:
                    self.unwritten[key] = max(position, self.unwritten.get(key, 0))
                raise

    def pause(self) -> None:
        self.paused_until = time.monotonic() + self.retry_interval

    def close(self) -> None:
        self.redis.close()
