"""What each setting must be: its type, its constraint and its meaning, declared once.

The declarations are checked at boot against the merged settings (defaults, the deployment's
file, the environment, test_config), and docs/configuration.rst lists them as
settings_reference() renders them (tests/test_settings.py compares the two).
"""

import dataclasses
import ipaddress
import json
import re
import textwrap
from collections.abc import Callable
from datetime import datetime
from typing import Any, NotRequired, TypedDict
from urllib.parse import unquote, urlsplit

from limits import parse_many
from marshmallow import Schema, ValidationError, fields, validates_schema
from marshmallow.validate import Length, OneOf, Range, Regexp
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from animal_store.contract import BASE_PATH

# Databases the service runs on, by SQLAlchemy backend: the drivers it ships with.
DATABASE_DRIVERS = {"sqlite": {"pysqlite"}, "postgresql": {"psycopg"}, "postgres": {"psycopg"}}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Redis Sentinel in RATELIMIT_STORAGE_URI, as `limits` spells it (parse_sentinel_uri).
SENTINEL_SCHEME = "redis+sentinel"
# RFC 9110's token: the characters of a header name.
HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"


def expecting(field: fields.Field[Any], expected: str) -> fields.Field[Any]:
    """Say what the field accepts, in the words the boot error and the docs use."""
    field.metadata = {**field.metadata, "expected": expected}
    field.required = True
    return field


def integer(at_least: int) -> fields.Field[Any]:
    # strict: 1.5 and "5" are refused rather than rounded or parsed.
    return expecting(
        fields.Integer(strict=True, validate=Range(min=at_least)),
        f"an integer, at least {at_least}",
    )


def seconds(at_least: float | None = None, above: float | None = None) -> fields.Field[Any]:
    if above is not None:
        return expecting(
            fields.Float(validate=Range(min=above, min_inclusive=False)),
            f"a number of seconds above {above:g}",
        )
    return expecting(
        fields.Float(validate=Range(min=at_least)), f"a number of seconds, at least {at_least:g}"
    )


def share() -> fields.Field[Any]:
    return expecting(fields.Float(validate=Range(min=0, max=1)), "a number from 0 to 1")


def boolean() -> fields.Field[Any]:
    # Only JSON's true and false: the string "False" must not turn anything on.
    return expecting(fields.Boolean(truthy={True}, falsy={False}), "true or false")


def one_of(choices: tuple[str, ...]) -> fields.Field[Any]:
    return expecting(fields.String(validate=OneOf(choices)), "one of " + ", ".join(choices))


def options(of_what: str) -> fields.Field[Any]:
    return expecting(fields.Dict(keys=fields.String()), f"an object of {of_what}")


def validator(check: Callable[[Any], object], message: str) -> Callable[[Any], None]:
    """Turn a check that raises ValueError into a marshmallow validator."""

    def validate(value: Any) -> None:
        try:
            check(value)
        except (TypeError, ValueError) as error:
            raise ValidationError(message) from error

    return validate


def parse_database_url(url: str) -> URL:
    """Read a database URL, libpq's form with several hosts included.

    libpq and psycopg write the hosts a client tries in turn in the URL's host part,
    `postgresql://store@h1:5432,h2:5432/store?target_session_attrs=read-write`, which SQLAlchemy
    cannot read. SQLAlchemy writes them as query parameters, `postgresql://store@/store?host=
    h1:5432&host=h2:5432&...`, and hands them to psycopg as libpq's. Both mean the same here.
    """
    rest, _, query = url.partition("?")
    scheme, separator, authority = rest.partition("://")
    credentials, at, location = authority.rpartition("@")
    hosts, _, database = location.partition("/")
    if separator and "," in hosts:
        listed = "&".join(f"host={host}" for host in hosts.split(","))
        url = f"{scheme}://{credentials}{at}/{database}?{listed}{'&' if query else ''}{query}"
    return make_url(url)


