"""A retried creation after a fault: the claim on its Idempotency-Key lasts only while its holder
can still finish, so the retry creates as soon as the service answers again (issue 43).

Real processes and real faults: gunicorn's master and workers, or one worker, killed with SIGKILL
by PID while a creation holds its claim and waits mid-transaction; a primary of the test's own
killed and its standby promoted; the same through PgBouncer in transaction pooling. And a holder
alive but slow still keeps its key: its concurrent retries never make a second animal.

A creation is held mid-transaction, after its claim, by `held_creations`: on PostgreSQL a session
of the test locks the pets table, so the INSERT waits; on SQLite, where a session's write lock
would stop the claim itself, a trigger keeps the INSERT of an animal named "Slowpoke" busy.
"""

import os
import signal
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
import requests
import sqlalchemy as sa
from conftest import migrate_to_head, start_own_cluster
from pgbouncer_server import PGBOUNCER, PgBouncer
from sqlalchemy.engine import make_url
from test_crashes import children, kill_everything
from test_failover import make_key, own_primary

from animal_store.extensions import db

SLOWPOKE = {"name": "Slowpoke", "categoryId": 1}
# Longer than any claim lease of a release before this one (IDEMPOTENCY_LEASE, 60 s): how long a
# retry keeps trying, so that the time it took is measured there too.
PATIENCE = 75
WAITING_INSERTS = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    " AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO pets%'"
)


def serving(server):
    """Wait for a gunicorn to serve, longer than the fixture would: on a busy 2-core machine its
    workers' boot alone may take most of the fixture's 20 s."""
    return server.wait_until_serving(timeout=120)


def post(url, key, body, api_key, timeout=30):
    return requests.post(
        f"{url}/v1/pets",
        json=body,
        headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": key},
        timeout=timeout,
    )


def retry_until_created(url, key, body, api_key):
    """Send the creation again every 0.1 s, as a patient client would, until it gets 201; return
    the 201, the seconds it took and what the retries before it got, counted."""
    start = time.monotonic()
    before = []
    while True:
        try:
            response = post(url, key, body, api_key, timeout=10)
        except requests.RequestException as error:
            before.append(type(error).__name__)
        else:
            if response.status_code == 201:
                return response, time.monotonic() - start, dict(Counter(before))
            before.append(response.status_code)
        assert time.monotonic() - start < PATIENCE, f"no 201 in {PATIENCE}s: {before[-5:]}"
        time.sleep(0.1)


def in_background(function, *args):
    """Run function(*args) in a thread; return a callable that joins it and gives its result or
    the exception it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except Exception as error:
            outcome["value"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout=60):
        thread.join(timeout)
        assert not thread.is_alive(), "the request never ended"
        return outcome["value"]

    return result


def wait_for(condition, what, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


class LockedPets:
    """PostgreSQL: a session of the test holds the pets table, so a creation's INSERT waits (after
    its claim) until release()."""

    def __init__(self, url):
        self.url = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.session = psycopg.connect(self.url)
        self.session.execute("LOCK TABLE pets IN ACCESS EXCLUSIVE MODE")

    def waiting(self):
        """The PIDs of the backends whose INSERT waits for the table."""
        with psycopg.connect(self.url, autocommit=True) as probe:
            return {row[0] for row in probe.execute(WAITING_INSERTS)}

    def wait_until_held(self):
        wait_for(self.waiting, "a creation waiting for the pets table")

    def backend_alive(self, pid):
        with psycopg.connect(self.url, autocommit=True) as probe:
            found = probe.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
            return found.fetchone() is not None

    def release(self):
        if not self.session.closed:
            self.session.rollback()
            self.session.close()


class SlowInsert:
    """SQLite: the INSERT of a "Slowpoke" runs a trigger counting to `count`, holding the
    database's write lock meanwhile (SQLite cannot sleep)."""

    def __init__(self, path, count):
        self.path = path
        with sqlite3.connect(path) as connection:
            connection.execute(
                f"""CREATE TRIGGER held_insert AFTER INSERT ON pets WHEN NEW.name = 'Slowpoke'
                BEGIN SELECT count(*) FROM (WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL
                SELECT i + 1 FROM n WHERE i < {int(count)}) SELECT i FROM n); END"""  # noqa: S608
            )
        connection.close()

    def write_locked(self):
        connection = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            connection.close()

    def wait_until_held(self):
        wait_for(self.write_locked, "a creation holding the write lock")
        # The releases before this one committed the claim in a short transaction of its own
        # before the creation's: by now the creation's own holds the lock.
        time.sleep(0.5)

    def release(self):
        with sqlite3.connect(self.path) as connection:
            connection.execute("DROP TRIGGER IF EXISTS held_insert")
        connection.close()


