"""Reads on the standbys (DATABASE_READ_URL, animal_store/data/standbys.py): never older than
the client's own writes, walks exact across standbys of different lags, never a standby's 404,
and a standby down, frozen, lagging or promoted costing nothing but a read on the primary.

One cluster for the module (CI's time): a primary and two streaming standbys of the tests' own
(tests/postgres_cluster.py), one replaying everything at once, the other `recovery_min_apply_delay`
behind, so it lags for real (and the first one's replay paused where a test needs it behind at
once). Where a read went is read on the servers themselves: each logs its statements
(log_statement=all), and a test counts the checks and the reads of the pets table in each log. A
test of routing that could not tell would prove nothing.

One test runs clients through two gunicorn instances under load while standbys are stopped,
frozen and promoted; the others, each one scenario, run apps on test clients (two apps stand for
two instances: nothing of a read's routing is shared between processes), which spares CI a
gunicorn's boots each. They run in the pass without TEST_DATABASE_URL (clusters of their own).
"""

import contextlib
import logging
import re
import secrets
import threading
import time
from collections import Counter

import pytest
import requests
from conftest import Gunicorn, migrate_to_head, start_own_cluster
from prometheus_client import REGISTRY
from test_documented_steps import block_with
from test_documented_steps import read as read_doc

from animal_store import create_app
from animal_store.access.auth import issue_key
from animal_store.data import failover
from animal_store.data import standbys as standbys_module
from animal_store.extensions import db
from animal_store.settings import SettingsError

# The delayed standby replays each commit this long after the primary made it.
DELAY = 3
# A read of the pets table, as each server logs it (a page or an animal).
PETS_READ = "FROM pets"
CHECK = "pg_is_in_recovery()"
# The first page of the animals sold: a test's few, however many others the module made.
SOLD = "/v1/pets?status=sold&limit=100"


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


def create(client, auth, name="Rex", **fields):
    body = {"name": name, "categoryId": 1, **fields}
    answer = client.post("/v1/pets", json=body, headers=auth)
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


class Clients:
    """Clients, each with a key of its own, that create through one gunicorn instance and at
    once read the animal back by id and list it through the other, round after round, until
    stopped. Every answer is kept; a read that misses the client's own creation, a 404 for it,
    or a body that is not what was created is counted. Each list is a tail walk: the page the
    client's last walk ended on, asked again, and its next pages, so every walk's ids can be
    held to the primary's at the end."""

    def __init__(self, instances, auths):
        self.instances = instances
        self.auths = auths
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.statuses = Counter()
        self.failures = []
        self.shown = {}  # id: name, as each read showed it
        self.walks = []  # each walk's ids, in order
        self.rounds = 0
        self.threads = [
            threading.Thread(target=self.run, args=(n,), daemon=True) for n in range(len(auths))
        ]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def answer(self, response):
        """Count the answer; return it if 2xx, else None (a 503 must say when to retry)."""
        with self.lock:
            self.statuses[response.status_code] += 1
            if response.status_code >= 300 and not (
                response.status_code == 503
                and response.headers.get("Retry-After")
                and response.json().get("code")
            ):
                self.failures.append((response.status_code, response.text[:200]))
        return response if response.status_code < 300 else None

    def run(self, n):
        auth = self.auths[n]
        writer, reader = self.instances[n % 2].url, self.instances[1 - n % 2].url
        tail = f"{reader}/v1/pets?limit=20"
        with requests.Session() as session:
            while not self.stopping.is_set():
                name = f"client{n}-{secrets.token_hex(4)}"
                created = self.answer(
                    session.post(
                        f"{writer}/v1/pets",
                        json={"name": name, "categoryId": 1},
                        headers=auth,
                        timeout=30,
                    )
                )
                if created is None:
                    continue
                pet_id = created.json()["id"]
                # A 404 for it is a failure (answer()), as is another animal's body.
                got = self.answer(
                    session.get(f"{reader}/v1/pets/{pet_id}", headers=auth, timeout=30)
                )
                if got is not None and got.json()["name"] != name:
                    self.failures.append(("by id", pet_id, got.text[:200]))
                ids, url = [], tail
                while url:
                    page = self.answer(session.get(url, headers=auth, timeout=30))
                    if page is None:
                        break
                    with self.lock:
                        self.shown.update((pet["id"], pet["name"]) for pet in page.json())
                    ids += [pet["id"] for pet in page.json()]
                    url = page.links.get("next", {}).get("url")
                    if url is None:
                        tail = page.url
                with self.lock:
                    if url is None and pet_id not in ids:
                        self.failures.append(("missing from the list", pet_id, ids[-5:]))
                    self.walks.append(ids)
                    self.rounds += 1

    def wait_for_rounds(self, count, timeout=60):
        wanted = self.rounds + count
        deadline = time.monotonic() + timeout
        while self.rounds < wanted:
            assert time.monotonic() < deadline, f"{self.rounds} rounds; {self.failures[:3]}"
            time.sleep(0.05)


