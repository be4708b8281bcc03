"""A read never waits on a write (issue 48): a key's last-used time is written by its process's
writer, off the request's path, so a write of api_keys that waits delays no answer and fails none,
and the time is written once the write can go."""

import contextlib
import logging
import sqlite3
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import requests
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from animal_store.access import last_used
from animal_store.access.auth import issue_key
from animal_store.data.models import ApiKey
from animal_store.extensions import db

# Seconds a write of api_keys waits for the test's lock before it fails: SQLite's busy timeout,
# PostgreSQL's statement timeout (the deadline a little longer). A request that waited on that
# write would take all of them; each must be answered within a third, a margin a busy 2-core
# machine keeps, and all of them within half, so that the writer still waits when the test
# lets its write go.
STALL = 10
SETTINGS = {
    "SQLITE_BUSY_TIMEOUT": STALL,
    "DATABASE_STATEMENT_TIMEOUT": STALL,
    "DATABASE_DEADLINE": STALL + 2,
}
NEW_PET = {"name": "Rex", "categoryId": 1}
# A backend of the test's database whose UPDATE of api_keys waits for a lock.
WAITING_UPDATES = """
    SELECT pid FROM pg_stat_activity
    WHERE datname = current_database() AND wait_event_type = 'Lock'
      AND query LIKE 'UPDATE api_keys%'
"""