@pytest.fixture
def held_creations(app):
    """Make creations of SLOWPOKE wait mid-transaction, after their claim (the engine's way);
    on SQLite a count of `count` makes it seconds (about 2 s per million here)."""
    holds = []

    def hold(count=50_000_000):
        with app.app_context():
            url = db.engine.url
        if url.get_backend_name() == "postgresql":
            holds.append(LockedPets(url))
        else:
            holds.append(SlowInsert(url.database, count))
        return holds[-1]

    yield hold
    for each in holds:
        each.release()


def test_retry_after_the_instance_was_killed_mid_creation_creates_at_once(
    app, api_key, start_gunicorn, held_creations, count_pets, tmp_path
):
    # A killed master cannot remove the metrics directory it made: made in the test's own.
    env = {"TMPDIR": str(tmp_path)}
    server = serving(start_gunicorn(workers=2, env=env, wait=False))
    held = held_creations()
    first = in_background(post, server.url, "order-1", SLOWPOKE, api_key)
    held.wait_until_held()
    if isinstance(held, LockedPets):
        (backend,) = held.waiting()
    kill_everything(server)
    assert isinstance(first(), requests.RequestException)  # no answer: the client retries
    if isinstance(held, LockedPets):
        # The server ends the dead client's transaction, its claim with it, while its INSERT
        # still waits for the lock (client_connection_check_interval).
        wait_for(lambda: not held.backend_alive(backend), "the killed client's backend ended")
    held.release()

    server = serving(start_gunicorn(workers=2, env=env, wait=False))
    created, took, before = retry_until_created(server.url, "order-1", SLOWPOKE, api_key)
    print(f"instance killed: 201 {took:.2f}s after the service answered again, after {before}")
    assert before == {}
    assert "Idempotent-Replayed" not in created.headers
    assert post(server.url, "order-1", SLOWPOKE, api_key).json() == created.json()
    assert count_pets() == 1


def test_retry_after_its_worker_was_killed_mid_creation_creates_at_once(
    app, api_key, start_gunicorn, held_creations, count_pets
):
    server = serving(start_gunicorn(workers=1, wait=False))
    (worker,) = children(server.process.pid)
    held = held_creations()
    first = in_background(post, server.url, "order-1", SLOWPOKE, api_key)
    held.wait_until_held()
    os.kill(worker, signal.SIGKILL)
    assert isinstance(first(), requests.RequestException)
    held.release()

    # The master starts another worker in its place.
    wait_for(lambda: children(server.process.pid) not in ([], [worker]), "a new worker")
    serving(server)
    created, took, before = retry_until_created(server.url, "order-1", SLOWPOKE, api_key)
    print(f"worker killed: 201 {took:.2f}s after the service answered again, after {before}")
    assert before == {}
    assert "Idempotent-Replayed" not in created.headers
    assert count_pets() == 1


def test_retry_after_a_failover_mid_creation_creates_at_once(start_gunicorn):
    """Synchronous replication: the releases before this one committed the claim, and the
    standby had it, before the creation's INSERT; the retry found it on the promoted server."""
    primary, standby, url = own_primary("sync")
    held = None
    try:
        api_key = make_key(url)
        standby.wait_for_replay()
        server = serving(start_gunicorn(workers=2, database=url, wait=False))
        held = LockedPets(make_url(primary.database_url("store")))
        first = in_background(post, server.url, "order-1", SLOWPOKE, api_key)
        held.wait_until_held()
        time.sleep(0.2)  # a committed claim's WAL reaches the synchronous standby
        primary.kill()
        standby.promote()
        first()

        n = 0
        while True:  # 503 until the workers reach the promoted server
            n += 1
            other = post(server.url, f"other-{n}", {"name": "Other", "categoryId": 1}, api_key)
            if other.status_code == 201:
                break
            assert other.status_code == 503, other.text
            time.sleep(0.05)
        created, took, before = retry_until_created(server.url, "order-1", SLOWPOKE, api_key)
        print(f"failover: 201 {took:.2f}s after the first creation under another key, {before}")
        assert before == {}
        assert "Idempotent-Replayed" not in created.headers
        names = standby.sql("SELECT name FROM pets ORDER BY id", "store").split()
        assert names == ["Other", "Slowpoke"]
    finally:
        if held is not None:
            held.session.close()
        primary.stop()
        standby.stop()