def standby_reads(instances):
    return sum(
        metric(server, 'animal_store_database_reads_total{server="standby"}')
        for server in instances
    )


def metric(server, series):
    text = requests.get(server.url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def test_through_two_instances_clients_read_their_own_writes_while_standbys_fail(
    cluster, make_auth, tmp_path
):
    # Two gunicorn instances, each reading from two standbys in libpq's host list, in order: the
    # first that is a standby and answers, the next otherwise (target_session_attrs). One reads
    # from a spare standby, then the one that keeps up; the other from the one that keeps up,
    # then the one DELAY s behind. Four clients create through one and read through the other,
    # while the spare is frozen and then promoted, and the one that keeps up stopped.
    spare = cluster["primary"].standby()
    instances = []
    try:
        for first, second in ((spare, cluster["fresh"]), (cluster["fresh"], cluster["delayed"])):
            env = {
                "DATABASE_READ_URL": f"postgresql://postgres@{first.host_port},"
                f"{second.host_port}/store?target_session_attrs=standby",
                "ANIMAL_STORE_METRICS_WRITE_INTERVAL": "0",
                "ANIMAL_STORE_ANSWER_CACHE_BYTES": "0",  # every read reaches a server
            }
            log = tmp_path / f"gunicorn-{len(instances)}.log"
            instances.append(Gunicorn(cluster["url"], 2, env, log))
        for server in instances:
            server.wait_until_serving()
        logs = {name: Log(cluster[name]) for name in ("primary", "fresh", "delayed")}
        logs["spare"] = Log(spare)
        with Clients(instances, [make_auth(f"client{n}") for n in range(4)]) as clients:
            clients.wait_for_rounds(20)
            on_standbys = standby_reads(instances)
            assert on_standbys > 0
            for name in ("fresh", "spare"):
                assert logs[name].count(PETS_READ) >= 1, name
            # Stopped: the standby that both instances read from.
            cluster["fresh"].kill()
            clients.wait_for_rounds(8)
            cluster["fresh"].start()
            cluster["primary"].wait_for_streaming(cluster["fresh"])
            # Frozen, for longer than a read's share of its deadline.
            spare.freeze()
            clients.wait_for_rounds(8)
            spare.thaw()
            # Promoted: a primary now, beside the true one; its reads must stop.
            spare.promote()
            time.sleep(standbys_module.CHECK_EVERY)
            promoted = Log(spare)
            # Reads back on the standbys once they are healthy, and the pause after a failure
            # (RETRY_INTERVAL) over: on the one that was stopped.
            time.sleep(standbys_module.RETRY_INTERVAL)
            fresh_again, back = Log(cluster["fresh"]), standby_reads(instances)
            clients.wait_for_rounds(10)
            deadline = time.monotonic() + 20
            while standby_reads(instances) == back:
                assert time.monotonic() < deadline, "no read on a standby after the faults"
                time.sleep(0.1)
            assert fresh_again.count(PETS_READ) >= 1
            assert promoted.count(PETS_READ) == 0
    finally:
        for server in instances:
            server.stop()
        cluster["primary"].standbys.remove(spare)
        spare.stop()
    assert clients.failures == []
    assert set(clients.statuses) <= {200, 201, 503}, clients.statuses
    # Nothing stale: every animal shown is the primary's, and every walk shows every animal
    # the primary has between its first and its last, in order.
    stored = dict(
        tuple(row.split("|"))
        for row in cluster["primary"].sql("SELECT id, name FROM pets", "store").split()
    )
    stored = {int(pet_id): name for pet_id, name in stored.items()}
    assert {pet_id: stored.get(pet_id) for pet_id in clients.shown} == clients.shown
    ids = sorted(stored)
    for walked in clients.walks:
        if walked:
            expected = [i for i in ids if walked[0] <= i <= walked[-1]]
            assert walked == expected, (walked, expected)
    print(f"\n{clients.rounds} rounds, answers {dict(clients.statuses)}")


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
    if len(walk([client], writer, limit=100)) % 100 == 0:
        # The module's earlier tests left a multiple of the page: the last full page would lack
        # the creation on the standby and be sent back too, and the page after it. One more makes
        # the creation land on a page that was the last.
        create(client, writer)
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
    # Sold, as only a few are: the first page of those (SOLD) holds it.
    pet_id = create(client, auth, status="sold")
    cluster["fresh"].wait_for_replay()
    logs = {name: Log(cluster[name]) for name in ("fresh", "delayed")}
    walk_sent_back, on_standby = sent_back("walk"), reads("standby")
    for _ in range(10):
        # A new connection each time, to a server libpq picks.
        both.extensions[standbys_module.STATE].engine.dispose()
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        both.extensions[standbys_module.STATE].engine.dispose()
        listed = client.get(SOLD, headers=auth).get_json()
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
    pet_id = create(client, auth, status="sold")
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
        answers.append(client.get(SOLD, headers=auth))
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


def test_a_standby_cut_off_from_the_primary_is_as_old_as_its_last_transaction(
    cluster, make_app, make_auth
):
    # A standby whose WAL receiver is gone has replayed all it received: it must not read as
    # lagging 0 s while the primary writes on without it.
    standby = cluster["primary"].standby()
    try:
        app = make_app(standby, DATABASE_READ_MAX_LAG=1)
        client = app.test_client()
        auth = make_auth()
        pet_id = create(client, auth)
        standby.wait_for_replay()
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        standby.sql("ALTER SYSTEM SET primary_conninfo = ''; SELECT pg_reload_conf();")
        while standby.sql("SELECT count(*) FROM pg_stat_wal_receiver").strip() != "0":
            time.sleep(0.05)
        # Past the bound since the last transaction it replayed, and the last check's second.
        time.sleep(1.1)
        lag = sent_back("lag")
        assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
        assert sent_back("lag") == lag + 1
        assert REGISTRY.get_sample_value("animal_store_standby_lag_seconds") > 1
    finally:
        cluster["primary"].standbys.remove(standby)
        standby.stop()


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


def test_a_role_that_cannot_see_whether_a_standby_streams_reads_on_the_primary(
    cluster, make_app, make_auth, caplog
):
    # Whether a standby streams, and on which timeline, is shown only to pg_read_all_stats
    # (docs/deploy.rst, Reads on the standbys, grants it): without it no read is safe there.
    role = f"reader_{secrets.token_hex(4)}"
    cluster["primary"].sql(f"CREATE ROLE {role} LOGIN; GRANT SELECT ON pets TO {role};", "store")
    cluster["fresh"].wait_for_replay()
    app = make_app(read_url=f"postgresql://{role}@{cluster['fresh'].host_port}/store")
    client, auth = app.test_client(), make_auth()
    pet_id = create(client, auth)
    cluster["fresh"].wait_for_replay()
    lag, on_standby = sent_back("lag"), reads("standby")
    with caplog.at_level(logging.ERROR, logger=standbys_module.LOG.name):
        for _ in range(2):
            assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
    assert (sent_back("lag"), reads("standby")) == (lag + 2, on_standby)
    said = [r.getMessage() for r in caplog.records if r.name == standbys_module.LOG.name]
    assert said == [standbys_module.HIDDEN % role]
    # The grant as docs/deploy.rst gives it, for the test's role.
    block = block_with(read_doc("deploy.rst"), "pg_read_all_stats")
    grant = re.fullmatch(r'runuser -u postgres -- psql -c "(GRANT \S+ TO) store"', block.strip())
    cluster["primary"].sql(f"{grant[1]} {role}")
    cluster["fresh"].wait_for_replay()
    app.extensions[standbys_module.STATE].engine.dispose()  # the grant applies to new sessions
    assert client.get(f"/v1/pets/{pet_id}", headers=auth).status_code == 200
    assert reads("standby") == on_standby + 1


@contextlib.contextmanager
def two_standbys_one_to_promote(make_app, replication, read_from_both, **settings):
    """A primary of the test's own and two standbys, the first to be promoted; an app with
    DATABASE_URL on that one and the primary (a standby, libpq skips it for the primary until
    then), reading from the other standby or from both; its test client and a key's header."""
    primary = start_own_cluster(replication=replication)
    try:
        url = primary.create_database("store")
        migrate_to_head(url)
        promoted, other = primary.standby(), primary.standby()
        hosts = f"{promoted.host_port},{primary.host_port}"
        app = make_app(
            *((promoted, other) if read_from_both else (other,)),
            DATABASE_URL=f"postgresql://postgres@{hosts}/store?target_session_attrs=read-write",
            **settings,
        )
        with app.app_context():
            _, key = issue_key("failover")
            db.session.commit()
        auth = {"Authorization": f"Bearer {key}"}
        yield primary, promoted, other, app.test_client(), auth
    finally:
        for standby in primary.standbys:
            standby.stop()
        primary.kill()  # killed or frozen by the test: nothing to shut down cleanly
        primary.stop()


def cut_off(standby):
    """No WAL reaches the standby after this (a frozen one would read what the kernel kept for it
    once thawed)."""
    standby.sql("ALTER SYSTEM SET primary_conninfo = ''; SELECT pg_reload_conf();")
    while standby.sql("SELECT count(*) FROM pg_stat_wal_receiver").strip() != "0":
        time.sleep(0.05)


def test_after_a_failover_a_standby_on_the_old_timeline_serves_no_read(make_app):
    # The failover that loses WAL: the primary partitioned away (frozen) after a standby
    # replayed a creation the standby promoted in its place never received. The first standby
    # still streams from the old primary (until wal_receiver_timeout) and holds an animal that is
    # not in the store: it must serve no read once the instance works on the new primary, by id
    # or in a page, though positions on the two timelines have the same numbers.
    with two_standbys_one_to_promote(make_app, "async", False, DATABASE_DEADLINE=2) as shape:
        primary, promoted, old, client, auth = shape
        kept = create(client, auth, "kept")
        promoted.wait_for_replay()
        old.wait_for_replay()
        on_standby = reads("standby")
        assert client.get(f"/v1/pets/{kept}", headers=auth).status_code == 200
        assert reads("standby") == on_standby + 1
        cut_off(promoted)
        lost = create(client, auth, "lost")
        old.wait_for_replay()
        primary.freeze()
        promoted.promote()
        # The instance's connections to the old primary time out, each a JSON 503 that a client
        # sends again; then it works on the new one.
        body = {"name": "after", "categoryId": 1}
        after = retried(lambda: client.post("/v1/pets", json=body, headers=auth))
        after = after.get_json()["id"]
        # Every pooled connection to the old primary dropped, and the instance has asked the new
        # one who it is (failover.py).
        while retried(lambda: client.get(f"/v1/pets/{kept}", headers=auth)).status_code != 200:
            pass
        time.sleep(failover.CONFIRM_EVERY)
        timeline = sent_back("timeline")
        assert retried(lambda: client.get(f"/v1/pets/{lost}", headers=auth)).status_code == 404
        shown = {pet["id"]: pet["name"] for pet in pages(client, auth)}
        assert shown.get(after) == "after"
        assert shown.get(lost) != "lost"
        assert sent_back("timeline") >= timeline + 2


def test_a_standby_left_behind_that_received_more_than_the_promoted_one_serves_no_read(make_app):
    # After a promotion, the standby that stays serves reads until it follows the new primary,
    # if it holds no WAL the new timeline lacks (standbys.left_behind): what it received is no
    # more than the promoted one had, as the instance saw both while no primary answered. Here it
    # received a creation the promoted one never had (a failover to the wrong standby): once the
    # instance works on the new primary, no read is served by it, by id or in a page.
    with two_standbys_one_to_promote(make_app, "sync", True) as shape:
        primary, promoted, _, client, auth = shape
        kept = create(client, auth, "kept")
        promoted.wait_for_replay()
        # The other standby is the synchronous one from then on (FIRST 1).
        cut_off(promoted)
        lost = create(client, auth, "lost")
        primary.kill()
        # Without the primary the instance asks both standbys what they received, and shows the
        # creation from the one that has it (without_primary.py).
        assert retried(lambda: client.get(f"/v1/pets/{lost}", headers=auth)).status_code == 200
        promoted.promote()
        body = {"name": "after", "categoryId": 1}
        after = retried(lambda: client.post("/v1/pets", json=body, headers=auth))
        assert after.status_code == 201, after.get_json()
        on_standby = reads("standby")
        # Each read goes to a standby host at random: the promoted one sends it back, the other
        # must too.
        for _ in range(10):
            assert client.get(f"/v1/pets/{lost}", headers=auth).status_code == 404
            assert client.get(f"/v1/pets/{kept}", headers=auth).status_code == 200
        shown = {pet["id"]: pet["name"] for pet in pages(client, auth)}
        assert shown.get(lost) != "lost"
        assert shown.get(after.get_json()["id"]) == "after"
        assert reads("standby") == on_standby


def retried(send, within=60):
    """The first answer to `send()` that is not a 503, sent again after each 503 (a JSON one,
    with Retry-After) as a client does."""
    deadline = time.monotonic() + within
    while True:
        answer = send()
        if answer.status_code != 503:
            return answer
        assert answer.headers["Retry-After"]
        assert answer.get_json()["code"]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def pages(client, auth):
    """Every animal a walk of pages shows."""
    shown, url = [], "/v1/pets?limit=100"
    while url:
        answer = retried(lambda url=url: client.get(url, headers=auth))
        assert answer.status_code == 200, answer.get_json()
        shown += answer.get_json()
        link = answer.headers.get("Link")
        url = link[link.index("/v1/") : link.index(">")] if link else None
    return shown


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
