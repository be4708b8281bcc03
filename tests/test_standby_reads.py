"""Reads on the standbys (DATABASE_READ_URL, animal_store/data/standbys.py): never older than
the client's own writes, walks exact across standbys of different lags, never a standby's 404,
and a standby down, frozen, lagging or promoted costing nothing but a read on the primary.

One cluster for the module (CI's time): a primary and two streaming standbys of the tests' own
(tests/postgres_cluster.py), one replaying everything at once, the other `recovery_min_apply_delay`
behind, so it lags for real (and the first one's replay paused where a test needs it behind at
once). Where a read went is read on the servers themselves: each logs its statements
(log_statement=all), and a test counts the checks and the reads of the pets table in each log. A
test of routing that could not tell would prove nothing.

Two apps on test clients stand for two instances: a gunicorn each would add seconds of boots to
a CI run over its budget, and nothing of a read's routing is shared between processes. So these
run in the pass without TEST_DATABASE_URL.
"""

import secrets
import time

import pytest
from conftest import migrate_to_head, start_own_cluster
from prometheus_client import REGISTRY

from animal_store import create_app
from animal_store.access.auth import issue_key
from animal_store.data import standbys as standbys_module
from animal_store.extensions import db
from animal_store.settings import SettingsError

# The delayed standby replays each commit this long after the primary made it.
DELAY = 3
# A read of the pets table, as each server logs it (a page or an animal).
PETS_READ = "FROM pets"
CHECK = "pg_is_in_recovery()"


class Log:
    """A server's log from now on: what it ran since."""

    def __init__(self, server):
        self.server = server
        self.start = len(server.log())

    def count(self, text):
        return self.server.log()[self.start :].count(text)


@pytest.fixture(scope="module")
def cluster():
    """A primary, a standby that keeps up and one DELAY seconds behind."""
    primary = start_own_cluster(replication="async")
    try:
        # Every statement logged, on the standbys too (they copy the primary's settings).
        primary.sql("ALTER SYSTEM SET log_statement = 'all'; SELECT pg_reload_conf();")
        url = primary.create_database("store")
        migrate_to_head(url)
        fresh = primary.standby()
        delayed = primary.standby()
        delayed.sql(
            f"ALTER SYSTEM SET recovery_min_apply_delay = '{DELAY}s'; SELECT pg_reload_conf();"
        )
        yield {"primary": primary, "fresh": fresh, "delayed": delayed, "url": url}
    finally:
        for standby in primary.standbys:
            standby.stop()
        primary.stop()


@pytest.fixture
def make_app(cluster):
    """Apps on the module's primary, reading from the standbys named (by their clusters, or a URL
    of the test's); closed after."""
    apps = []

    def make(*servers, read_url=None, **settings):
        if read_url is None:
            hosts = ",".join(server.host_port for server in servers)
            read_url = f"postgresql://postgres@{hosts}/store"
            if len(servers) > 1:
                read_url += "?load_balance_hosts=random&target_session_attrs=standby"
        config = {
            "TESTING": True,
            "DATABASE_URL": cluster["url"],
            "DATABASE_READ_URL": read_url,
            "RATELIMIT_ENABLED": False,
            "METRICS_WRITE_INTERVAL": 0,
            "DATABASE_DEADLINE": 2,
            "ANSWER_CACHE_BYTES": 0,  # every read reaches a server
            **settings,
        }
        apps.append(create_app(config))
        return apps[-1]

    yield make
    for app in apps:
        with app.app_context():
            db.engine.dispose()
        app.extensions[standbys_module.STATE].close()


@pytest.fixture
def make_auth(make_app, cluster):
    """Headers with a new key of the test's own."""
    keys = make_app(cluster["fresh"])

    def make(name="reader"):
        with keys.app_context():
            # The module's tests share one database, where a key's name is unique.
            _, key = issue_key(f"{name}-{secrets.token_hex(4)}")
            db.session.commit()
        return {"Authorization": f"Bearer {key}"}

    return make


