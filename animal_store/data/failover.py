"""The database changing under a running service: a failover, or PgBouncer pointed elsewhere.

Two things follow from it, both on PostgreSQL (docs/deploy.rst, High availability):

- A server that takes only reads (a hot standby, a primary demoted to one, a database with
  default_transaction_read_only) refuses a write with SQLSTATE 25006. That is an outage, not a
  bug: the request is answered 503 with Retry-After (errors.py), and its connection is marked
  disconnected, so SQLAlchemy drops it and every other connection the pool held then. The next
  request connects again, and with several hosts in DATABASE_URL and
  target_session_attrs=read-write, libpq skips to the one that takes writes.
- Each worker keeps what it read (answers.py's bodies, auth.py's valid keys, keyset.py's settled
  ids) and answers from them without asking the database. A standby promoted after the primary
  was lost may lack the last creations (asynchronous replication) and give their ids out again:
  what the worker kept would then contradict the database. So at most once a second, on a
  request of the API layer, each worker asks the database which server it is (when its
  postmaster started: another server, or one restarted, started at another time). When it is
  another, or cannot be told, the worker forgets all it kept before it answers. A worker thus
  answers from what it kept at most a second after its database stopped being the one it read
  them from.
"""

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from flask import Flask, current_app
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import Dialect, ExceptionContext
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import ConnectionPoolEntry

from animal_store.data.database_faults import is_read_only_refusal
from animal_store.data.deadlines import primary_share
from animal_store.data.keyset import TIMELINE
from animal_store.extensions import db, settings

# How long a worker answers from what it kept before it asks the database again who it is.
CONFIRM_EVERY = 1.0
# Seconds between two reads that ask a primary that failed: a hung primary costs a read
# PRIMARY_SHARE of its deadline (deadlines.py) that often, not each read.
RETRY_INTERVAL = 2.0
# With the server, its timeline (standbys.py reads only from standbys on it): 0 on a server in
# recovery, which has none of its own; and whether it commits synchronously (without_primary.py
# reads without it only then).
SERVER_QUERY = (
    f"SELECT pg_postmaster_start_time(), CASE WHEN pg_is_in_recovery() THEN 0 ELSE {TIMELINE} END, "
    "current_setting('synchronous_standby_names') <> ''"
)
SERVER = text(SERVER_QUERY)
STATE = "animal_store_failover"
# Where a connection's pool entry keeps the host and port it reached (emptied when it reconnects).
HOST = "animal_store_host"


class Server:
    """Which server this worker's memos came from, and when to ask again. Requests on several
    threads (the development server) may ask at once: both answers are the same server."""

    def __init__(self, memos: tuple[str, ...], standbys: bool) -> None:
        self.memos = memos
        # With standbys (DATABASE_READ_URL), which may answer reads without the primary: the
        # primary then has its share of a request's deadline (confirm_database), else all of it.
        self.standbys = standbys
        self.started: datetime | None = None
        # The primary's timeline when last asked (None before): kept while it does not answer.
        self.timeline: int | None = None
        # When this worker first saw the primary on that timeline (standbys.py: a standby left
        # on the timeline before serves reads for DATABASE_READ_MAX_LAG from then).
        self.timeline_seen_at = 0.0
        # The host and port the worker last reached the primary on, as libpq names them (one of
        # DATABASE_URL's hosts): kept while it does not answer (without_primary.py).
        self.host: str | None = None
        # The host a connection of the primary's last failed on once made (cut at a deadline,
        # dropped, or refusing writes), until a new connection reaches a primary there: a new
        # connection tries it last (primary_first).
        self.blamed: str | None = None
        # Whether the primary, when last asked, committed only once a standby had the commit
        # (synchronous_standby_names set): kept while it does not answer.
        self.synchronous = False
        # When the primary last failed a read that standbys could answer (without_primary.py);
        # None: it answered the last.
        self.failed_at: float | None = None
        self.ask_at = 0.0
        self.lock = threading.Lock()