def wait_for(condition, what, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


class HeldKeys:
    """Another connection's write that makes any write of the key's row wait: on SQLite the
    database's write lock (BEGIN IMMEDIATE), which creations wait for too; on PostgreSQL the
    row, as another UPDATE of it holds it (FOR NO KEY UPDATE: a creation's reference to the key,
    an Idempotency-Key's, is still let through)."""

    def __init__(self, database_url, key_id):
        url = make_url(database_url)
        self.dialect = url.get_backend_name()
        if self.dialect == "sqlite":
            self.session = sqlite3.connect(url.database, isolation_level=None)
            self.session.execute("BEGIN IMMEDIATE")
        else:
            self.url = url.set(drivername="postgresql").render_as_string(hide_password=False)
            self.session = psycopg.connect(self.url)
            self.session.execute(
                "SELECT id FROM api_keys WHERE id = %s FOR NO KEY UPDATE", (key_id,)
            )

    def update_waits(self):
        """Whether an UPDATE of api_keys waits for the row (PostgreSQL; SQLite cannot tell)."""
        if self.dialect == "sqlite":
            return True
        with psycopg.connect(self.url, autocommit=True) as probe:
            return probe.execute(WAITING_UPDATES).fetchone() is not None

    def release(self):
        self.session.rollback()
        self.session.close()


@contextlib.contextmanager
def held_keys(database_url, key_id):
    held = HeldKeys(database_url, key_id)
    try:
        yield held
    finally:
        held.release()


def new_key(app, last_used_at):
    with app.app_context():
        api_key, key = issue_key("reader")
        api_key.last_used_at = last_used_at
        db.session.commit()
        return api_key.id, {"Authorization": f"Bearer {key}"}


def written_last_used(app):
    with app.app_context():
        return db.session.scalar(sa.select(ApiKey.last_used_at))


# The key's last-used time: never written, or older than KEY_LAST_USED_RESOLUTION (60 s).
LAST_USED = {"never": None, "stale": datetime.now(UTC) - timedelta(minutes=2)}
# Cached, a worker's first request of the key wants the write; uncached, every one does.
KEY_CACHE = {"cached": 5, "uncached": 0}


@pytest.mark.parametrize("key_cache", KEY_CACHE)
@pytest.mark.parametrize("last_used_at", LAST_USED)
@pytest.mark.parametrize("operations", ["reads", "creations"])
def test_no_request_waits_on_the_last_used_write(
    make_app, database_url, make_pet, operations, last_used_at, key_cache
):
    app = make_app(KEY_CACHE_SECONDS=KEY_CACHE[key_cache], **SETTINGS)
    client = app.test_client()
    with app.app_context():
        dialect = db.engine.dialect.name
    if operations == "creations" and dialect == "sqlite":
        pytest.skip(
            "SQLite's write lock, which makes the last-used write wait, holds creations too"
        )
    pet_id = make_pet()
    key_id, headers = new_key(app, LAST_USED[last_used_at])
    sends = {
        "reads": [("GET", "/v1/pets", {}), ("GET", f"/v1/pets/{pet_id}", {})] * 2,
        # The second with an Idempotency-Key, whose record refers to the key's row.
        "creations": [("POST", "/v1/pets", {}), ("POST", "/v1/pets", {"Idempotency-Key": "2nd"})],
    }[operations]
    answered = {"reads": 200, "creations": 201}[operations]
    used_from = datetime.now(UTC)
    with held_keys(database_url, key_id) as held:
        held_at = time.monotonic()
        for method, path, more in sends:
            started = time.monotonic()
            response = client.open(
                path,
                method=method,
                headers={**headers, **more},
                json=NEW_PET if method == "POST" else None,
            )
            took = time.monotonic() - started
            assert response.status_code == answered, response.get_json()
            assert took < STALL / 3, f"{method} {path} took {took:.2f} s"
        assert time.monotonic() - held_at < STALL / 2
        # The write was tried, and waits: the requests did not.
        wait_for(held.update_waits, "the last-used UPDATE waiting for the row")
        assert not last_used.flush(timeout=0.2)
        assert written_last_used(app) == LAST_USED[last_used_at]
        used_until = datetime.now(UTC)
    # Let go, the write that waited goes through, with the time of the use.
    wait_for(
        lambda: written_last_used(app) != LAST_USED[last_used_at],
        "the last-used time written after the lock was released",
        timeout=STALL,
    )
    assert used_from <= written_last_used(app) <= used_until


def test_a_gunicorn_worker_answers_reads_while_its_last_used_write_waits(
    app, database_url, make_pet, start_gunicorn
):
    # The writer as deployed: a thread of the forked worker, which started it on its first note.
    server = start_gunicorn(
        workers=1, env={f"ANIMAL_STORE_{name}": str(value) for name, value in SETTINGS.items()}
    )
    pet_id = make_pet()
    key_id, headers = new_key(app, None)
    used_from = datetime.now(UTC)
    with held_keys(database_url, key_id) as held:
        held_at = time.monotonic()
        for path in ["/v1/pets", f"/v1/pets/{pet_id}"] * 2:
            response = requests.get(server.url + path, headers=headers, timeout=STALL + 5)
            assert response.status_code == 200, response.text
            assert response.elapsed.total_seconds() < STALL / 3, path
        assert time.monotonic() - held_at < STALL / 2
        wait_for(held.update_waits, "the worker's last-used UPDATE waiting for the row")
        assert written_last_used(app) is None
        used_until = datetime.now(UTC)
    wait_for(lambda: written_last_used(app) is not None, "the last-used time", timeout=STALL)
    assert used_from <= written_last_used(app) <= used_until


def test_a_write_that_fails_is_dropped_and_said_once_until_one_succeeds(
    make_app, database_url, caplog
):
    # Writes that give up after 0.2 s, one wanted by every request (resolution 0).
    app = make_app(
        KEY_LAST_USED_RESOLUTION=0, SQLITE_BUSY_TIMEOUT=0.2, DATABASE_STATEMENT_TIMEOUT=0.2
    )
    client = app.test_client()
    key_id, headers = new_key(app, None)

    def read():
        assert client.get("/v1/pets", headers=headers).status_code == 200
        assert last_used.flush(timeout=STALL)

    def said():
        return [r.getMessage() for r in caplog.records if r.name == "animal_store.access.last_used"]

    with caplog.at_level(logging.WARNING):
        with held_keys(database_url, key_id):
            for _ in range(3):
                read()
        assert written_last_used(app) is None  # dropped
        assert len(said()) == 1, said()
        assert said()[0].startswith("Could not write a key's last-used time (unavailable): ")
        read()
        assert written_last_used(app) is not None
        with held_keys(database_url, key_id):
            read()
    assert len(said()) == 2, said()
