"""What the database's refusals mean, and what a worker remembers of them: a login it refuses (a
configuration error) and a disk with no space left for writes, which need an operator, and the
outages that pass by themselves: a database that cannot be reached (or written, on SQLite), and
one that takes no writes.

The refusals are told apart here, where the drivers' words are known; errors.py says how each is
answered.

Each kind is logged once a minute at most, with how many requests it refused since the last line:
a line for every request would bury the one an operator needs (during a machine's loss, 145
lines in 13 s around the one that said the database was another server). The two that need an
operator at ERROR; a passing outage at WARNING, and once more when it is over (a connection made,
or a transaction committed again), with how long it lasted. A full disk is also remembered until a
write commits again, so that /readyz can say it while the reads are still served (health.py).
"""

import logging
import re
import threading
import time
from dataclasses import dataclass, field

from flask import Flask, current_app
from sqlalchemy import URL, Connection, event
from sqlalchemy import exc as sa_exc

from animal_store.extensions import db

EXTENSION = "animal_store_database_faults"
# PostgreSQL's refusal of a write by a server that takes only reads: a hot standby, a primary
# demoted to one, a database with default_transaction_read_only.
READ_ONLY_SQL_TRANSACTION = "25006"
# SQLSTATE class 28, invalid authorization specification: a wrong password (28P01), or a role,
# database or address that pg_hba.conf does not let in (28000). The configuration is wrong: it
# does not pass as an outage does.
LOGIN_REFUSED_CLASS = "28"
# libpq gives a failed connection no SQLSTATE, only the server's message: these are class 28's
# at login (PostgreSQL's and PgBouncer's), and libpq's own when it has no password to give. In
# English, the server's lc_messages of C or en: in another language a refused login is told
# as a database that cannot be reached, with the driver's message.
LOGIN_REFUSALS = re.compile(
    r"password authentication failed|no pg_hba\.conf entry|pg_hba\.conf rejects"
    r"|is not permitted to log in|role \".*\" does not exist|no password supplied"
)
# A table or index that cannot grow: PostgreSQL's disk_full, SQLite's SQLITE_FULL.
DISK_FULL = "53100"
SQLITE_FULL = "SQLITE_FULL"
# What SQLite says when its file cannot be written (read-only, full, broken disk) or stays
# locked past the busy timeout: conditions of the machine, not bugs of ours.
SQLITE_OUTAGE_MESSAGES = ("unable to open", "disk i/o", "readonly", "full", "locked")
# How often a fault that lasts is logged again, at most (seconds).
LOG_EVERY = 60.0
# The outages that pass by themselves (errors.OUTAGE_REASONS' names), each with the line that says
# it is over: on a new connection (the server answers again) or a commit (it takes writes again).
# A standby takes connections: only a commit ends "read_only".
UNAVAILABLE, READ_ONLY = "unavailable", "read_only"
OVER = {
    UNAVAILABLE: "The database answers again, %.1f s after this worker found it unavailable",
    READ_ONLY: "The database takes writes again, %.1f s after this worker found it took none",
}


@dataclass
class DatabaseFaults:
    """One worker's record: when each fault was last logged, the refusals since, since when each
    passing outage lasts and whether a line said it, and since when writes find the disk full
    (None while they do not)."""

    logger: logging.Logger
    logged_at: dict[str, float] = field(default_factory=dict)
    refused_since_logged: dict[str, int] = field(default_factory=dict)
    lost_since: dict[str, float] = field(default_factory=dict)
    said_lost: set[str] = field(default_factory=set)
    full_since: float | None = None
    # The development server answers on threads.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def writes_again(self, _connection: Connection) -> None:
        # Also after a transaction that read only: it does not say the disk has room, but the
        # next refused write says it is full again, and a creation that commits does say so.
        self.full_since = None
        if self.lost_since:
            self.over(UNAVAILABLE, READ_ONLY)

    def connected(self, _dbapi_connection: object, _record: object) -> None:
        if self.lost_since:
            self.over(UNAVAILABLE)

    def over(self, *reasons: str) -> None:
        """Say that these outages are over, each whose start a line said: once, not per
        request. The refusals of one that no line said wait for the next line of its kind."""
        now = time.monotonic()
        for reason in reasons:
            with self.lock:
                since = self.lost_since.pop(reason, None)
                said = reason in self.said_lost
                self.said_lost.discard(reason)
                refused = self.refused_since_logged.get(reason, 0)
                if since is not None and said:
                    self.refused_since_logged[reason] = 0
            if since is not None and said:
                self.logger.warning(
                    OVER[reason] + " (%d refused since this was last logged)",
                    now - since,
                    refused,
                    extra={"fields": {"databaseFault": reason}},
                )


def init_database_faults(app: Flask) -> None:
    """Keep the app's record of the database's faults."""
    app.extensions[EXTENSION] = DatabaseFaults(app.logger)


def database_faults(app: Flask) -> DatabaseFaults:
    faults: DatabaseFaults = app.extensions[EXTENSION]
    return faults