def check_database_url(url: str) -> None:
    try:
        parsed = parse_database_url(url)
    except ArgumentError as error:
        raise ValueError(url) from error
    if unencoded_at(url):
        # SQLAlchemy reads such a URL (its password ends at the first @), but with another host.
        raise ValueError(url)
    drivers = DATABASE_DRIVERS.get(parsed.get_backend_name())
    if drivers is None or parsed.drivername.partition("+")[2] not in ("", *drivers):
        raise ValueError(url)
    # Several hosts are query parameters, which make_url does not check as it checks a host part:
    # the driver's own reading of them, as each connection will read them, refuses one it
    # cannot use (a port that is no number, an IPv6 address, a `port` given apart).
    if "host" in parsed.query:
        try:
            parsed.get_dialect()().create_connect_args(parsed)
        except (ArgumentError, ValueError) as error:
            raise ValueError(url) from error


def unencoded_at(url: str) -> bool:
    """Tell whether a URL's password holds an @ not written %40: more than one @ follows
    "://user:". SQLAlchemy ends the password at the first, and the rest of it becomes the host,
    shown in messages, or a port it cannot read."""
    credentials = url.partition("://")[2].rpartition("@")[0]
    _, colon, password = credentials.partition(":")
    return bool(colon) and "@" in password


@dataclasses.dataclass(frozen=True)
class SentinelURI:
    """Where the Sentinels are, and the master they watch, as RATELIMIT_STORAGE_URI names them."""

    sentinels: list[tuple[str, int]]
    service_name: str
    db: int
    username: str | None
    password: str | None


def parse_sentinel_uri(uri: str) -> SentinelURI:
    """Read `limits`' spelling of Redis Sentinel,
    `redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]`, or raise
    ValueError: every Sentinel with its port, a service name, a database number or none.

    Our own reading, not `limits`': it takes `service_name/0` for a service named `service_name0`.
    The password is the Redis' and the Sentinels' both, as `limits` has it."""
    scheme, separator, rest = uri.partition("://")
    if scheme != SENTINEL_SCHEME or not separator or "?" in rest or "#" in rest:
        raise ValueError("not a redis+sentinel:// URL")
    authority, _, path = rest.partition("/")
    credentials, at, hosts = authority.rpartition("@")
    user, colon, password = credentials.partition(":")
    sentinels = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("each Sentinel is host:port")
        sentinels.append((host, int(port)))
    service_name, _, db = path.partition("/")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", service_name):
        raise ValueError("no service name")
    if db and not db.isdigit():
        raise ValueError("the database is a number")
    return SentinelURI(
        sentinels,
        service_name,
        int(db or 0),
        unquote(user) or None if at else None,
        unquote(password) or None if at and colon else None,
    )


def check_redis_or_memory(uri: str) -> None:
    if uri.startswith(SENTINEL_SCHEME + "://"):
        parse_sentinel_uri(uri)
    elif uri != "memory://" and not uri.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(uri)


def check_server_url(url: str) -> None:
    if not url.endswith(BASE_PATH):
        raise ValueError(url)


def check_public_url(url: str) -> None:
    parts = urlsplit(url)
    # An origin only: the links' paths are the app's own (its root path included).
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.password is not None
        or parts.path
        or parts.query
        or parts.fragment
        or url != f"{parts.scheme}://{parts.netloc}"
    ):
        raise ValueError(url)
    _ = parts.port  # ValueError for a port that is no number or out of range


def rate_limit(off: bool = False) -> fields.Field[Any]:
    expected = 'a rate limit such as "100/second" or "6000 per minute"'
    return expecting(
        fields.String(allow_none=off, validate=validator(parse_many, "Not a rate limit.")),
        expected + (", or null (off)" if off else ""),
    )


def strings(item: fields.Field[Any], expected: str) -> fields.Field[Any]:
    return expecting(fields.List(item), expected)


class ServerSchema(Schema):
    url = fields.String(
        required=True,
        validate=validator(check_server_url, f"Must end with {BASE_PATH}."),
    )
    description = fields.String()


