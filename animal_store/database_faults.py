"""What a worker remembers of the database's refusals that are no passing outage: a login it
refuses (a configuration error) and a disk with no space left for writes.

Each is logged at ERROR, once a minute at most for each kind, with how many requests it refused
since the last line: a WARNING for every request would bury the one line an operator needs. A
full disk is also remembered until a write commits again, so that /readyz can say it while the
reads are still served (health.py).
"""

import threading
import time
from dataclasses import dataclass, field

from flask import Flask, current_app
from sqlalchemy import Connection, event

from animal_store.extensions import db

EXTENSION = "animal_store_database_faults"
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
