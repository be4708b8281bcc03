"""The loss of the database machine: several hosts in DATABASE_URL, a server that takes only
reads, a standby promoted under load, and workers that forget what they kept from a database
that is no longer there (animal_store/data/failover.py, docs/deploy.rst, High availability).

The clusters are the tests' own (tests/postgres_cluster.py): a primary and a streaming standby,
killed and promoted by PID, never the machine's PostgreSQL. So these run in the pass without
TEST_DATABASE_URL.
"""

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from urllib.parse import quote

import pytest
import requests
import sqlalchemy as sa
from conftest import migrate_to_head, start_own_cluster
from flask import g
from pgbouncer_server import PGBOUNCER, PgBouncer
from sqlalchemy.engine import make_url
from test_passwords import PASSWORD, USER, assert_masked, assert_no_password
from test_releases import Load, details, walk

from animal_store import create_app
from animal_store.access import auth as auth_module
from animal_store.access.auth import issue_key
from animal_store.data import answers
from animal_store.data.database import describe_database
from animal_store.data.failover import CONFIRM_EVERY, primary_fails
from animal_store.extensions import db
from animal_store.settings import SettingsError

# The same two hosts in libpq's spelling and in SQLAlchemy's.
SPELLINGS = {
    "libpq's": f"postgresql://{USER}:{PASSWORD}@127.0.0.1:5432,127.0.0.2:5433/store"
    "?target_session_attrs=read-write",
    "SQLAlchemy's": f"postgresql://{USER}:{PASSWORD}@/store"
    "?host=127.0.0.1:5432&host=127.0.0.2:5433&target_session_attrs=read-write",
}