class DeprecationSchema(Schema):
    since = fields.AwareDateTime(required=True)
    sunset = fields.AwareDateTime(required=True)
    successor = fields.String(required=True, validate=Regexp(r"^/"))

    @validates_schema
    def sunset_after_since(self, data: dict[str, Any], **_kwargs: Any) -> None:
        if data["sunset"] <= data["since"]:
            raise ValidationError("The sunset must come after the deprecation.")


class Server(TypedDict):
    url: str
    description: NotRequired[str]


class Deprecation(TypedDict):
    since: datetime
    sunset: datetime
    successor: str


def setting(field: fields.Field[Any], meaning: str) -> Any:
    """Declare a setting: the field that loads and checks its value, and its meaning in the docs
    (reStructuredText)."""
    return dataclasses.field(metadata={"field": field, "meaning": meaning})


@dataclasses.dataclass(frozen=True)
class Settings:
    """The service's settings, checked, with their types."""

    DATABASE_URL: str | None = setting(
        expecting(
            fields.String(
                allow_none=True,
                validate=validator(check_database_url, "Not a database URL."),
            ),
            "a database URL such as postgresql://user:password@host:5432/name or "
            "sqlite:////absolute/path, or null (SQLite in the instance folder)",
        ),
        "SQLAlchemy URL of the database; ``postgresql://...`` uses psycopg 3. Several PostgreSQL "
        "hosts, tried in turn, in libpq's form (``postgresql://user:password@h1:5432,h2:5432/"
        "name?target_session_attrs=read-write``) or SQLAlchemy's (``...@/name?host=h1:5432&"
        "host=h2:5432&...``) (`High availability <deploy.rst#high-availability>`__). ``null``: "
        "SQLite in ``instance/`` (development). Usually set as ``DATABASE_URL`` (`Environment "
        "variables`_)",
    )
    SQLITE_FILENAME: str = setting(
        expecting(
            fields.String(validate=Regexp(r"^(/.+|[^/\\]+)$")),
            "a file name in the instance folder, or an absolute path",
        ),
        "The SQLite file when ``DATABASE_URL`` is ``null``: a name in ``instance/``, or an "
        "absolute path",
    )
    MAX_CONTENT_LENGTH: int = setting(
        integer(at_least=1), "Largest request body in bytes (413 beyond)"
    )
    SQLITE_BUSY_TIMEOUT: float = setting(
        seconds(at_least=0), "Seconds a SQLite writer waits for another"
    )
    SQLALCHEMY_ENGINE_OPTIONS: dict[str, Any] = setting(
        options("SQLAlchemy create_engine() options"),
        "SQLAlchemy's engine options (PostgreSQL's time limits are added to them)",
    )
    DATABASE_DEADLINE: float = setting(
        seconds(above=0),
        "PostgreSQL: seconds after a request's start by which its database work is over, the "
        "server answering or not (then 503); well under gunicorn's ``timeout`` (`Deploy "
        "<deploy.rst>`__, Timeouts: a ladder)",
    )
    DATABASE_CONNECT_TIMEOUT: int = setting(
        integer(at_least=2),
        "PostgreSQL: seconds to open a connection (libpq ``connect_timeout``, a whole number, "
        "at least 2); a request waits only what its deadline has left",
    )
    DATABASE_STATEMENT_TIMEOUT: float = setting(
        seconds(above=0),
        "PostgreSQL: seconds a statement may run (``statement_timeout``) before a live server "
        "cancels it (503); under the deadline",
    )
    DATABASE_POOL_TIMEOUT: float = setting(
        seconds(above=0),
        "PostgreSQL: seconds to wait for a pooled connection (threaded servers only); at most "
        "the deadline",
    )
    ANSWER_CACHE_BYTES: int = setting(
        integer(at_least=0),
        "Bytes of unchanging answers (an animal's, a full page's) each worker keeps to send "
        "again; 0: none (`API <api.rst>`__, Conditional requests)",
    )
    DATABASE_BEHIND_PGBOUNCER: bool = setting(
        boolean(),
        "True when ``DATABASE_URL`` is PgBouncer in transaction pooling: no prepared "
        "statements, no timeout sent at connect (`Deploy <deploy.rst>`__)",
    )
    DATABASE_READ_URL: str | None = setting(
        expecting(
            fields.String(
                allow_none=True,
                validate=validator(check_database_url, "Not a database URL."),
            ),
            "a PostgreSQL URL, spelled as DATABASE_URL is, or null (every read on the primary)",
        ),
        "PostgreSQL: the streaming standbys that serve listPets and getPet whenever that is "
        "safe, the primary serving the rest: one host, libpq's host list (with "
        "``target_session_attrs=standby`` and ``load_balance_hosts=random``) or HAProxy's "
        "replica port; its role needs ``pg_read_all_stats``, to see whether a standby streams. "
        "``null``: every read on the primary. Usually set as ``DATABASE_READ_URL`` "
        "(`Reads on the standbys <deploy.rst#reads-on-the-standbys>`__)",
    )
    DATABASE_READ_MAX_LAG: float = setting(
        seconds(above=0),
        "PostgreSQL: seconds behind its primary past which a standby serves no read (its "
        "replay's lag: the age of the last transaction it replayed, 0 while it streams and has "
        "replayed all it received); and after a failover, how long the standby left behind may "
        "serve reads before it follows the new primary, counted from when a worker first "
        "reaches it",
    )
    GET_PET_DEPRECATION: Deprecation = setting(
        expecting(
            fields.Nested(DeprecationSchema),
            'an object {"since": date-time, "sunset": a later date-time, "successor": "/path"}, '
            "the date-times in ISO 8601 with their offset",
        ),
        "The deprecation of getPet: the dates and successor in its ``Deprecation``, ``Sunset`` and "
        "``Link`` headers and in the OpenAPI document",
    )
    KEY_LAST_USED_RESOLUTION: float = setting(
        seconds(at_least=0), "Seconds between writes of a key's last-used time"
    )
    KEY_CACHE_SECONDS: float = setting(
        seconds(at_least=0),
        "Seconds a worker trusts a cached valid key: the longest a revoked key keeps working "
        "(0: no cache)",
    )
    KEY_CACHE_SIZE: int = setting(
        integer(at_least=0), "Keys each worker caches at most (LRU; 0: no cache)"
    )
    OPENAPI_SERVERS: list[Server] = setting(
        expecting(
            fields.List(fields.Nested(ServerSchema), validate=Length(min=1)),
            'a list of at least one server {"url": "https://host/v1", "description": "..."}, '
            f"each URL ending in {BASE_PATH}",
        ),
        "The OpenAPI document's servers: where this deployment answers (`API <api.rst>`__)",
    )
    PUBLIC_URL: str | None = setting(
        expecting(
            fields.String(
                allow_none=True,
                validate=validator(check_public_url, "Not an http(s) origin."),
            ),
            "an origin, scheme and host with an optional port and no path, such as "
            '"https://api.example.com", or null',
        ),
        "The deployment's own address: ``Location`` (createPet) and ``Link`` (listPets' pages) "
        "are written on it, whatever ``Host`` a request names. ``null``: on the scheme and host "
        "the request reached (`Deploy <deploy.rst>`__, Links and the Host header)",
    )
    IDEMPOTENCY_TTL: float = setting(
        seconds(above=0), "Seconds an ``Idempotency-Key`` is remembered"
    )
    IDEMPOTENCY_LEASE: float = setting(
        seconds(above=0),
        "Seconds before a key claimed without an answer by a release before this one can be "
        "taken over (today's claims end with their request's transaction)",
    )
    IDEMPOTENCY_PURGE_CHANCE: float = setting(
        share(), "Share of keyed requests that also purge expired keys"
    )
    READYZ_TIMEOUT: float = setting(
        seconds(above=0),
        "Seconds PostgreSQL gets to answer ``/readyz``'s probe, its commit included: the probe's "
        "own deadline (its commit waits for a synchronous standby half of what is left)",
    )
    DATABASE_RETRY_AFTER: int = setting(
        integer(at_least=0),
        "``Retry-After`` seconds on the 503 of a database outage, ``/readyz``'s included",
    )
    REQUEST_QUEUE_TIMEOUT: float = setting(
        seconds(at_least=0),
        "Seconds a request may wait for a worker (nginx's ``X-Request-Start``) before it is "
        "answered 503 unserved, by the worker that takes it (`Deploy <deploy.rst>`__, Overload); "
        "0: never",
    )
    REQUEST_HEADER_TIMEOUT: float = setting(
        seconds(at_least=0),
        "Seconds a client has under gunicorn for its whole request line and headers, from the "
        "connection, before it is answered 408 ``request_timeout`` (a connection that sent "
        "nothing is closed without an answer); 0: no bound but gunicorn's ``timeout``",
    )
    REQUEST_BODY_TIMEOUT: float = setting(
        seconds(at_least=0),
        "Seconds a client has under gunicorn for its whole body, from the end of its headers, "
        "before the request is answered 408 ``request_timeout``; 0: no bound but gunicorn's "
        "``timeout``",
    )
    LOG_LEVEL: str = setting(
        one_of(LOG_LEVELS),
        "Level of the JSON log lines; ``INFO`` includes one line per request, ``WARNING`` drops "
        "them",
    )
    METRICS_WRITE_INTERVAL: float = setting(
        seconds(at_least=0),
        "Seconds a worker counts its requests in memory before writing them where a scrape "
        "reads them (the worker answering a scrape writes its own first); 0: every answer at "
        "once",
    )
    TRUSTED_PROXIES: list[str] = setting(
        strings(
            fields.String(validate=validator(ipaddress.ip_address, "Not an IP address.")),
            'a list of IP addresses, such as ["127.0.0.1", "::1"]',
        ),
        "Peer addresses of the proxies whose ``X-Forwarded-*`` headers count; none by default, "
        "nginx on the machine (``127.0.0.1``, ``::1``) in ``config/production.py`` and "
        "``staging.py``",
    )
    TRUSTED_PROXY_HOPS: int = setting(
        integer(at_least=1), "Hops of ``X-Forwarded-*`` a trusted proxy sends"
    )
    RATE_LIMIT: str = setting(
        rate_limit(),
        "Requests per API key to the operations of /v1, fixed window, for keys without their "
        "own (``keys set-limit``)",
    )
    RATELIMIT_ENABLED: bool = setting(boolean(), "False turns rate limiting off")
    RATELIMIT_STORAGE_URI: str = setting(
        expecting(
            fields.String(validate=validator(check_redis_or_memory, "Not a storage URI.")),
            "memory://, a Redis URL (redis://host:6379/0, rediss://..., unix:///path) or "
            "Redis Sentinels (redis+sentinel://:password@host:26379,host:26379/service_name"
            "[/db])",
        ),
        "Where counts live; ``redis://host:6379/0`` shares them among workers and instances "
        "(production and staging: the machine's Redis); ``redis+sentinel://...`` counts in the "
        "master the Sentinels name, and follows a failover (`High availability <deploy.rst"
        "#redis-sentinel>`__); ``memory://`` counts per process (workers warn at boot)",
    )
    RATELIMIT_SYNC_INTERVAL: float = setting(
        seconds(at_least=0),
        "Seconds between a worker's syncs of its counts with Redis, each made by the request "
        "that finds it due: a key may pass its limit by what it sends in that time; 0: exact, a "
        "round trip per request",
    )
    RATELIMIT_RETRY_INTERVAL: float = setting(
        seconds(above=0),
        "Seconds between a worker's tries while Redis does not answer (it counts alone meanwhile)",
    )
    RATELIMIT_STORAGE_OPTIONS: dict[str, Any] = setting(
        options("redis-py connection options"),
        "Options of redis-py, the Redis client: its socket timeouts are the most a sync waits "
        "for a stuck Redis before the worker counts alone",
    )
    AUTH_FAILURE_LIMIT: str | None = setting(
        rate_limit(off=True),
        "Failed key checks per client address (fixed window, counted with the rate limits); "
        "past it the address's requests without a key the worker knows valid get 429 before "
        "any look-up; ``null``: off (`Operations <operations.rst>`__, Rate limits)",
    )
    AUTH_FAILURE_EXEMPT: list[str] = setting(
        strings(
            fields.String(
                validate=validator(
                    lambda entry: ipaddress.ip_network(entry, strict=False),
                    "Not an IP address or network.",
                )
            ),
            'a list of IP addresses and networks, such as ["192.0.2.7", "10.0.0.0/8"]',
        ),
        "Addresses and networks whose failed key checks are never limited (a gateway many "
        "clients share)",
    )
    KEY_MISS_CACHE_SECONDS: float = setting(
        seconds(at_least=0),
        "Seconds a worker remembers a key its look-up did not find, refusing it again without "
        "a query (0: never)",
    )
    KEY_MISS_CACHE_SIZE: int = setting(
        integer(at_least=0), "Such keys each worker remembers at most (0: none)"
    )
    CORS_ORIGINS: list[str] = setting(
        strings(
            fields.String(validate=Length(min=1)),
            'a list of origins, such as ["https://shop.example"]',
        ),
        "Origins whose pages may call the API from a browser, with every method the /v1 routes "
        "allow; empty: no CORS headers at all",
    )
    CORS_ALLOW_HEADERS: list[str] = setting(
        strings(fields.String(validate=Regexp(HEADER_NAME)), "a list of header names"),
        "Headers a page may send (preflights ask for them)",
    )
    CORS_EXPOSE_HEADERS: list[str] = setting(
        strings(fields.String(validate=Regexp(HEADER_NAME)), "a list of header names"),
        "Headers of the answers a page may read",
    )
    CORS_MAX_AGE: int = setting(
        integer(at_least=0), "Seconds a browser may reuse a preflight's answer"
    )
    CORS_ALWAYS_SEND: bool = setting(
        boolean(), "False: only answers to a listed origin carry CORS headers"
    )