def init_failover(app: Flask, memos: tuple[str, ...]) -> tuple[Callable[[], None], ...]:
    """On PostgreSQL: drop connections to a server that takes only reads, and return the step
    that confirms the database, for the API layer to run before its requests; on SQLite (one
    file) nothing.

    `memos` are what each worker keeps from the database, by their places in app.extensions:
    each is made again from the database on first use, so forgetting one is removing it.
    """
    with app.app_context():
        engine = db.engine
    if engine.dialect.name != "postgresql":
        return ()

    @event.listens_for(engine, "handle_error")
    def drop_read_only_connections(context: ExceptionContext) -> None:
        refused = context.sqlalchemy_exception
        if refused is not None and is_read_only_refusal(refused):
            context.is_disconnect = True

    server = app.extensions[STATE] = Server(memos, settings(app).DATABASE_READ_URL is not None)

    @event.listens_for(engine, "connect")
    def ask_a_new_connection(connection: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        # A new connection may reach another server (libpq's host list, after a failover): it is
        # known before the connection's first use, not up to CONFIRM_EVERY later. Behind
        # PgBouncer, whose connections outlive the servers behind it, confirm_database tells.
        cursor = connection.cursor()
        try:
            cursor.execute(SERVER_QUERY)
            said = cursor.fetchone()
        finally:
            cursor.close()
            connection.rollback()
        if said is not None:  # always: one row
            learn(app, server, *said)
            info = getattr(connection, "info", None)  # psycopg's: which of several hosts it is
            host = None if info is None else f"{info.host}:{info.port}"
            record.info[HOST] = host
            if said[1]:  # (a timeline: a primary's connection)
                server.failed_at = None  # it answers (without_primary.py)
                server.host = host
                if server.blamed == host:
                    server.blamed = None

    @event.listens_for(engine, "invalidate")
    def blame_its_host(
        _connection: DBAPIConnection, record: ConnectionPoolEntry, error: BaseException | None
    ) -> None:
        # A connection that failed once made (the watchdog cut it, the server dropped it or took
        # no write) says which host failed. A connection that could not be made within a deadline
        # says nothing of which: blaming the host last reached then put a promoted primary last,
        # behind a hung host no attempt got past within a read's share of the deadline, for as
        # long as the hung host stayed in the list (the stall of issue 56).
        if error is not None and record.info.get(HOST) is not None:
            server.blamed = record.info[HOST]

    hosts = listed_hosts(engine)
    if len(hosts) > 1:

        @event.listens_for(engine, "do_connect")
        def primary_first(
            _dialect: Dialect,
            _record: ConnectionPoolEntry,
            _cargs: tuple[Any, ...],
            cparams: dict[str, Any],
        ) -> None:
            # libpq tries DATABASE_URL's hosts in order, each for up to connect_timeout, and one
            # that hangs (its machine lost, or frozen) takes all of it: the host the worker last
            # reached the primary on goes first, the one a connection last failed on last, so
            # that a new connection reaches a promoted standby within the request's deadline.
            order = sorted(hosts, key=lambda host: rank(host, server))
            cparams["host"] = ",".join(name for name, _ in order)
            cparams["port"] = ",".join(port for _, port in order)

    return (confirm_database,)


def listed_hosts(engine: Engine) -> list[tuple[str, str]]:
    """DATABASE_URL's hosts and ports as libpq takes them: one pair for each of several hosts."""
    cparams = engine.dialect.create_connect_args(engine.url)[1]
    names = str(cparams.get("host", "")).split(",")
    ports = str(cparams.get("port", "")).split(",")
    if len(ports) == 1:
        ports *= len(names)  # one port for every host, or libpq's default for each
    return list(zip(names, ports, strict=True)) if len(ports) == len(names) else []


def rank(host: tuple[str, str], server: Server) -> int:
    """2 for the host a connection last failed on, 0 for the one the primary was last reached on,
    1 for the others (which keep their order: the sort is stable)."""
    name = f"{host[0]}:{host[1]}"
    if name == server.blamed:
        return 2
    return 0 if name == server.host else 1


def confirm_database() -> None:
    """Forget what this worker kept when its database is not the server it was read from, or
    cannot say which it is; asked at most once every CONFIRM_EVERY seconds."""
    server: Server = current_app.extensions[STATE]
    now = time.monotonic()
    if now < server.ask_at or not primary_due():
        return
    server.ask_at = now + CONFIRM_EVERY
    try:
        # A connection of its own, given back at once: the request's session stays out of any
        # transaction, which behind PgBouncer would hold a server connection for the request.
        # Where standbys may serve without the primary, a hung one holds the request no longer
        # than its share.
        bounded = primary_share() if server.standbys else contextlib.nullcontext()
        with bounded, db.engine.connect() as connection:
            started, timeline, synchronous = connection.execute(SERVER).one()
    except SQLAlchemyError:
        # The database does not answer: what it will hold when it does is unknown. The server
        # last seen stays known, so the one that answers next is told apart from it.
        forget(current_app, server)
        if server.standbys:
            primary_fails()
        return
    primary_answers()
    learn(current_app, server, started, timeline, synchronous)


def learn(app: Flask, server: Server, started: datetime, timeline: int, synchronous: bool) -> None:
    """Take what the database said of itself: forget what the worker kept if it is another
    server than the one it was kept from."""
    if timeline and timeline != server.timeline:
        server.timeline_seen_at = time.monotonic()
    server.timeline = timeline
    if timeline:
        server.synchronous = synchronous
    if started == server.started:
        return
    with server.lock:
        if started == server.started:
            return  # another thread of the worker saw it first
        if server.started is not None:
            app.logger.warning(
                "The database is another server than this worker read from (started %s, "
                "then %s): forgetting the answers, keys and ids it kept",
                server.started.isoformat(),
                started.isoformat(),
            )
        forget(app, server)
        server.started = started


def primary_timeline() -> int | None:
    """The timeline of the primary as this worker last asked it, None before (or on SQLite)."""
    server: Server | None = current_app.extensions.get(STATE)
    return None if server is None else server.timeline


def primary_timeline_age() -> float:
    """Seconds since this worker first saw the primary on the timeline it last saw it on."""
    server: Server = current_app.extensions[STATE]
    return time.monotonic() - server.timeline_seen_at


def primary_host() -> str | None:
    """The host and port this worker last reached the primary on, None before (or on SQLite)."""
    server: Server | None = current_app.extensions.get(STATE)
    return None if server is None else server.host


def primary_fails() -> None:
    """Note that the primary failed a read that standbys could answer: the worker reads on the
    standbys alone (without_primary.py) until the primary answers again, asked once every
    RETRY_INTERVAL (primary_due)."""
    server: Server | None = current_app.extensions.get(STATE)
    if server is not None:
        server.failed_at = time.monotonic()


def primary_answers() -> None:
    server: Server | None = current_app.extensions.get(STATE)
    if server is not None:
        server.failed_at = None


def primary_down() -> bool:
    """Whether the primary failed the last read it was asked (primary_fails)."""
    server: Server | None = current_app.extensions.get(STATE)
    return server is not None and server.failed_at is not None


def primary_due() -> bool:
    """Whether the primary is to be asked: it answered last, or RETRY_INTERVAL has passed since
    it failed."""
    server: Server | None = current_app.extensions.get(STATE)
    failed_at = None if server is None else server.failed_at
    return failed_at is None or time.monotonic() - failed_at >= RETRY_INTERVAL


def primary_synchronous() -> bool:
    """Whether the primary, when this worker last asked it, committed synchronously."""
    server: Server | None = current_app.extensions.get(STATE)
    return server is not None and server.synchronous


def forget(app: Flask, server: Server) -> None:
    for memo in server.memos:
        app.extensions.pop(memo, None)
