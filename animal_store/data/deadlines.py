"""The database deadline: a request's PostgreSQL work ends within DATABASE_DEADLINE of its start,
whatever the server does, and the request is answered 503 `service_unavailable` then.

A server that hangs (its processes stopped, a stalled host, a partition) accepts and answers
nothing, and the usual limits do not end the wait: it never enforces its own statement_timeout,
the kernel of a live host still acknowledges every TCP segment so tcp_user_timeout and keepalives
never fire, and libpq's connect_timeout covers only connecting. So the client keeps its own:

- A watchdog thread per process knows each connection a request has checked out of the pool and
  the request's deadline. Past it, it shuts the connection's socket down: the call blocked on it
  fails at once with OperationalError, SQLAlchemy invalidates the connection, and the outage
  handler answers 503 (errors.handle_database_outage). The thread sleeps until the earliest
  deadline it knows: a healthy request costs it no wake-up.
- The pool's pre-ping runs before any pool event, out of reach of a deadline, so the ping is made
  here, in the checkout event, once the connection is watched (settings.py turns pool_pre_ping
  off on PostgreSQL).
- A connection opened for a request is waited for only as long as the deadline has left: libpq
  will not time out sooner than 2 s, so the attempt runs in a thread of its own and a late one is
  closed when it arrives.
- After a request ran past its deadline, the process sends no request to the database for
  RETRY_INTERVAL (Backoff): those are answered 503 at once instead of each waiting out its
  deadline while the requests queued behind it wait too. The next request after that tries again.

Outside a request (the command line, migrations) nothing is watched: a command's time is its
operator's, and the server's statement_timeout and libpq's connect_timeout still apply.
"""

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitTimedOut
from typing import TYPE_CHECKING, Any, cast

from flask import Flask, g, has_app_context
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from animal_store.extensions import db, settings

if TYPE_CHECKING:
    import psycopg

# Seconds after a deadline passed during which the process answers 503 without trying.
RETRY_INTERVAL = 1.0
# The share of a request's deadline the primary has where standbys may answer without it.
PRIMARY_SHARE = 0.3
# Threads opening connections for requests short of time, for each engine: an abandoned attempt
# holds one for at most DATABASE_CONNECT_TIMEOUT a host, and one engine's attempts at a host that
# hangs (a lost machine in DATABASE_READ_URL's list) must not hold up another's (DATABASE_URL's,
# to the primary promoted meanwhile: creations waited 23 s so in one run).
CONNECTING_THREADS = 4

LOG = logging.getLogger("animal_store.data.deadlines")


class DeadlinePassed(sa_exc.TimeoutError):
    """The request's database deadline passed, or a recent one did:
    database_faults.is_database_outage counts it as an outage (a TimeoutError, as the pool's
    own)."""


class Backoff:
    """An engine's last missed deadline: until RETRY_INTERVAL has passed, or a connection has
    answered, its requests are answered 503 without trying."""

    def __init__(self) -> None:
        self.missed_at: float | None = None

    def miss(self) -> None:
        self.missed_at = time.monotonic()

    def clear(self) -> None:
        self.missed_at = None

    def holds(self, now: float) -> bool:
        missed_at = self.missed_at
        return missed_at is not None and now - missed_at < RETRY_INTERVAL