def log_fault(reason: str, message: str, *args: object, level: int = logging.ERROR) -> bool:
    """Log the fault (at ERROR, or `level`) if it was not logged in the last LOG_EVERY seconds,
    with the count of the requests it refused meanwhile; count it either way. Return whether it
    was logged."""
    faults = database_faults(current_app)
    now = time.monotonic()
    with faults.lock:
        refused = faults.refused_since_logged.get(reason, 0) + 1
        last = faults.logged_at.get(reason)
        due = last is None or now - last >= LOG_EVERY
        if due:
            faults.logged_at[reason] = now
            faults.refused_since_logged[reason] = 0
        else:
            faults.refused_since_logged[reason] = refused
    if due:
        current_app.logger.log(
            level,
            message + " (%d refused since this was last logged; said again in %d s at most)",
            *args,
            refused,
            LOG_EVERY,
            extra={"fields": {"databaseFault": reason}},
        )
    return due


def log_outage(reason: str, message: str, *args: object) -> None:
    """Log a passing outage (UNAVAILABLE, READ_ONLY) as log_fault does, at WARNING, and say once
    when it is over (OVER)."""
    faults = database_faults(current_app)
    with faults.lock:
        faults.lost_since.setdefault(reason, time.monotonic())
    if log_fault(reason, message, *args, level=logging.WARNING):
        with faults.lock:
            faults.said_lost.add(reason)
    # Listened for from the first outage on, as for a full disk (remember_full_disk): a new
    # connection costs a request nothing more, a commit listener every statement a dispatch.
    engine = db.engine
    if not event.contains(engine, "connect", faults.connected):
        event.listen(engine, "connect", faults.connected)
    if not event.contains(engine, "commit", faults.writes_again):
        event.listen(engine, "commit", faults.writes_again)


def remember_full_disk() -> None:
    """Remember that writes find the disk full, until a transaction commits again."""
    faults = database_faults(current_app)
    if faults.full_since is None:
        faults.full_since = time.monotonic()
    # Listened for from the first full disk on, not from the start: a commit listener costs
    # every statement on the engine a dispatch, 7 % of a creation's CPU (benchmarks/in_process.py).
    engine = db.engine
    if not event.contains(engine, "commit", faults.writes_again):
        event.listen(engine, "commit", faults.writes_again)


def disk_full() -> bool:
    """Whether the last write this worker tried found the database's disk full."""
    return database_faults(current_app).full_since is not None


def is_database_outage(error: BaseException) -> bool:
    """Tell a database that cannot be reached or written from a bug in our SQL."""
    if isinstance(error, sa_exc.DisconnectionError | sa_exc.TimeoutError):
        return True  # the pool gave up reconnecting, or every connection stayed busy
    if is_read_only_refusal(error):
        return True
    if (
        isinstance(error, sa_exc.DBAPIError)
        and error.connection_invalidated
        and db.engine.dialect.name != "sqlite"
    ):
        # The server's connection broke under the statement, whatever the driver called it: a
        # server shut down (a switchover) right after a COMMIT completed sends its FATAL behind
        # the COMMIT's answer, which psycopg raises as InternalError ("received 2 results").
        return True
    if not isinstance(error, sa_exc.OperationalError | sa_exc.InterfaceError):
        return False
    if db.engine.dialect.name == "sqlite":
        # SQLite raises OperationalError for syntax errors and missing tables too: those are bugs.
        message = str(error.orig).lower()
        return any(fragment in message for fragment in SQLITE_OUTAGE_MESSAGES)
    return True


def is_disk_full(error: BaseException) -> bool:
    """Tell a write refused for want of space: PostgreSQL's disk_full, SQLite's SQLITE_FULL."""
    cause = getattr(error, "orig", None)
    return (
        getattr(cause, "sqlstate", None) == DISK_FULL
        or getattr(cause, "sqlite_errorname", None) == SQLITE_FULL
    )


def is_read_only_refusal(error: BaseException) -> bool:
    """Tell a write refused by a server that takes only reads (SQLSTATE 25006)."""
    return getattr(getattr(error, "orig", None), "sqlstate", None) == READ_ONLY_SQL_TRANSACTION


def is_login_refusal(error: BaseException) -> bool:
    """Tell a database that refuses the service's role or password (SQLSTATE class 28)."""
    cause = getattr(error, "orig", None) or error
    sqlstate = getattr(cause, "sqlstate", None)
    if sqlstate is not None:
        return bool(sqlstate.startswith(LOGIN_REFUSED_CLASS))
    # (No SQLite message has these words.)
    return isinstance(error, sa_exc.OperationalError) and bool(LOGIN_REFUSALS.search(str(cause)))


def login_refused(url: URL, cause: BaseException) -> str:
    """Say which login the database refuses, and why, in the driver's words: the role, the
    database and the host, never the password."""
    return (
        f"The database refuses the login of role {url.username!r} to database {url.database!r} "
        f"on {url.host}:{url.port or 5432}: {first_line(cause)}. Check DATABASE_URL's user and "
        "password"
    )


def first_line(cause: BaseException) -> str:
    # psycopg adds hints and context on the lines after the server's message.
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__
