"""Whether the database would commit a write now, asked of the database itself by /readyz: every
worker finds the same answer, no client's write has to fail first, and the answer clears as soon
as its cause does.

On PostgreSQL the probe writes, in one transaction that changes nothing a query could see:

- a temporary file of some 70 kB, in the database's own tablespace (the sort of a table function
  bigger than work_mem, set to its 64 kB minimum for the transaction), deleted as the statement
  ends: a disk with no space left refuses it as it refuses a table that must grow (SQLSTATE
  53100), where writing WAL alone, into segments made in advance, would still succeed;
- a transactional logical message (pg_logical_emit_message: no table, no lock, a few bytes of
  WAL that no standby applies and only a logical decoding consumer asking for messages sees),
  which gives the transaction an ID and WAL of its own, so that its COMMIT waits for the
  synchronous standbys exactly as a creation's does (an ID alone commits without waiting).

The COMMIT may wait half of what is left of the probe's deadline; then its wait is cancelled, as
pg_cancel_backend would: the server answers at once, with a WARNING that says the transaction
committed locally but waited for its standbys, and the connection is closed rather than pooled
(a late cancel must not meet the next request's statement). A commit left waiting instead would
hold a server connection until a standby came back, one more at every probe. A server that does
not answer the cancel either is cut at the deadline (deadlines.py): an outage, as before.

On SQLite the database's disk is this machine's: the room left on the file's filesystem is read
(statvfs), with no write, no lock to wait for and no fsync.
"""

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa

from animal_store.data.deadlines import time_left
from animal_store.extensions import db

if TYPE_CHECKING:
    import psycopg

# What /readyz says of the database (its "database"): writes commit, or why they do not.
OK = "ok"
DISK_FULL = "disk full"
WAITING_FOR_STANDBY = "waiting for a synchronous standby"
# A server that takes only reads: a standby, a primary set read-only. /readyz answers it 503.
READ_ONLY = "read only"
# No primary answers, and the standbys serve the reads without it (data/without_primary.py).
READS_ONLY = "reads only: no primary"

# PostgreSQL's refusal of a file that cannot grow (disk_full).
DISK_FULL_SQLSTATE = "53100"
# The code of a WARNING that gives none.
WARNING_SQLSTATE = "01000"
# For the probe's transaction alone: the smallest work_mem, so that the table function below
# spills, and temporary files in the database's default tablespace, where its tables are.
PROBE_SETTINGS = sa.text(
    "SELECT set_config('work_mem', '64kB', true), set_config('temp_tablespaces', '', true), "
    "current_setting('transaction_read_only')"
)
# 5000 rows spill about 70 kB to a temporary file (PostgreSQL 15: 2000 rows stay in memory).
PROBE_WRITE = sa.text(
    "SELECT pg_logical_emit_message(true, 'animal_store', 'readyz'), "
    "(SELECT count(*) FROM generate_series(1, 5000))"
)
# The share of what is left of the deadline that the COMMIT may wait for the standbys.
COMMIT_SHARE = 0.5
# Seconds a cancel is given at least, even past the deadline (psycopg's 0 would mean no bound).
MINIMUM_WAIT = 0.05
# SQLite: less room than this left for the file's filesystem is a full disk, as a creation's
# commit appends some 5 pages of 4 kB to the WAL file.
SQLITE_ROOM = 64 * 1024


def write_state(seconds: float) -> str:
    """Say whether the database would commit a write now: OK, DISK_FULL, WAITING_FOR_STANDBY or
    READ_ONLY. Raise SQLAlchemyError when it does not answer; `seconds` is the probe's time when
    no request's deadline bounds it (SQLite's)."""
    if db.engine.dialect.name == "postgresql":
        return postgresql_write_state(seconds)
    with db.engine.connect() as connection:
        connection.execute(sa.text("SELECT 1"))
    path = db.engine.url.database
    if not path or path == ":memory:" or path.startswith("file:"):
        return OK
    filesystem = os.statvfs(Path(path).absolute().parent)
    return DISK_FULL if filesystem.f_bavail * filesystem.f_frsize < SQLITE_ROOM else OK


def postgresql_write_state(seconds: float) -> str:
    with db.engine.connect() as connection:
        if connection.execute(PROBE_SETTINGS).one()[2] != "off":
            return READ_ONLY
        try:
            connection.execute(PROBE_WRITE)
        except sa.exc.DBAPIError as error:
            if getattr(error.orig, "sqlstate", None) == DISK_FULL_SQLSTATE:
                return DISK_FULL
            raise
        left = time_left()
        left = seconds if left is None else left
        if commit_within(connection, left * COMMIT_SHARE, left):
            return OK
        return WAITING_FOR_STANDBY


def commit_within(connection: sa.Connection, seconds: float, left: float) -> bool:
    """Commit; return False when the COMMIT still waited for the standbys after `seconds`, its
    wait then cancelled (the transaction committed on this server, not yet acknowledged by its
    standbys). `left`: the probe's time, which the cancel does not outlive."""
    driver = cast("psycopg.Connection[Any]", connection.connection.driver_connection)
    deadline = time.monotonic() + left
    cancelled = threading.Event()
    # The server's WARNING as a cancel ends the wait for the standbys ("canceling wait for
    # synchronous replication"), told by its code and severity, which no language changes; a
    # COMMIT slow for another reason (a WAL flush) cannot be cancelled, and gets none.
    warnings: list[str | None] = []

    def warned(diagnostic: "psycopg.errors.Diagnostic") -> None:
        if diagnostic.severity_nonlocalized == "WARNING":
            warnings.append(diagnostic.sqlstate)

    def cancel() -> None:
        cancelled.set()
        # Bounded: a server that answers nothing is cut at the deadline meanwhile.
        with contextlib.suppress(Exception):
            driver.cancel_safe(timeout=max(deadline - time.monotonic(), MINIMUM_WAIT))

    timer = threading.Timer(seconds, cancel)
    timer.daemon = True
    driver.add_notice_handler(warned)
    timer.start()
    try:
        connection.commit()
    finally:
        timer.cancel()
        # A cancel under way has reached the server before the connection is given up.
        timer.join(max(deadline - time.monotonic(), MINIMUM_WAIT))
        driver.remove_notice_handler(warned)
    if cancelled.is_set():
        # Never pooled: a cancel that came late would end the next request's statement.
        connection.invalidate()
    return not (cancelled.is_set() and WARNING_SQLSTATE in warnings)