class Watchdog:
    """The connections requests hold, each with its deadline, and the thread that cuts them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        # Connection record -> (DBAPI connection, deadline, the Backoff a miss counts toward:
        # None for a probe).
        self.held: dict[ConnectionPoolEntry, tuple[DBAPIConnection, float, Backoff | None]] = {}
        # When the thread wakes next; None: it sleeps until a connection is held.
        self.alarm: float | None = None
        self.thread: threading.Thread | None = None
        # Each engine's, gone with it (its idle threads end when the executor is collected).
        self.connecting: weakref.WeakKeyDictionary[Engine, ThreadPoolExecutor] = (
            weakref.WeakKeyDictionary()
        )

    def hold(
        self,
        record: ConnectionPoolEntry,
        connection: DBAPIConnection,
        deadline: float,
        backoff: Backoff | None,
    ) -> None:
        with self.lock:
            self.held[record] = (connection, deadline, backoff)
            if self.alarm is None or deadline < self.alarm:
                self.alarm = deadline
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self.watch, name="database-deadlines", daemon=True
                    )
                    self.thread.start()
                else:
                    self.wake.notify()

    def release(self, record: ConnectionPoolEntry) -> None:
        # Never wakes the thread: it finds the connection gone when its alarm rings.
        with self.lock:
            self.held.pop(record, None)

    def watch(self) -> None:
        with self.lock:
            while True:
                now = time.monotonic()
                for record, (connection, deadline, backoff) in list(self.held.items()):
                    if deadline <= now:
                        del self.held[record]
                        cut(connection)
                        if backoff is not None:
                            backoff.miss()
                        LOG.warning("Cut a database connection its request held past its deadline")
                if self.alarm is not None and self.alarm <= now:
                    self.alarm = min((entry[1] for entry in self.held.values()), default=None)
                self.wake.wait(None if self.alarm is None else self.alarm - now)

    def connect_within(
        self,
        engine: Engine,
        connect: Callable[[], DBAPIConnection],
        seconds: float,
        backoff: Backoff | None,
    ) -> DBAPIConnection:
        """Return connect()'s connection, or raise DeadlinePassed after `seconds`."""
        with self.lock:
            connecting = self.connecting.get(engine)
            if connecting is None:
                connecting = self.connecting[engine] = ThreadPoolExecutor(
                    CONNECTING_THREADS, "database-connect"
                )
        attempt = connecting.submit(connect)
        try:
            return attempt.result(timeout=seconds)
        except WaitTimedOut:
            if not attempt.cancel():
                attempt.add_done_callback(close_late_connection)
            if backoff is not None:
                backoff.miss()
            raise DeadlinePassed("No database connection within the request's deadline") from None


def cut(connection: DBAPIConnection) -> None:
    """Shut down the socket of a psycopg connection, from any thread.

    shutdown(), not close(): the descriptor stays libpq's, which notices the dead socket and fails
    the call it is blocked in, closing the descriptor itself. On a duplicate, so that closing our
    socket object leaves libpq's descriptor alone."""
    with contextlib.suppress(Exception):  # already closed, or broken some other way
        pgconn = cast("psycopg.Connection[Any]", connection).pgconn  # PostgreSQL's alone
        duplicate = socket.socket(fileno=os.dup(pgconn.socket))
        with duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)


def close_late_connection(attempt: Future[DBAPIConnection]) -> None:
    if attempt.exception() is None:
        with contextlib.suppress(Exception):
            attempt.result().close()


WATCHDOG = Watchdog()


def forget_after_fork() -> None:
    # A forked child has no threads but the one that forked, and the parent's connections are
    # not its to cut.
    global WATCHDOG
    WATCHDOG = Watchdog()


os.register_at_fork(after_in_child=forget_after_fork)


def request_deadline(
    backoff: Backoff, name: str = "database_deadline"
) -> tuple[float, Backoff | None] | None:
    """Return this request's deadline (in g under `name`) and the Backoff a miss counts toward
    (None for a probe); None outside a request. Raise DeadlinePassed when the request may not
    use the database."""
    if not has_app_context():
        return None
    deadline = g.get(name)
    if deadline is None:
        return None
    now = time.monotonic()
    if now >= deadline:
        raise DeadlinePassed("The request's database deadline has passed")
    if g.get("database_probe", False):
        # /readyz tries anyway, to tell the truth; its own deadline is short.
        return deadline, None
    if backoff.holds(now):
        raise DeadlinePassed("A request ran past its database deadline moments ago")
    return deadline, backoff


def shorten_deadline(seconds: float) -> None:
    """Give the rest of this request's database work at most `seconds`, as a probe: running past
    them makes no other request wait (/readyz)."""
    deadline = time.monotonic() + seconds
    g.database_deadline = min(g.get("database_deadline", deadline), deadline)
    g.database_probe = True