SETTING_FIELDS = {field.name: field.metadata["field"] for field in dataclasses.fields(Settings)}
SettingsSchema = Schema.from_dict(SETTING_FIELDS, name="SettingsSchema")
# Longer defaults are left to the file: a line of JSON that long helps no one.
LONGEST_DEFAULT_SHOWN = 60


def load(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return the settings loaded (their values converted, e.g. date-times parsed) and the
    problems by setting name: marshmallow's messages."""
    try:
        return SettingsSchema().load(values), {}
    except ValidationError as error:
        return {}, error.messages_dict


def expected(name: str) -> str:
    said: str = SETTING_FIELDS[name].metadata["expected"]
    return said


def shown_default(name: str, value: Any) -> str:
    dumped = json.dumps(SETTING_FIELDS[name].serialize(name, {name: value}))
    if len(dumped) > LONGEST_DEFAULT_SHOWN:
        return "see ``animal_store/default_settings.py``"
    return f"``{dumped}``"


def settings_reference(defaults: dict[str, Any]) -> str:
    """Render the settings for docs/configuration.rst: name, meaning, what is expected and the
    default, as the environment would give it."""
    entries = []
    for field in dataclasses.fields(Settings):
        meaning = field.metadata["meaning"]
        paragraphs = (
            f"{meaning}.",
            f"Expected: {expected(field.name)}.",
            # A paragraph of its own, so a short default is never split across lines.
            f"Default: {shown_default(field.name, defaults[field.name])}.",
        )
        wrapped = (
            textwrap.fill(
                paragraph,
                width=100,
                initial_indent="    ",
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
            for paragraph in paragraphs
        )
        entries.append(f"``{field.name}``\n" + "\n\n".join(wrapped) + "\n")
    return "\n".join(entries)
