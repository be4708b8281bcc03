"""Version-controlled defaults; config/<env>.py, the environment and test_config override them."""

from datetime import UTC, datetime

# None means the embedded default: a SQLite file in the instance folder.
DATABASE_URL = None
SQLITE_FILENAME = "animal_store.sqlite3"

# Requests whose body is larger are answered 413 (config/nginx.conf allows the same).
MAX_CONTENT_LENGTH = 64 * 1024

# Seconds SQLite waits for another writer before giving up with "database is locked".
SQLITE_BUSY_TIMEOUT = 5.0

# pool_pre_ping: a pooled connection the database dropped (restart, failover) is replaced before
# use, so the service recovers from an outage by itself. (On PostgreSQL deadlines.py makes that
# check instead, within the request's deadline.)
SQLALCHEMY_ENGINE_OPTIONS = {"pool_pre_ping": True}

# PostgreSQL only: seconds after its start by which a request's database work is over, the
# database answering or not; then the request is answered 503 (animal_store/data/deadlines.py). Well
# under gunicorn's 30 s timeout, which nginx's proxy_read_timeout outlasts (docs/deploy.rst).
DATABASE_DEADLINE = 5
# The server's and libpq's own limits, none longer than the deadline, for the command line
# (which has no deadline) and for a server that is alive: seconds to open a connection (libpq
# connect_timeout; 2 is its minimum; a request waits only what its deadline has left), ...
DATABASE_CONNECT_TIMEOUT = 3
# ... seconds one statement may run before the server cancels it, keeping the connection: shorter
# than the deadline, so a slow statement on a live server is cancelled rather than cut, ...
DATABASE_STATEMENT_TIMEOUT = 4
# ... and seconds a request waits for a free pooled connection (only a threaded server ever
# waits: a sync worker serves one request at a time, with connections to spare).
DATABASE_POOL_TIMEOUT = 5
# Bytes of answers each worker keeps to send again (animal_store/data/answers.py): an animal's, a
# full page's; 0 keeps none.
ANSWER_CACHE_BYTES = 8 * 1024 * 1024
# PostgreSQL through PgBouncer in transaction pooling (config/pgbouncer.ini): no server-side
# prepared statements (psycopg makes them for a query run five times on one connection, and the
# next transaction may be on another server connection), and no statement timeout sent at
# connect, which PgBouncer cannot pass on: set it on the role (docs/deploy.rst).
DATABASE_BEHIND_PGBOUNCER = False
# PostgreSQL's streaming standbys that serve reads (listPets, getPet) when that is safe
# (animal_store/data/standbys.py); None: every read on the primary.
DATABASE_READ_URL = None
# Seconds of replay lag past which a standby serves no read.
DATABASE_READ_MAX_LAG = 10

# getPet is deprecated since v1.0.0 shipped and is removed on the contract's sunset date;
# listPets with the status filter replaces it. Drives the Deprecation, Sunset and Link headers.
GET_PET_DEPRECATION = {
    "since": datetime(2026, 11, 22, tzinfo=UTC),
    "sunset": datetime(2030, 12, 5, tzinfo=UTC),
    "successor": "/v1/pets",
}

# Each API key's last-used time is written at most this often, not on every request.
KEY_LAST_USED_RESOLUTION = 60
# Valid keys are cached per worker process this many seconds, so most requests are authenticated
# without a query; a revoked key therefore keeps working for at most this long (0: no cache).
KEY_CACHE_SECONDS = 5
# Keys each worker keeps in that cache at most; the least recently used are dropped first.
KEY_CACHE_SIZE = 1024

# The servers listed in the OpenAPI document, each ending in /v1. The contract leaves the addresses
# open: a deployment sets its own (ANIMAL_STORE_OPENAPI_SERVERS='[{"url": ...}]').
OPENAPI_SERVERS = [
    {"url": "https://api.animal-store.example/v1", "description": "Production"},
    {"url": "https://staging.api.animal-store.example/v1", "description": "Staging"},
]

# The deployment's own address, scheme and host (and port), such as "https://api.example.com":
# the links the service writes (Location, Link) are on it, whatever Host a request names. None:
# on the scheme and host the request reached, which only nginx checking the Host makes safe.
PUBLIC_URL = None

# Idempotency-Keys (POST /v1/pets) are remembered this many seconds (24 hours), then purged.
IDEMPOTENCY_TTL = 24 * 60 * 60
# Seconds after which a record claimed without an answer by a release before this one (which
# committed claims on their own) counts as dead and is taken over: longer than gunicorn's 30 s
# timeout, so its holder has been killed by then. Claims made now end with their transaction.
IDEMPOTENCY_LEASE = 60
# Share of requests with a key that also delete the expired keys (flask idempotency purge too).
IDEMPOTENCY_PURGE_CHANCE = 0.01

# /readyz gives PostgreSQL this many seconds to answer SELECT 1 (its own, shorter deadline), so
# the probe answers within half a second whatever hangs.
READYZ_TIMEOUT = 0.3
# When the database cannot be reached or written (any request, /readyz too), the 503 asks the
# client to retry after this many seconds.
DATABASE_RETRY_AFTER = 5

