"""What the database's refusals mean, and what a worker remembers of those that are no passing
outage: a login it refuses (a configuration error) and a disk with no space left for writes.

The refusals are told apart here, where the drivers' words are known; errors.py says how each is
answered.

Each is logged at ERROR, once a minute at most for each kind, with how many requests it refused
since the last line: a WARNING for every request would bury the one line an operator needs. A
full disk is also remembered until a write commits again, so that /readyz can say it while the
reads are still served (health.py).
"""

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


@dataclass
class DatabaseFaults:
    """One worker's record: when each fault was last logged, the refusals since, and since when
    writes find the disk full (None while they do not)."""

    logged_at: dict[str, float] = field(default_factory=dict)
    refused_since_logged: dict[str, int] = field(default_factory=dict)
    full_since: float | None = None
    # The development server answers on threads.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def writes_again(self, _connection: Connection) -> None:
        # Also after a transaction that read only: it does not say the disk has room, but the
        # next refused write says it is full again, and a creation that commits does say so.
        self.full_since = None


def init_database_faults(app: Flask) -> None:
    """Keep the app's record of the database's faults."""
    app.extensions[EXTENSION] = DatabaseFaults()


def database_faults(app: Flask) -> DatabaseFaults:
    faults: DatabaseFaults = app.extensions[EXTENSION]
    return faults


def log_fault(reason: str, message: str, *args: object) -> None:
    """Log the fault at ERROR if it was not logged in the last LOG_EVERY seconds, with the count
    of the requests it refused meanwhile; count it either way."""
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
        current_app.logger.error(
            message + " (%d refused since this was last logged; said again in %d s at most)",
            *args,
            refused,
            LOG_EVERY,
            extra={"fields": {"databaseFault": reason}},
        )


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
