"""Each process's writer of API keys' last-used times, off the path of every request."""

import logging
import os
import threading
from datetime import datetime, timedelta
from typing import cast

from flask import Flask, current_app
from sqlalchemy.exc import SQLAlchemyError
from werkzeug.local import LocalProxy

from animal_store import errors
from animal_store.data import deadlines, store
from animal_store.data.database_faults import first_line, remember_full_disk
from animal_store.extensions import settings

LOG = logging.getLogger(__name__)


class Writer:
    """The last-used times this process noted and has not written yet, and the thread that
    writes them (issue 48: a read never waits on a write).

    A request that finds its key's last-used time older than KEY_LAST_USED_RESOLUTION notes the
    use (auth.record_use) and goes on: noting takes a lock and sets an entry, nothing else. A
    daemon thread, started on the first note, writes the noted times with the conditional UPDATE
    (store.record_key_use), a transaction a key, on a pooled connection of its own. What waits
    is the latest time of each key (and app): however long the database stalls, the notes take
    no more memory than the keys in use.

    A write that fails (the database down, hung or read-only, a full disk, a statement timeout,
    a row another transaction holds) is dropped: the key's cached entry says it was written, so
    its time is written again at its first use after another KEY_LAST_USED_RESOLUTION. Each kind
    of failure is logged once, in one line without a traceback, until a write succeeds again; a
    full disk is also remembered for /readyz (database_faults.py), as a creation's is. On
    PostgreSQL each write runs under a deadline of DATABASE_DEADLINE, watched as a probe's
    (deadlines.py): a hung server costs the writer that long, and no request a 503.

    A forked process (a gunicorn worker) starts with a writer of its own and nothing noted
    (forget_after_fork, as deadlines.py's watchdog). What a process noted and had not written
    when it ends is lost: those keys' times lag until their next use.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)  # something was noted
        self.idle = threading.Condition(self.lock)  # everything noted is written or dropped
        # (app, key id) -> (the latest use noted, the app's KEY_LAST_USED_RESOLUTION).
        self.pending: dict[tuple[Flask, int], tuple[datetime, timedelta]] = {}
        self.writing = False
        self.thread: threading.Thread | None = None
        # The kinds of failure logged since the last write that succeeded: the thread's alone.
        self.failing: set[str] = set()

    def note(self, app: Flask, key_id: int, used_at: datetime, resolution: timedelta) -> None:
        """Have the key's last-used time written; never raises, never waits on the database."""
        with self.lock:
            noted = self.pending.get((app, key_id))
            if noted is None or noted[0] < used_at:
                self.pending[(app, key_id)] = (used_at, resolution)
            if self.thread is not None:
                self.work.notify()
                return
            thread = threading.Thread(target=self.run, name="key-last-used", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: the next note tries again
                LOG.warning("Could not start the thread that writes keys' last-used times")
                return
            self.thread = thread

    def flush(self, timeout: float) -> bool:
        """Wait until everything noted is written or dropped; return False if it took longer
        than `timeout` seconds."""
        with self.lock:
            return self.idle.wait_for(lambda: not self.pending and not self.writing, timeout)

    def run(self) -> None:
        while True:
            with self.lock:
                while not self.pending:
                    self.writing = False
                    self.idle.notify_all()
                    self.work.wait()
                batch, self.pending = self.pending, {}
                self.writing = True
            for (app, key_id), (used_at, resolution) in batch.items():
                try:
                    self.write(app, key_id, used_at, resolution)
                except Exception:  # a bug: said once, and the thread goes on
                    self.failed("bug", "an unexpected error", exc_info=True)

    def write(self, app: Flask, key_id: int, used_at: datetime, resolution: timedelta) -> None:
        with app.app_context():
            deadlines.shorten_deadline(settings(app).DATABASE_DEADLINE)
            try:
                store.record_key_use(key_id, used_at, resolution)
            except SQLAlchemyError as error:
                kind = errors.outage_kind(error)
                if kind is errors.DATABASE_FULL:
                    remember_full_disk()
                cause = getattr(error, "orig", None) or error
                self.failed(
                    errors.OUTAGE_REASONS[kind],
                    f"{type(cause).__name__}: {first_line(cause)}",
                )
                return
        self.failing.clear()

    def failed(self, kind: str, reason: str, exc_info: bool = False) -> None:
        if kind in self.failing:
            return
        self.failing.add(kind)
        LOG.warning(
            "Could not write a key's last-used time (%s): %s. Dropped: the key's next use after "
            "KEY_LAST_USED_RESOLUTION writes it again; this kind of failure is not logged again "
            "until a write succeeds",
            kind,
            reason,
            exc_info=exc_info,
        )


WRITER = Writer()


def forget_after_fork() -> None:
    # A forked child has no thread but the one that forked, and a lock the writer held then
    # would stay held: a writer of its own, started on its first note.
    global WRITER
    WRITER = Writer()


os.register_at_fork(after_in_child=forget_after_fork)


def note_use(key_id: int, used_at: datetime, resolution: timedelta) -> None:
    """Have this process's writer write the key's last-used time, for the current app."""
    app = cast("LocalProxy[Flask]", current_app)._get_current_object()
    WRITER.note(app, key_id, used_at, resolution)


def flush(timeout: float) -> bool:
    """Wait until this process's writer has written or dropped every time noted; return False
    if it took longer than `timeout` seconds (tests read the times after their requests)."""
    return WRITER.flush(timeout)