def create(client, auth, name="Rex"):
    answer = client.post("/v1/pets", json={"name": name, "categoryId": 1}, headers=auth)
    assert answer.status_code == 201, answer.get_json()
    return answer.get_json()["id"]


def walk(clients, auth, limit=5):
    """Every id a walk of pages shows, its pages asked of each client in turn."""
    seen, url, page = [], f"/v1/pets?limit={limit}", 0
    while url:
        answer = clients[page % len(clients)].get(url, headers=auth)
        assert answer.status_code == 200, answer.get_json()
        seen += [pet["id"] for pet in answer.get_json()]
        link = answer.headers.get("Link")
        url = link[link.index("/v1/") : link.index(">")] if link else None
        page += 1
    return seen


def reads(server):
    return REGISTRY.get_sample_value("animal_store_database_reads_total", {"server": server}) or 0


def sent_back(reason):
    return (
        REGISTRY.get_sample_value(
            "animal_store_database_reads_sent_to_primary_total", {"reason": reason}
        )
        or 0
    )


def test_clients_read_their_own_creations_through_either_instance(cluster, make_app, make_auth):
    # One instance reads from the standby that keeps up, the other from the one DELAY s behind:
    # each client creates through one and at once reads by id and lists through the other.
    fresh, delayed = make_app(cluster["fresh"]), make_app(cluster["delayed"])
    clients = (fresh.test_client(), delayed.test_client())
    logs = {name: Log(cluster[name]) for name in ("primary", "fresh", "delayed")}
    on_primary = reads("primary")
    missing = not_found = 0
    for round_ in range(12):
        auth = make_auth(f"client{round_}")
        writer, reader = clients[round_ % 2], clients[1 - round_ % 2]
        pet_id = create(writer, auth)
        got = reader.get(f"/v1/pets/{pet_id}", headers=auth)
        not_found += got.status_code == 404
        listed = reader.get("/v1/pets?limit=100", headers=auth)
        missing += pet_id not in {pet["id"] for pet in listed.get_json()}
    assert (missing, not_found) == (0, 0)
    # Reads did go to the standby that keeps up (most: one may come before it has replayed the
    # creation, and go to the primary); the delayed one's went to the primary, which ran them:
    # the animal not found there, the list's last page short of the primary's position (or the
    # standby's lag unknown: it has replayed no commit since it started).
    assert logs["fresh"].count(PETS_READ) >= 3
    assert logs["delayed"].count(CHECK) >= 1
    assert logs["primary"].count(PETS_READ) >= 12
    assert reads("primary") - on_primary >= 12


def test_walks_across_standbys_of_different_lags_are_exact(cluster, make_app, make_auth):
    writer = make_auth("writer")
    fresh, delayed = make_app(cluster["fresh"]), make_app(cluster["delayed"])
    clients = [fresh.test_client(), delayed.test_client()]
    before = set(walk(clients, make_auth("before")))
    created = {create(clients[0], writer) for _ in range(17)}
    # Each instance learns what is settled (a walk's last page asks), then the delayed standby
    # replays past it.
    for client in clients:
        walk([client], writer, limit=100)
    cluster["delayed"].wait_for_replay()
    logs = {name: Log(cluster[name]) for name in ("fresh", "delayed")}
    walker = make_auth("walker")
    seen, url, page = [], "/v1/pets?limit=4", 0
    while url:
        answer = clients[page % 2].get(url, headers=walker)
        seen += [pet["id"] for pet in answer.get_json()]
        link = answer.headers.get("Link")
        url = link[link.index("/v1/") : link.index(">")] if link else None
        page += 1
        create(clients[page % 2], writer)  # acknowledged after the walk began: either way
    assert seen == sorted(set(seen)), "each animal once, in id order"
    assert before | created <= set(seen)
    # Pages came from both standbys.
    assert logs["fresh"].count(PETS_READ) >= 2
    assert logs["delayed"].count(PETS_READ) >= 2