@pytest.mark.parametrize("url", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_several_hosts_in_either_spelling_reach_libpq_alike(url):
    app = create_app({"DATABASE_URL": url})
    with app.app_context():
        _, parameters = db.engine.dialect.create_connect_args(db.engine.url)
        described = describe_database()
    assert parameters["host"] == "127.0.0.1,127.0.0.2"
    assert parameters["port"] == "5432,5433"
    assert parameters["target_session_attrs"] == "read-write"
    assert parameters["password"] == PASSWORD
    assert_masked(described)
    assert "127.0.0.2" in described


# Several hosts the driver cannot read: refused at boot in one line, not at the first connection
# with a traceback.
UNREADABLE_HOSTS = {
    "IPv6 addresses": f"postgresql://{USER}:{PASSWORD}@[::1]:5432,[::2]:5433/store",
    "the ports given apart": f"postgresql://{USER}:{PASSWORD}@127.0.0.1,127.0.0.2/store?port=1,2",
}


@pytest.mark.parametrize("url", UNREADABLE_HOSTS.values(), ids=UNREADABLE_HOSTS.keys())
def test_several_hosts_the_driver_cannot_read_are_refused_at_boot(url):
    with pytest.raises(SettingsError) as refused:
        create_app({"DATABASE_URL": url})
    said = refused.value.format_message()
    assert said.startswith("Setting DATABASE_URL from test_config is ")
    assert "expected a database URL" in said
    assert_no_password(said)


def test_several_hosts_keep_the_rest_of_the_url():
    secret = PASSWORD + "/1"  # percent-encoded in the URL, as deploy step 3 says
    url = (
        f"postgresql://{USER}:{quote(secret, safe='')}@127.0.0.1,127.0.0.2/store"
        "?sslmode=disable&application_name=x"
    )
    app = create_app({"DATABASE_URL": url})
    with app.app_context():
        _, parameters = db.engine.dialect.create_connect_args(db.engine.url)
    assert parameters["password"] == secret
    assert (parameters["host"], parameters["dbname"]) == ("127.0.0.1,127.0.0.2", "store")
    assert (parameters["sslmode"], parameters["application_name"]) == ("disable", "x")


def test_a_new_connection_tries_the_primary_first_and_the_host_a_connection_failed_on_last():
    # DATABASE_URL lists another host first and the primary second. The other accepts each
    # connection and closes it at once (libpq then goes on to the next host), counting them: it
    # was tried first when it counts one more.
    cluster = start_own_cluster()
    other = socket.create_server(("127.0.0.1", 0))
    tried = []

    def accept():
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                connection, _ = other.accept()
                tried.append(1)
                connection.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        url = make_url(cluster.database_url("postgres")).set(
            host=None,
            port=None,
            query={"host": [f"127.0.0.1:{other.getsockname()[1]}", cluster.host_port]},
        )
        app = create_app({"DATABASE_URL": url.render_as_string(hide_password=False)})

        def first_tried():
            # A new connection in a request, with its deadline, as the app connects.
            with app.app_context():
                db.engine.dispose()
                before = len(tried)
                with app.test_request_context():
                    g.database_deadline = time.monotonic() + 5
                    with db.engine.connect() as connection:
                        connection.execute(sa.text("SELECT 1"))
                return "other" if len(tried) > before else "primary"

        # Nothing known yet: the list's order. The primary reached, it goes first, and stays
        # first after a read of the primary failed without a connection failing (an attempt that
        # ran out of time says nothing of which host hung).
        assert first_tried() == "other"
        assert first_tried() == "primary"
        with app.app_context():
            primary_fails()
        assert first_tried() == "primary"
        # A connection to it failed once made (cut, dropped): it goes last, until a new
        # connection reaches a primary there again.
        with app.app_context(), db.engine.connect() as connection:
            connection.invalidate(RuntimeError("cut at its deadline"))
        assert first_tried() == "other"
        assert first_tried() == "primary"
        with app.app_context():
            db.engine.dispose()
    finally:
        other.close()
        cluster.stop()


def test_a_worker_keeps_what_it_read_while_its_server_stays_and_forgets_it_on_a_restart(make_app):
    cluster = start_own_cluster()
    try:
        migrate_to_head(cluster.create_database("store"))
        app = make_app(DATABASE_URL=cluster.database_url("store"))
        client = app.test_client()
        auth = {"Authorization": f"Bearer {make_key(cluster.database_url('store'))}"}
        created = client.post("/v1/pets", headers=auth, json={"name": "Rex", "categoryId": 1})
        path = f"/v1/pets/{created.get_json()['id']}"
        assert client.get(path, headers=auth).status_code == 200
        kept = {memo: app.extensions[memo] for memo in (answers.KEPT, auth_module.KEY_CACHE)}

        time.sleep(CONFIRM_EVERY + 0.1)
        assert client.get(path, headers=auth).status_code == 200  # asked: the same server
        assert all(app.extensions[memo] is kept[memo] for memo in kept)

        cluster.kill()  # and back, as a restarted machine: another server, started anew
        cluster.start()
        time.sleep(CONFIRM_EVERY + 0.1)
        assert client.get(path, headers=auth).status_code == 200
        assert all(app.extensions.get(memo) is not kept[memo] for memo in kept)
    finally:
        cluster.stop()


class ReadOnlyByDefault:
    """A server whose sessions' transactions read only, by default_transaction_read_only."""

    def __init__(self):
        self.cluster = start_own_cluster()
        migrate_to_head(self.cluster.create_database("store"))
        self.url = self.cluster.database_url("store")
        self.server = self.cluster

    def key(self):
        return make_key(self.url)

    def make_read_only(self):
        # Each session's next transaction, a pooled one's too: a reload reaches them all.
        self.cluster.sql(
            "ALTER SYSTEM SET default_transaction_read_only = on; SELECT pg_reload_conf()"
        )

    def make_writable(self):
        self.cluster.sql(
            "ALTER SYSTEM RESET default_transaction_read_only; SELECT pg_reload_conf()"
        )

    def stop(self):
        self.cluster.stop()


class HotStandby:
    """A streaming standby named alone in DATABASE_URL, promoted to take writes."""

    def __init__(self):
        self.primary = start_own_cluster(replication="async")
        migrate_to_head(self.primary.create_database("store"))
        self.server = self.primary.standby()
        self.url = self.server.database_url("store")

    def key(self):
        key = make_key(self.primary.database_url("store"))
        self.server.wait_for_replay()
        return key

    def make_read_only(self):
        pass  # it is

    def make_writable(self):
        self.primary.kill()
        self.server.promote()

    def stop(self):
        self.primary.stop()
        self.server.stop()


def backend_pids(cluster):
    """The PIDs of the backends serving the store's clients (not this query's own)."""
    listed = cluster.sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = 'store' AND pid <> pg_backend_pid()"
    )
    return {int(pid) for pid in listed.split()}


READ_ONLY = {"default_transaction_read_only": ReadOnlyByDefault, "a hot standby": HotStandby}