# A request that waited longer than this many seconds for a worker (from nginx's X-Request-Start)
# is answered 503 unserved by the worker that takes it (animal_store/http/shedding.py): well above
# the wait of a surge the workers hold (a p99 of 1.9 s at 4,096 clients on 2 workers, 3.3 s on
# shared cores: docs/deploy.rst, Overload), well below nginx's 35 s and the time most clients
# wait. 0 sheds nothing.
REQUEST_QUEUE_TIMEOUT = 10
# Seconds a client reaching gunicorn directly has for its whole request line and headers, from
# the connection (serving/worker.py), and then for its whole body: past either, it is answered
# 408 (a connection that sent nothing is closed), so a client that sends nothing, or a byte a
# second, holds a sync worker this long, not until gunicorn's timeout kills it (30 s). Well above
# what any network takes for a head (8 KiB at most) or a body (MAX_CONTENT_LENGTH, 64 KiB);
# behind nginx, which passes a request on only whole, they never pass. 0: no deadline.
REQUEST_HEADER_TIMEOUT = 5
REQUEST_BODY_TIMEOUT = 5

# Level of the JSON log lines on stdout; INFO includes one line per request.
LOG_LEVEL = "INFO"

# Seconds a worker counts its requests in memory before it writes them to the metrics' files
# (metrics.py): a scrape may miss at most this much of another worker's latest counts, and a
# worker killed outright loses that much. 0 writes every answer at once.
METRICS_WRITE_INTERVAL = 1.0

# The peer addresses of the proxies whose X-Forwarded-* headers are honoured (proxies.py): none by
# default, so a client that reaches the app directly cannot choose the host of the URLs it builds
# or the address it logs. config/production.py and staging.py name nginx on the same machine.
TRUSTED_PROXIES: list[str] = []
# Hops of X-Forwarded-* a trusted proxy's request holds: nginx adds exactly one.
TRUSTED_PROXY_HOPS = 1

# Requests per API key to the operations of /v1, in a fixed window; beyond it 429. A key may have
# its own (`flask keys set-limit NAME 100/second`). A minute's window lets a bulk client's burst
# through: 16 threads creating 1,600 animals with one key never reach it.
RATE_LIMIT = "6000 per minute"
# The RATELIMIT_* names are those Flask-Limiter, used before, read; rate_limits.py keeps them.
# False turns limiting off.
RATELIMIT_ENABLED = True
# Where the counts live. memory:// counts in each process: exact for the development server, but
# under gunicorn the effective limit is RATE_LIMIT x workers x instances (the workers warn at
# boot, /readyz says "per process"). redis://host:6379/0 shares one count among all of them; the
# production and staging settings use the machine's Redis. redis+sentinel://:password@host:26379,
# host:26379/service_name counts in the master Redis Sentinels name, and follows a failover.
RATELIMIT_STORAGE_URI = "memory://"
# Seconds between a worker's syncs of its counts with Redis (rate_limits.py), each made by the
# request that finds it due: a key may pass its limit by what it sends to a worker in this long
# (docs/operations.rst, Rate limits); 0 syncs on every request, exact at a round trip each.
RATELIMIT_SYNC_INTERVAL = 0.05
# While Redis does not answer, each worker counts alone and tries it again this often.
RATELIMIT_RETRY_INTERVAL = 1.0
# redis-py's options. A sync that waits longer for Redis fails, and the worker counts alone until
# its next try: the most a Redis that stops answering costs one request a retry interval. (Not
# redis-py's single_connection_client: it connects when the app is made, so a Redis that is down
# would stop the boot.)
RATELIMIT_STORAGE_OPTIONS = {"socket_connect_timeout": 0.1, "socket_timeout": 0.1}

# Failed key checks (no key, or a wrong, revoked or expired one) per client address, the one
# TRUSTED_PROXIES makes it, counted with the rate limits (RATELIMIT_*: shared through Redis); past
# it, the address's requests without a key the worker knows valid are answered 429 before any
# database look-up (auth_failures.py). No honest client fails 300 times a minute. None: off.
AUTH_FAILURE_LIMIT = "300 per minute"
# Addresses and networks whose failures are never limited, e.g. ["192.0.2.7", "10.0.0.0/8"]: a
# gateway many clients share. A malformed entry stops the boot.
AUTH_FAILURE_EXEMPT: list[str] = []
# Seconds a worker remembers a key its look-up did not find, refusing it again without a query;
# a key that became valid after it was tried is refused that long at most (0: never remembered).
KEY_MISS_CACHE_SECONDS = 5
# Such keys each worker remembers at most; the oldest are dropped first.
KEY_MISS_CACHE_SIZE = 4096

# Browsers: the origins whose pages may call the API (CORS, Flask-CORS's own settings), e.g.
# ANIMAL_STORE_CORS_ORIGINS='["https://shop.example"]'. Empty: no CORS headers at all.
CORS_ORIGINS: list[str] = []
# The methods a page may use are those of the /v1 routes (api/layer.py), not a setting.
# What a page may send (preflights ask for them) and read of the answers.
CORS_ALLOW_HEADERS = ["Authorization", "Content-Type", "Idempotency-Key", "If-None-Match"]
CORS_EXPOSE_HEADERS = [
    "Location",
    "Link",
    "ETag",
    "Deprecation",
    "Sunset",
    "Retry-After",
    "RateLimit-Limit",
    "RateLimit-Remaining",
    "RateLimit-Reset",
    "X-Request-ID",
    "Idempotent-Replayed",
]
# Seconds a browser may reuse a preflight's answer.
CORS_MAX_AGE = 600
# Only answers to a listed origin carry CORS headers.
CORS_ALWAYS_SEND = False