@pytest.mark.skipif(PGBOUNCER is None, reason="PgBouncer is not installed (Debian: pgbouncer)")
def test_retry_through_pgbouncer_after_the_instance_was_killed_creates_at_once(
    start_gunicorn, tmp_path
):
    cluster = start_own_cluster()
    bouncer = held = None
    try:
        server_url = cluster.create_database("store")
        migrate_to_head(server_url)
        api_key = make_key(server_url)
        bouncer = PgBouncer(make_url(server_url), "postgres", pool_size=4).wait_until_serving()
        env = {"ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true", "TMPDIR": str(tmp_path)}
        through = bouncer.url.render_as_string(hide_password=False)
        server = serving(start_gunicorn(workers=2, env=env, database=through, wait=False))
        held = LockedPets(make_url(server_url))
        first = in_background(post, server.url, "order-1", SLOWPOKE, api_key)
        held.wait_until_held()
        kill_everything(server)
        assert isinstance(first(), requests.RequestException)
        held.release()

        server = serving(start_gunicorn(workers=2, env=env, database=through, wait=False))
        created, took, before = retry_until_created(server.url, "order-1", SLOWPOKE, api_key)
        print(f"PgBouncer, instance killed: 201 {took:.2f}s after it answered again, {before}")
        assert before == {}
        assert "Idempotent-Replayed" not in created.headers
        assert cluster.sql("SELECT name FROM pets", "store").split() == ["Slowpoke"]
        # Nothing of a claim outlived its transaction on the connections PgBouncer shares.
        settings = "SELECT setting FROM pg_settings WHERE name IN ('lock_timeout',"
        settings += " 'client_connection_check_interval', 'idle_in_transaction_session_timeout')"
        engine = sa.create_engine(through, poolclass=sa.NullPool)
        with engine.connect() as connection:
            assert connection.execute(sa.text(settings)).scalars().all() == ["0", "0", "0"]
        engine.dispose()
    finally:
        if held is not None:
            held.release()
        if bouncer is not None:
            bouncer.stop()
        cluster.stop()


def test_retries_while_the_holder_is_alive_wait_then_replay_and_never_create(
    app, api_key, start_gunicorn, held_creations, count_pets
):
    """The holder waits about a second mid-creation, alive. On PostgreSQL its concurrent retries
    get 409 with Retry-After meanwhile; on SQLite, where every writer waits for the one ahead,
    they wait for it (a busy timeout longer than the hold) and get its answer. Then the replay."""
    with app.app_context():
        engine = db.engine.dialect.name
    # Time enough, however busy the machine: the holder is slow, not stuck.
    patient = {
        "ANIMAL_STORE_SQLITE_BUSY_TIMEOUT": "60",
        "ANIMAL_STORE_DATABASE_DEADLINE": "60",
        "ANIMAL_STORE_DATABASE_STATEMENT_TIMEOUT": "50",
    }
    server = serving(start_gunicorn(workers=4, env=patient, wait=False))
    held = held_creations(count=500_000)
    first = in_background(post, server.url, "order-1", SLOWPOKE, api_key)
    held.wait_until_held()
    with ThreadPoolExecutor(12) as pool:
        racing = list(pool.map(lambda _: post(server.url, "order-1", SLOWPOKE, api_key), range(12)))
    held.release()
    created = first()
    assert created.status_code == 201
    for answer in racing:
        if engine == "postgresql":
            assert answer.status_code == 409
            assert answer.json()["code"] == "idempotency_key_in_use"
            assert answer.headers["Retry-After"] == "1"
        else:
            assert answer.status_code == 201
            assert answer.headers["Idempotent-Replayed"] == "true"
            assert answer.json() == created.json()
    again = post(server.url, "order-1", SLOWPOKE, api_key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == created.json()
    assert count_pets() == 1


def test_a_keyed_creation_waits_for_a_locked_table_and_leaves_its_connection_as_it_was(
    app, auth, postgres_url
):
    """The claim's short lock wait is its own: the creation's INSERT still waits for a table
    locked a moment (a migration's lock, say), and nothing the claim set outlives its
    transaction on the pooled connections."""
    held = LockedPets(make_url(postgres_url))
    client = app.test_client()
    headers = auth | {"Idempotency-Key": "order-1"}
    first = in_background(lambda: client.post("/v1/pets", json=SLOWPOKE, headers=headers))
    held.wait_until_held()
    time.sleep(0.5)  # five times the claim's wait
    held.release()
    assert first().status_code == 201
    with app.app_context(), db.engine.connect() as one, db.engine.connect() as other:
        for connection in (one, other):
            shown = [
                connection.execute(sa.text(f"SHOW {name}")).scalar_one()
                for name in ("lock_timeout", "client_connection_check_interval")
            ]
            assert shown == ["0", "0"]