def test_a_walks_last_page_holds_every_creation_acknowledged_before_it_began(
    cluster, make_app, make_auth
):
    # Another client's creation, acknowledged before the walk began. The standby has replayed
    # what the app last knew settled, and then stops replaying (a standby falling behind).
    app = make_app(cluster["fresh"])
    client, writer, walker = app.test_client(), make_auth("writer"), make_auth("walker")
    walk([client], writer, limit=100)
    cluster["fresh"].wait_for_replay()
    cluster["fresh"].sql("SELECT pg_wal_replay_pause()")
    try:
        pet_id = create(client, writer)
        walk_sent_back = sent_back("walk")
        assert pet_id in walk([client], walker, limit=100)
        assert sent_back("walk") == walk_sent_back + 1
    finally:
        cluster["fresh"].sql("SELECT pg_wal_replay_resume()")


def test_one_standby_caught_up_leaves_the_other_checked(cluster, make_app, make_auth):
    # GitLab's first bug: a client unstuck because ONE replica had replayed its write, then read
    # from another that had not. Here both standbys behind one URL (libpq's host list, a host
    # taken at random for each connection): each read checks the server it reads from.
    both = make_app(cluster["fresh"], cluster["delayed"])
    client = both.test_client()
    auth = make_auth()
    pet_id = create(client, auth)
    cluster["fresh"].wait_for_replay()
    logs = {name: Log(cluster[name]) for name in ("fresh", "delayed")}
    walk_sent_back, on_standby = sent_back("walk"), reads("standby")
    for _ in range(10):
        # A new connection each time, to a server libpq picks.
        both.extensions[standbys_module.STATE].engine.dispose()
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        both.extensions[standbys_module.STATE].engine.dispose()
        listed = client.get("/v1/pets?limit=100", headers=auth).get_json()
        assert pet_id in {pet["id"] for pet in listed}
    # Both were tried (20 random picks: 2 in a million tests see one alone). The one that keeps
    # up served reads; the delayed one, within DELAY s of the creation, was checked and its
    # last pages went to the primary.
    assert logs["fresh"].count(PETS_READ) >= 1
    assert logs["delayed"].count(CHECK) >= 1
    assert reads("standby") > on_standby
    assert sent_back("walk") > walk_sent_back


def test_a_write_after_a_read_on_a_standby_is_read_at_once(cluster, make_app, make_auth):
    # GitLab's second bug: a write between the check and the "unsticking" after a read on a
    # replica was lost to it. Here nothing is kept per client, so nothing sticks or unsticks:
    # a creation right after a read served by a standby is seen by the next read, by id and in
    # the list, though the standby has not replayed it.
    writer, reader = make_app(cluster["fresh"]), make_app(cluster["fresh"])
    auth = make_auth()
    create(writer.test_client(), auth)
    cluster["fresh"].wait_for_replay()
    client = reader.test_client()
    on_standby = reads("standby")
    assert client.get("/v1/pets?limit=1", headers=auth).status_code == 200
    assert reads("standby") == on_standby + 1
    cluster["fresh"].sql("SELECT pg_wal_replay_pause()")
    try:
        pet_id = create(writer.test_client(), auth)
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        assert pet_id in walk([client], auth, limit=100)
    finally:
        cluster["fresh"].sql("SELECT pg_wal_replay_resume()")


def test_a_standby_replaced_under_a_connection_is_checked_anew(cluster, make_app, make_auth):
    # GitLab's third bug: the hosts changed between the check and the read, which went to a
    # host nobody checked. A connection stays on one server, and what it saw dies with it: the
    # standby that keeps up, stopped right after a read checked it, leaves the host list's next
    # one to be checked before it reads, even within the second a check stands for.
    app = make_app(
        read_url=f"postgresql://postgres@{cluster['fresh'].host_port},"
        f"{cluster['delayed'].host_port}/store?target_session_attrs=standby"
    )
    client = app.test_client()
    auth = make_auth()
    pet_id = create(client, auth)
    cluster["fresh"].wait_for_replay()
    assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
    delayed_log = Log(cluster["delayed"])
    cluster["fresh"].kill()
    try:
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        assert delayed_log.count(CHECK) == 1
    finally:
        cluster["fresh"].start()
        cluster["primary"].wait_for_streaming(cluster["fresh"])


