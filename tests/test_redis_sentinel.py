"""The rate limits' Redis behind Sentinel, as docs/deploy.rst ships it (config/redis/): the
instances count in the master the Sentinels name, follow it when it is lost, frozen or switched
over, within the time the docs promise and with no restart, counting apart meanwhile; after it a
key's limit holds across the instances again, and the old master is back as a replica. One
cluster (tests/redis_sentinel_cluster.py) and one pair of gunicorn instances serve the module."""

import re
import secrets
import threading
import time
from collections import Counter

import pytest
import requests
from conftest import IN_POSTGRESQL_PASS, Gunicorn
from nginx_server import PROJECT_DIR, free_port
from redis_sentinel_cluster import REDIS_SENTINEL, REDIS_SERVER, SentinelCluster, sentinel_timings
from test_rate_limits import bearer

from animal_store import create_app, default_settings
from animal_store.access.auth import issue_key
from animal_store.extensions import db

pytestmark = [
    IN_POSTGRESQL_PASS,
    pytest.mark.skipif(
        REDIS_SENTINEL is None or REDIS_SERVER is None,
        reason="redis-server and redis-sentinel are not installed (Debian: redis-sentinel)",
    ),
]

# What docs/deploy.rst promises: every worker counts in the new master within 10 s of the old
# one's loss, with the shipped timings.
COUNTED_IN_WITHIN = 10.0
# Longest any answer may take while the master goes: a request asks Redis at most once, for its
# socket timeout (0.1 s) and the Sentinels' answers; the rest is a loaded machine's slack (CI, both
# passes at once on 2 cores: 2.02 and 2.90 s seen with a frozen master). A request held by the
# frozen master itself would wait until the promotion, 5 s and more.
SLOWEST_ANSWER = 3.0
# Between two requests of one client of the load.
PACE = 0.02
WORKERS = 2
# The key whose limit is checked after each failover, asked 2 x LIMIT times through both
# instances in turn, PACE apart: each worker's requests then come further apart than the sync
# interval (0.05 s), which counts them exactly (docs/operations.rst, Rate limits); OVERSHOOT is
# what two of a worker's requests that happen to come within one interval may add. Counted
# apart, each of the four workers would admit all of its share: 2 x LIMIT.
LIMIT, OVERSHOOT, PACE = 30, 4, 0.025


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SentinelCluster(tmp_path_factory.mktemp("sentinel"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def store(module_database):
    """An app on the instances' database, to give them keys."""
    app = create_app({"TESTING": True, "DATABASE_URL": module_database})
    yield app
    with app.app_context():
        db.engine.dispose()


@pytest.fixture
def database_url(module_database):
    # Keys made for the module's instances stay: each test's have ids of their own, so no count
    # in the module's Redis is another test's.
    return module_database


def new_key(store, limit):
    with store.app_context():
        _, key = issue_key(f"sentinel-{secrets.token_hex(4)}", rate_limit=limit)
        db.session.commit()
    return bearer(key)


@pytest.fixture(scope="module")
def instances(cluster, module_database, tmp_path_factory):
    """Two instances of WORKERS workers each, counting through the three Sentinels."""
    directory = tmp_path_factory.mktemp("sentinel-gunicorn")
    servers = []
    try:
        for number in range(2):
            servers.append(
                Gunicorn(
                    module_database,
                    WORKERS,
                    {"ANIMAL_STORE_RATELIMIT_STORAGE_URI": cluster.uri()},
                    directory / f"gunicorn-{number}.log",
                )
            )
        yield [server.wait_until_serving() for server in servers]
    finally:
        for server in servers:
            server.stop()


def metric(server, series):
    text = requests.get(server.url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def workers_counting_in(server, port):
    """How many of the instance's workers last synced with the Redis on `port`."""
    return metric(server, f'animal_store_rate_limit_storage_workers{{address="127.0.0.1:{port}"}}')


def seconds_counted_apart(instances):
    return sum(
        metric(server, "animal_store_rate_limit_degraded_seconds_total") for server in instances
    )


def wait_until_counting_in(instances, port, since, within):
    """Return the seconds from `since` until every worker of both instances counts in the Redis
    on `port`; fail past `within`."""
    while time.monotonic() - since < within:
        if all(workers_counting_in(server, port) == WORKERS for server in instances):
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"the workers did not count in 127.0.0.1:{port} within {within}s")


class Load:
    """Clients asking each instance one after another with one key, two per instance, each
    answer kept: (status, the body as JSON or None, seconds it took)."""

    def __init__(self, instances, headers):
        self.answers = []
        self.done = threading.Event()
        self.threads = [
            threading.Thread(target=self.ask, args=(server.url, headers))
            for server in instances
            for _ in range(2)
        ]
        for thread in self.threads:
            thread.start()

    def ask(self, url, headers):
        session = requests.Session()
        while not self.done.is_set():
            started = time.monotonic()
            response = session.get(url + "/v1/pets", headers=headers, timeout=30)
            try:
                body = response.json()
            except ValueError:
                body = None
            self.answers.append((response.status_code, body, time.monotonic() - started))
            # A pause between two requests: every worker still counts (each gets requests), and
            # the machine's cores are left to the servers and to the rest of CI.
            self.done.wait(PACE)

    def stop(self):
        self.done.set()
        for thread in self.threads:
            thread.join()
        return self.answers


def acceptable(status, body):
    """2xx, a 429, or the service's JSON error object."""
    if 200 <= status < 300 or status == 429:
        return True
    return isinstance(body, dict) and set(body) >= {"code", "message", "status"}


def admitted_of_one_key(instances, store):
    """Requests a key of LIMIT a minute is let make, asking the two instances in turn."""
    headers = new_key(store, f"{LIMIT} per minute")
    statuses = []
    for n in range(2 * LIMIT):
        url = instances[n % 2].url + "/v1/pets"
        statuses.append(requests.get(url, headers=headers, timeout=10).status_code)
        time.sleep(PACE)
    assert set(statuses) <= {200, 429}
    return statuses.count(200)


def lose_master(cluster, master, how):
    """Make the master go as `how` says; return what brings it back, as a replica."""
    if how == "killed":
        master.kill()
        return master.start
    if how == "frozen":
        master.freeze()
        return master.thaw
    cluster.failover()
    return lambda: None


# The planned failover first, on a cluster that has settled since it started (watched()).
@pytest.mark.parametrize("how", ["switched over", "killed", "frozen"])
def test_the_instances_count_in_the_new_master_within_seconds(cluster, instances, store, how):
    cluster.wait_until_watched(settled=how == "switched over")
    old_master = cluster.master()
    old_port = old_master.port
    booted = [server.log().count("Worker ready") for server in instances]
    load = Load(instances, new_key(store, "1000000 per minute"))
    try:
        # Every worker counts in the master, having served some of the load.
        wait_until_counting_in(instances, old_port, time.monotonic(), 30)
        apart = seconds_counted_apart(instances)
        lost = time.monotonic()
        bring_back = lose_master(cluster, old_master, how)
        new_port = cluster.wait_for_new_master(old_port)
        promoted = time.monotonic() - lost
        counted_in = wait_until_counting_in(instances, new_port, lost, 30)
    finally:
        answers = load.stop()
    bring_back()
    apart = seconds_counted_apart(instances) - apart
    print(
        f"master {how}: promoted after {promoted:.1f}s, every worker counting in it after "
        f"{counted_in:.1f}s, {apart:.1f}s counted apart over the {WORKERS * 2} workers; "
        f"answers by status {dict(Counter(status for status, _, _ in answers))}, the slowest "
        f"{max(seconds for _, _, seconds in answers):.2f}s"
    )
    assert counted_in < COUNTED_IN_WITHIN
    assert answers
    assert all(acceptable(status, body) for status, body, _ in answers)
    assert max(seconds for _, _, seconds in answers) < SLOWEST_ANSWER

    # The key's limit holds across both instances again: shared, not per worker.
    admitted = admitted_of_one_key(instances, store)
    print(f"after it, a key of {LIMIT} a minute was let make {admitted} of {2 * LIMIT}")
    assert LIMIT <= admitted <= LIMIT + OVERSHOOT
    # The old master is back as a replica of the new one, and the instances stay with the new
    # one, with no restart of anything.
    cluster.wait_until_replica(old_master, new_port)
    assert cluster.master_port() == new_port
    for server in instances:
        assert workers_counting_in(server, new_port) == WORKERS
        assert requests.get(server.url + "/readyz", timeout=10).json()["rateLimits"] == "shared"
    assert [server.log().count("Worker ready") for server in instances] == booted


def test_the_docs_say_the_shipped_sentinel_timings():
    # The failovers above ran on the shipped file's timings, which docs/deploy.rst gives.
    deploy = (PROJECT_DIR / "docs" / "deploy.rst").read_text()
    for name, value in sentinel_timings().items():
        assert f"``{name} {value}``" in deploy, name


@pytest.mark.parametrize("how", ["down", "hung"])
def test_a_first_sentinel_down_or_hung_costs_a_worker_one_timeout(cluster, make_app, store, how):
    cluster.wait_until_watched()
    first = cluster.sentinels[0]
    if how == "down":  # a Sentinel on a machine lost before the instances booted
        listed = [("127.0.0.1", free_port()), *cluster.addresses()]
    else:
        first.freeze()
        listed = cluster.addresses()
    try:
        worker, other_worker = (
            make_app(
                RATE_LIMIT="100 per hour", RATELIMIT_STORAGE_URI=cluster.uri(listed)
            ).test_client()
            for _ in range(2)
        )
        headers = new_key(store, None)
        started = time.monotonic()
        assert worker.get("/readyz").get_json()["rateLimits"] == "shared"
        assert time.monotonic() - started < SLOWEST_ANSWER
        worker.get("/v1/pets", headers=headers)
        other_worker.get("/v1/pets", headers=headers)
        # Past the sync interval, the next request syncs before it is decided.
        time.sleep(2 * default_settings.RATELIMIT_SYNC_INTERVAL)
        shown = worker.get("/v1/pets", headers=headers).headers["RateLimit-Remaining"]
    finally:
        if how == "hung":
            first.thaw()
    # Counted in the master, shared: the worker's third hit is the key's third.
    assert shown == str(100 - 3)
    limiter = worker.application.extensions["animal_store_rate_limits"]
    assert limiter.storage_address == f"127.0.0.1:{cluster.master_port()}"