@contextlib.contextmanager
def primary_share() -> Iterator[None]:
    """Give the primary at most PRIMARY_SHARE of what is left of the request's deadline for what
    runs within, as a probe: where standbys can answer without it (without_primary.py), a hung
    primary costs the request that share, and the rest is theirs. A probe's miss holds back no
    other request (the Backoff): a creation, which has no standby to turn to, still waits its
    whole deadline for a primary, the one a host list reaches next included."""
    deadline = g.get("database_deadline")
    if deadline is None:
        yield
        return
    now = time.monotonic()
    probe = g.get("database_probe", False)
    g.database_deadline, g.database_probe = now + (deadline - now) * PRIMARY_SHARE, True
    try:
        yield
    finally:
        g.database_deadline, g.database_probe = deadline, probe


def time_left() -> float | None:
    """Return the seconds left of this request's database deadline, None where it has none."""
    deadline = g.get("database_deadline")
    return None if deadline is None else deadline - time.monotonic()


def init_deadlines(app: Flask) -> tuple[Callable[[], None], ...]:
    """Watch the app's PostgreSQL connections; return the steps that start each request's
    deadline (hooks.py): none on SQLite, which needs none (docs/operations.rst)."""
    with app.app_context():
        engine = db.engine
    if engine.dialect.name != "postgresql":
        return ()
    seconds = settings(app).DATABASE_DEADLINE
    watch_engine(engine)

    def start_deadline() -> None:
        g.database_deadline = time.monotonic() + seconds

    return (start_deadline,)


def watch_engine(engine: Engine, deadline: str = "database_deadline") -> Backoff:
    """Hold each connection of the engine that a request checks out to the request's deadline,
    in g under `deadline` (the standbys' engine has one of its own: standbys.py), and ping it on
    checkout; return the engine's Backoff."""
    dialect = engine.dialect
    backoff = Backoff()

    @event.listens_for(engine, "do_connect")
    def connect_within_deadline(
        _dialect: Dialect,
        record: ConnectionPoolEntry,
        cargs: tuple[Any, ...],
        cparams: dict[str, Any],
    ) -> DBAPIConnection | None:
        held = request_deadline(backoff, deadline)
        if held is None:
            return None  # SQLAlchemy connects, within libpq's connect_timeout
        # As long as the deadline lets it: libpq bounds each host it tries by connect_timeout,
        # and a host list (DATABASE_URL's) may need one host's time and then the next's (a host
        # that hangs first, the primary after it).
        left = held[0] - time.monotonic()
        connection = WATCHDOG.connect_within(
            engine, lambda: dialect.connect(*cargs, **cparams), left, held[1]
        )
        # Watched from now on: a new engine's first connection runs SQLAlchemy's first queries
        # (the server's version...) before the checkout event.
        WATCHDOG.hold(record, connection, *held)
        return connection

    @event.listens_for(engine, "connect")
    def fresh(_connection: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        record.info["fresh"] = True

    @event.listens_for(engine, "checkout")
    def watch_and_ping(
        connection: DBAPIConnection, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
    ) -> None:
        held = request_deadline(backoff, deadline)
        if held is not None:
            WATCHDOG.hold(record, connection, *held)
        if record.info.pop("fresh", False):
            backoff.clear()  # it has just answered
            return
        try:
            dialect.do_ping(connection)
        except dialect.loaded_dbapi.Error as error:
            # A connection the server dropped (restart, failover) or the watchdog cut: the pool
            # replaces it, within what is left of the deadline (do_connect above), and every
            # connection it held from before, as SQLAlchemy's own pre-ping does: those reach the
            # same lost or hung server, and each would cost a request its deadline to find out.
            raise sa_exc.InvalidatePoolError() from error
        backoff.clear()

    @event.listens_for(engine, "checkin")
    def unwatch(_connection: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        WATCHDOG.release(record)

    return backoff