@pytest.mark.parametrize("server", READ_ONLY.values(), ids=READ_ONLY.keys())
def test_a_server_that_takes_only_reads_is_an_outage_not_a_bug(make_app, server):
    server = server()
    try:
        app = make_app(DATABASE_URL=server.url)
        client = app.test_client()
        auth = {"Authorization": f"Bearer {server.key()}"}

        server.make_read_only()
        refused = client.post("/v1/pets", headers=auth, json={"name": "Max", "categoryId": 1})
        assert refused.status_code == 503
        assert refused.get_json() == {
            "code": "service_unavailable",
            "message": "The database takes no writes just now; retry later.",
            "status": 503,
        }
        assert refused.headers["Retry-After"] == "5"
        connected = backend_pids(server.server)
        for _ in range(2):  # a checkout of each connection the pool holds
            ready = client.get("/readyz")
            assert (ready.status_code, ready.get_json()["message"]) == (
                503,
                "The database takes no writes just now; retry later.",
            )
        # The refused connection, and every other the pool held then, was dropped: the next
        # requests connected again (to whichever host takes writes, given several).
        deadline = time.monotonic() + 5
        while connected & backend_pids(server.server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not connected & backend_pids(server.server)

        # Writable again: served again, without a restart.
        server.make_writable()
        assert client.get("/readyz").status_code == 200
        created = client.post("/v1/pets", headers=auth, json={"name": "Max", "categoryId": 1})
        assert created.status_code == 201
        with app.app_context():
            names = db.session.scalars(sa.text("SELECT name FROM pets ORDER BY id")).all()
        assert names == ["Max"]
    finally:
        server.stop()


def own_primary(replication):
    """A primary of the test's own with a migrated database and a streaming standby; return
    (primary, standby, the service's URL naming both, libpq's way)."""
    primary = start_own_cluster(replication=replication)
    try:
        migrate_to_head(primary.create_database("store"))
        standby = primary.standby()
    except BaseException:
        primary.stop()
        raise
    hosts = f"{primary.host_port},{standby.host_port}"
    return primary, standby, f"postgresql://postgres@{hosts}/store?target_session_attrs=read-write"


def make_key(url):
    """A key with a limit no test reaches, stored where the URL leads (the primary)."""
    app = create_app({"DATABASE_URL": url})
    with app.app_context():
        _, key = issue_key("tester", rate_limit="1000000/minute")
        db.session.commit()
        db.engine.dispose()
    return key


def stored_ids(cluster):
    return [int(each) for each in cluster.sql("SELECT id FROM pets ORDER BY id", "store").split()]


def outage_answer(status, retry_after, body):
    """The one answer an outage may give: the JSON 503 with Retry-After."""
    return status == 503 and retry_after is not None and body.get("status") == 503


def wait_for_a_creation(load, moment, timeout=10):
    """Return how long after `moment` the load's first creation was acknowledged."""
    deadline = moment + timeout
    while True:
        created = [when for when, status, *_ in load.answers if when > moment and status == 201]
        if created or time.monotonic() > deadline:
            assert created, f"no creation within {timeout}s: {load.statuses}"
            return min(created) - moment
        time.sleep(0.05)


def answer_kinds(load):
    """The load's answers counted as "ok" (2xx), "503" (the outage's JSON 503) or their status."""
    return Counter(
        "ok" if status in (200, 201) else "503" if outage_answer(status, *rest) else status
        for _, status, *rest in load.answers
    )


@pytest.mark.parametrize("replication", ["sync", "async"])
def test_a_standby_promoted_under_load_takes_over_without_a_restart(start_gunicorn, replication):
    primary, standby, url = own_primary(replication)
    try:
        key = make_key(url)
        gunicorn = start_gunicorn(workers=2, database=url)
        with Load(gunicorn.url, "", key) as load:
            load.wait_for_answers(200)
            primary.kill()
            killed = time.monotonic()
            time.sleep(1)
            promoting = time.monotonic()
            standby.promote()
            first_creation = wait_for_a_creation(load, promoting)
            load.wait_for_answers(200)
        kinds = answer_kinds(load)
        during = Counter(status for when, status, *_ in load.answers if killed < when < promoting)
        stored = stored_ids(standby)
        lost = sorted({pet["id"] for pet in load.acknowledged} - set(stored))
        print(
            f"{replication}: answers {dict(kinds)}, between the kill and the promotion "
            f"{dict(during)}; first creation {first_creation:.2f}s after the promotion began; "
            f"{len(lost)} of {len(load.acknowledged)} acknowledged animals lost"
        )
        assert set(kinds) <= {"ok", "503"}, load.failures[:5]
        assert first_creation < 5
        if replication == "sync":
            assert lost == []
        walked = walk(gunicorn.url, "", key)
        assert [pet["id"] for pet in walked] == stored
    finally:
        primary.stop()
        standby.stop()


def test_workers_forget_what_they_kept_from_a_database_that_lost_it(start_gunicorn):
    """Asynchronous replication, the standby's WAL receiver frozen: the animals created then
    are lost at the promotion, and their ids given out again. No worker answers from what it
    kept of them: every read answers what the promoted database holds."""
    primary, standby, url = own_primary("async")
    try:
        key = make_key(url)
        auth = {"Authorization": f"Bearer {key}"}
        gunicorn = start_gunicorn(workers=2, database=url)
        with requests.Session() as client:
            client.headers.update(auth)

            def post(name):
                body = {"name": name, "categoryId": 1}
                return client.post(f"{gunicorn.url}/v1/pets", json=body, timeout=10)

            def create(name):
                created = post(name)
                assert created.status_code == 201, created.text
                return created.json()["id"]

            def read_everything(ids):
                """Each animal, and every page of 5 walking the list, four times: both workers
                answer each. Return {id: its answers} and the walks' ids."""
                answers, walks = {}, []
                for _ in range(4):
                    for pet_id in ids:
                        got = client.get(f"{gunicorn.url}/v1/pets/{pet_id}", timeout=10)
                        answers.setdefault(pet_id, set()).add((got.status_code, got.text))
                    walked, next_url = [], f"{gunicorn.url}/v1/pets?limit=5"
                    while next_url:
                        page = client.get(next_url, timeout=10)
                        assert page.status_code == 200, page.text
                        walked += [pet["id"] for pet in page.json()]
                        next_url = page.links.get("next", {}).get("url")
                    walks.append(walked)
                return answers, walks

            settled = [create(f"settled-{n}") for n in range(10)]
            standby.wait_for_replay()
            os.kill(standby.wal_receiver_pid(), signal.SIGSTOP)
            # More than PostgreSQL logs a sequence ahead (32): the promoted one hands some out
            # again.
            lost = [create(f"lost-{n}") for n in range(60)]
            read_everything(settled + lost)  # kept by the workers

            os.kill(standby.wal_receiver_pid(), signal.SIGKILL)
            primary.kill()
            standby.promote()
            promoted = time.monotonic()
            assert stored_ids(standby) == settled
            deadline = promoted + 10
            reused = []
            while len(reused) < 60 and time.monotonic() < deadline:
                created = post(f"new-{len(reused)}")
                if created.status_code == 201:
                    reused.append(created.json()["id"])
                else:  # the JSON 503, until the workers reach the new primary
                    assert outage_answer(created.status_code, *details(created)), created.text
                    time.sleep(0.1)
            again = sorted(set(reused) & set(lost))
            print(f"{len(lost)} animals lost at the promotion, ids {again[0]}-{again[-1]} reused")
            assert again, "no id was given out again: the test would prove nothing"
            # What a worker kept, it answers from for at most failover.CONFIRM_EVERY more.
            time.sleep(max(0.0, promoted + CONFIRM_EVERY - time.monotonic()))
            answers, walks = read_everything(settled + lost + reused)

        rows = standby.sql("SELECT id, name FROM pets", "store").split()
        names = dict(row.split("|") for row in rows)
        for pet_id in settled + lost + reused:
            name = names.get(str(pet_id))
            statuses = {status for status, _ in answers[pet_id]}
            said = {json.loads(text).get("name") for _, text in answers[pet_id]}
            assert (statuses, said) == (({200}, {name}) if name else ({404}, {None})), pet_id
        assert walks == [stored_ids(standby)] * 4
    finally:
        primary.stop()
        standby.stop()


@pytest.mark.skipif(PGBOUNCER is None, reason="PgBouncer is not installed (Debian: pgbouncer)")
def test_pgbouncer_repointed_at_the_promoted_standby_serves_again(start_gunicorn):
    """PgBouncer names one server (it cannot follow a failover): the operator's steps of
    docs/deploy.rst, its line edited and a reload, and the service serves again, unrestarted."""
    primary, standby, _ = own_primary("sync")
    bouncer = None
    try:
        bouncer = PgBouncer(make_url(primary.database_url("store")), "postgres", pool_size=4)
        bouncer.wait_until_serving()
        url = bouncer.url.render_as_string(hide_password=False)
        key = make_key(primary.database_url("store"))
        env = {"ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true"}
        gunicorn = start_gunicorn(workers=2, env=env, database=url)
        with Load(gunicorn.url, "", key) as load:
            load.wait_for_answers(200)
            primary.kill()
            standby.promote()
            repointed = time.monotonic()
            bouncer.repoint(make_url(standby.database_url("store")))
            first_creation = wait_for_a_creation(load, repointed)
            load.wait_for_answers(200)
        kinds = answer_kinds(load)
        print(f"PgBouncer: answers {dict(kinds)}; first creation {first_creation:.2f}s after it")
        assert set(kinds) <= {"ok", "503"}, load.failures[:5]
        assert first_creation < 5
        stored = stored_ids(standby)
        assert not {pet["id"] for pet in load.acknowledged} - set(stored)
        assert [pet["id"] for pet in walk(gunicorn.url, "", key)] == stored
    finally:
        if bouncer is not None:
            bouncer.stop()
        primary.stop()
        standby.stop()