def test_a_frozen_standby_costs_a_read_on_the_primary(cluster, make_app, make_auth):
    app = make_app(cluster["fresh"])
    client = app.test_client()
    auth = make_auth()
    pet_id = create(client, auth)
    cluster["fresh"].wait_for_replay()
    assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
    on_standby, down = reads("standby"), sent_back("down")
    cluster["fresh"].freeze()
    try:
        started = time.monotonic()
        answers = [client.get(f"/v1/pets/{pet_id}", headers=auth) for _ in range(3)]
        waited = time.monotonic() - started
        # Past the engine's own pause after a missed deadline (deadlines.RETRY_INTERVAL, 1 s),
        # within the standbys' (2 s).
        time.sleep(1.2)
        started = time.monotonic()
        answers.append(client.get("/v1/pets?limit=100", headers=auth))
        paused = time.monotonic() - started
    finally:
        cluster["fresh"].thaw()
    assert [answer.status_code for answer in answers] == [200] * 4
    assert pet_id in {pet["id"] for pet in answers[-1].get_json()}
    # One read waited out its share of the deadline (1 s of 2); the rest went straight to the
    # primary.
    assert 0.9 < waited < 3
    assert paused < 0.9
    assert sent_back("down") - down == 4
    assert reads("standby") == on_standby
    # Back on the standby once it answers and the pause is over.
    time.sleep(standbys_module.RETRY_INTERVAL)
    deadline = time.monotonic() + 10
    while reads("standby") == on_standby and time.monotonic() < deadline:
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        time.sleep(0.1)
    assert reads("standby") > on_standby


def test_a_lagging_standby_serves_no_read(cluster, make_app, make_auth):
    app = make_app(cluster["delayed"], DATABASE_READ_MAX_LAG=1)
    client = app.test_client()
    create(client, make_auth("writer"))
    received = "SELECT pg_last_wal_receive_lsn() > pg_last_wal_replay_lsn()"
    while cluster["delayed"].sql(received).strip() != "t":
        time.sleep(0.01)
    # Only the lag keeps the read off the standby, which has not replayed
    # the creation DELAY s after it.
    lag = sent_back("lag")
    answer = client.get("/v1/pets?limit=100", headers=make_auth())
    assert answer.status_code == 200
    assert sent_back("lag") == lag + 1


def test_a_promoted_standby_serves_no_read(cluster, make_app, make_auth):
    standby = cluster["primary"].standby()
    try:
        app = make_app(standby)
        client = app.test_client()
        auth = make_auth()
        pet_id = create(client, auth)
        standby.wait_for_replay()
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        standby.promote()
        # A check stands for a second: within it the promoted server, whose animals are still
        # the primary's, may answer by id; not after.
        time.sleep(standbys_module.CHECK_EVERY)
        log = Log(standby)
        promoted = sent_back("promoted")
        # Written on the primary after the promotion: the promoted server never has it.
        later = create(client, auth)
        for url in (f"/v1/pets/{pet_id}", f"/v1/pets/{later}", "/v1/pets?limit=100"):
            assert client.get(url, headers=auth).status_code == 200
        assert later in walk([client], auth, limit=100)
        assert sent_back("promoted") >= promoted + 3
        assert log.count(PETS_READ) == 0
    finally:
        cluster["primary"].standbys.remove(standby)
        standby.stop()


@pytest.mark.parametrize("primary", [None, "sqlite:////tmp/store.sqlite3"])
def test_standbys_beside_sqlite_are_refused_at_boot(primary):
    with pytest.raises(SettingsError) as refused:
        create_app(
            {
                "DATABASE_URL": primary,
                "DATABASE_READ_URL": "postgresql://store@127.0.0.1:5433/store",
            }
        )
    assert refused.value.format_message() == (
        "Setting DATABASE_READ_URL names standbys, which only a PostgreSQL DATABASE_URL has: "
        "unset it, or set DATABASE_URL to the primary's PostgreSQL URL."
    )
