"""A hung PostgreSQL: every process of the cluster stopped with SIGSTOP, so connections are
accepted by the kernel and nothing answers. Each request is answered within its deadline (503
with Retry-After, or the success it had before the freeze), straight from gunicorn, through
nginx, through PgBouncer and on the threaded development server; /readyz within half a second;
all recover by themselves, and no acknowledged write is lost.

Each test has a database of its own on a cluster of its own (tests/postgres_cluster.py), never
the machine's PostgreSQL: so they run once, in the pass without TEST_DATABASE_URL.
"""

import contextlib
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import requests
import sqlalchemy as sa
from conftest import migrate_to_head, start_own_cluster
from nginx_server import PROJECT_DIR
from pgbouncer_server import PGBOUNCER, PgBouncer
from werkzeug.serving import make_server

from animal_store import default_settings
from animal_store.data.failover import CONFIRM_EVERY
from animal_store.extensions import db

# The tests' DATABASE_DEADLINE: short, so that they wait little.
DEADLINE = 2
# What a loaded machine may add to an answer: far below the 30 s and more that a request waited
# for gunicorn to kill its worker before there was a deadline.
SLACK = 2
READYZ_BOUND = 0.5
# The connect timeout of the tests that time a fresh connection to the frozen server: libpq
# would wait this long; the deadline answers well before, however loaded the machine.
CONNECT_TIMEOUT = 10
# Seconds after the thaw by which every operation has succeeded again.
RECOVERY = 5
UNAVAILABLE = {
    "code": "service_unavailable",
    "message": "The database is unavailable; retry later.",
    "status": 503,
}
SETTINGS = {"ANIMAL_STORE_DATABASE_DEADLINE": str(DEADLINE)}


@pytest.fixture(scope="session")
def own_cluster():
    """A cluster for these tests, with a migrated database to copy."""
    cluster = start_own_cluster()
    migrate_to_head(cluster.create_database("migrated"))
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(own_cluster):
    yield own_cluster
    own_cluster.thaw()  # whatever became of the test


@pytest.fixture
def database_url(cluster):
    """A fresh migrated database on the own cluster; every fixture of conftest.py uses it."""
    return cluster.create_database(f"store_{uuid.uuid4().hex[:12]}", template="migrated")


@dataclass
class Answer:
    operation: str
    started: float
    finished: float
    status: int  # 0: no answer (the connection dropped)
    body: object
    retry_after: str | None


def send(session, operation, url, headers, pet_id):
    method, path, body = {
        "create": ("POST", "/v1/pets", {"name": "Rex", "categoryId": 1}),
        "get": ("GET", f"/v1/pets/{pet_id}", None),
        "list": ("GET", "/v1/pets?limit=5", None),
    }[operation]
    started = time.monotonic()
    try:
        response = session.request(method, url + path, json=body, headers=headers, timeout=60)
    except requests.RequestException as error:
        return Answer(operation, started, time.monotonic(), 0, str(error), None)
    try:
        answer_body = response.json()
    except ValueError:
        answer_body = response.text
    return Answer(
        operation,
        started,
        time.monotonic(),
        response.status_code,
        answer_body,
        response.headers.get("Retry-After"),
    )


def drive(url, headers, cluster, session=None, frozen_for=2 * DEADLINE + 1):
    """Two clients each creating, getting and listing, one request after another: healthy for
    a second, frozen for `frozen_for`, then until every operation succeeded again after the
    thaw (or RECOVERY has passed). Return the answers, and when the freeze and thaw were."""
    session = session or requests.Session()
    pet_id = session.post(url + "/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=headers)
    pet_id = pet_id.json()["id"]
    answers, stop = [], threading.Event()

    def client(operation):
        while not stop.is_set():
            answers.append(send(session, operation, url, headers, pet_id))

    clients = [
        threading.Thread(target=client, args=(operation,))
        for operation in ("create", "get", "list")
        for _ in range(2)
    ]
    for thread in clients:
        thread.start()
    time.sleep(1)
    frozen_at = time.monotonic()
    cluster.freeze()
    time.sleep(frozen_for)
    thawed_at = time.monotonic()
    cluster.thaw()
    while time.monotonic() < thawed_at + RECOVERY and not recovered(answers, thawed_at):
        time.sleep(0.1)
    stop.set()
    for thread in clients:
        thread.join(60)
    return answers, frozen_at, thawed_at


def recovered(answers, thawed_at) -> bool:
    succeeded = {a.operation for a in answers if a.started > thawed_at and a.status in (200, 201)}
    return succeeded == {"create", "get", "list"}


def assert_answered_within_the_deadline(answers, frozen_at, thawed_at):
    during = [a for a in answers if a.finished > frozen_at and a.started < thawed_at]
    assert [a for a in during if a.status == 503], "the freeze never showed"
    for answer in answers:
        assert answer.status in (200, 201, 503), answer
        if answer.status == 503:
            assert answer.body == UNAVAILABLE, answer
            assert answer.retry_after == str(default_settings.DATABASE_RETRY_AFTER), answer
        assert answer.finished - answer.started < DEADLINE + SLACK, answer
    assert recovered(answers, thawed_at), "not every operation succeeded again after the thaw"
    latest = max(a.finished for a in answers if a.started > thawed_at and a.status in (200, 201))
    assert latest - thawed_at < RECOVERY + DEADLINE + SLACK


def assert_no_acknowledged_write_lost(database_url, answers):
    created = {a.body["id"] for a in answers if a.status == 201}
    assert created
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as connection:
            stored = set(connection.scalars(sa.text("SELECT id FROM pets")))
    finally:
        engine.dispose()
    assert created <= stored


def summary(answers) -> str:
    """The answers by operation and status, printed for the test's log (pytest -s)."""
    counts = {}
    for a in answers:
        counts.setdefault((a.operation, a.status), []).append(a.finished - a.started)
    return "; ".join(
        f"{operation} {status}: {len(times)}, max {max(times):.2f} s"
        for (operation, status), times in sorted(counts.items())
    )


@pytest.fixture
def pgbouncer(cluster, database_url):
    if PGBOUNCER is None:
        pytest.skip("PgBouncer is not installed (Debian: pgbouncer)")
    server = PgBouncer(sa.engine.make_url(database_url), "postgres", 3).wait_until_serving()
    yield server
    server.stop()


def settings_for(request, path) -> dict:
    """The test's settings for gunicorn; through PgBouncer in transaction pooling, on the same
    database, when the path is "pgbouncer"."""
    env = dict(SETTINGS)
    if path == "pgbouncer":
        url = request.getfixturevalue("pgbouncer").url
        env["DATABASE_URL"] = url.render_as_string(hide_password=False)
        env["ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER"] = "true"
    return env


@pytest.mark.parametrize("path", ["gunicorn", "nginx", "pgbouncer"])
def test_frozen_database_answers_503_within_the_deadline_and_recovers(
    request, path, start_gunicorn, database_url, auth, cluster
):
    gunicorn = start_gunicorn(workers=2, env=settings_for(request, path))
    url, session = gunicorn.url, requests.Session()
    if path == "nginx":
        # The shipped nginx.conf, as is: its proxy_read_timeout outlasts the deadline.
        nginx = request.getfixturevalue("start_nginx")([gunicorn.url.removeprefix("http://")])
        url, session.verify = nginx.url, str(request.getfixturevalue("certificate")[0])
        session.trust_env = False

    answers, frozen_at, thawed_at = drive(url, auth, cluster, session)
    print(path, summary(answers))

    assert_answered_within_the_deadline(answers, frozen_at, thawed_at)
    assert "WORKER TIMEOUT" not in gunicorn.log()
    assert_no_acknowledged_write_lost(database_url, answers)


def test_a_ping_cut_at_the_deadline_replaces_every_connection_the_pool_held(
    make_app, auth, cluster
):
    # Three pooled connections when the server hangs: the request that meets the first is cut at
    # its deadline, and the pool forgets the other two rather than making later requests find
    # each one hung (after a failover, they reach the lost primary; a new one, the promoted).
    app = make_app(DATABASE_DEADLINE=DEADLINE)
    held = backend_pids(app, 3)
    cluster.freeze()
    try:
        assert app.test_client().get("/v1/pets", headers=auth).status_code == 503
    finally:
        cluster.thaw()
    assert backend_pids(app, 3).isdisjoint(held)


def backend_pids(app, count):
    """The server processes of `count` connections of the app's pool, checked out at once."""
    with app.app_context(), contextlib.ExitStack() as stack:
        connections = [stack.enter_context(db.engine.connect()) for _ in range(count)]
        return {c.execute(sa.text("SELECT pg_backend_pid()")).scalar() for c in connections}


def test_threaded_development_server_answers_within_the_deadline(make_app, auth, cluster):
    app = make_app(DATABASE_DEADLINE=DEADLINE)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answers, frozen_at, thawed_at = drive(f"http://127.0.0.1:{server.port}", auth, cluster)
    finally:
        server.shutdown()
    print(summary(answers))
    assert_answered_within_the_deadline(answers, frozen_at, thawed_at)


@pytest.mark.parametrize("path", ["gunicorn", "pgbouncer"])
def test_readyz_answers_503_within_half_a_second_while_frozen(
    request, path, start_gunicorn, cluster
):
    env = settings_for(request, path) | {
        "ANIMAL_STORE_DATABASE_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT)
    }
    gunicorn = start_gunicorn(workers=2, env=env)
    for _ in range(4):  # each worker's pool holds a connection
        assert requests.get(gunicorn.url + "/readyz", timeout=10).status_code == 200

    cluster.freeze()
    # Pooled connections first, then none left: each must connect, which libpq would give
    # CONNECT_TIMEOUT.
    for _ in range(6):
        started = time.monotonic()
        response = requests.get(gunicorn.url + "/readyz", timeout=10)
        elapsed = time.monotonic() - started
        print(f"readyz while frozen: {response.status_code} in {elapsed:.2f} s")
        assert response.status_code == 503
        assert response.json() == UNAVAILABLE
        assert elapsed < READYZ_BOUND + SLACK

    cluster.thaw()
    deadline = time.monotonic() + RECOVERY
    while requests.get(gunicorn.url + "/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "/readyz did not recover"
        time.sleep(0.1)


def get(app, path, headers=None):
    """GET through the app's test client in a thread: a request that hangs fails the test
    instead of stopping it."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(app.test_client().get, path, headers=headers).result(timeout=20)
    finally:
        pool.shutdown(wait=False)  # not waiting for a hung request


@pytest.fixture
def slow_route_app(make_app):
    """An app whose /steps runs `count` statements of `seconds` each, as several steps."""

    def make(**settings):
        app = make_app(**settings)

        @app.get("/steps/<int:count>/<float:seconds>")
        def steps(count, seconds):
            for _ in range(count):
                with db.engine.connect() as connection:
                    connection.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})
            return {}

        return app

    return make


@pytest.mark.parametrize(
    ("count", "seconds", "status"),
    [(3, 0.5, 503), (1, 2.0, 503), (2, 0.2, 200)],
    ids=["steps-add-up-past-it", "one-step-past-it", "within-it"],
)
def test_deadline_bounds_the_request_not_each_step(slow_route_app, count, seconds, status):
    # A live server, slow: each statement is under the deadline, their sum may not be.
    app = slow_route_app(DATABASE_DEADLINE=1.0, DATABASE_STATEMENT_TIMEOUT=3)
    started = time.monotonic()
    response = get(app, f"/steps/{count}/{seconds}")
    elapsed = time.monotonic() - started
    assert response.status_code == status
    if status == 503:
        assert response.get_json() == UNAVAILABLE
        assert 0.9 < elapsed < 1.0 + SLACK


@pytest.mark.parametrize("path", ["postgresql", "pgbouncer"])
def test_a_fresh_worker_connecting_waits_only_what_the_deadline_leaves(
    request, path, make_app, api_key, cluster
):
    # A fresh app holds no connection: its first request connects. To the frozen server,
    # libpq's connect_timeout (DATABASE_CONNECT_TIMEOUT) would wait; to PgBouncer the
    # connection opens, and SQLAlchemy's first queries on it wait.
    settings = {"DATABASE_DEADLINE": 0.5, "DATABASE_CONNECT_TIMEOUT": CONNECT_TIMEOUT}
    if path == "pgbouncer":
        url = request.getfixturevalue("pgbouncer").url
        with psycopg.connect(url.set(drivername="postgresql").render_as_string()) as warm:
            warm.execute("SELECT 1")  # PgBouncer keeps a server connection for the logins
        settings |= {"DATABASE_URL": url.render_as_string(), "DATABASE_BEHIND_PGBOUNCER": True}
    app = make_app(**settings)
    cluster.freeze()
    started = time.monotonic()
    response = get(app, "/v1/pets", {"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 503
    assert time.monotonic() - started < 0.5 + SLACK


def test_after_a_missed_deadline_requests_fail_fast_until_one_gets_through(make_app, auth, cluster):
    app = make_app(DATABASE_DEADLINE=DEADLINE, KEY_CACHE_SECONDS=0)
    assert get(app, "/v1/pets", auth).status_code == 200

    cluster.freeze()
    timings = []
    for _ in range(3):
        started = time.monotonic()
        assert get(app, "/v1/pets", auth).status_code == 503
        timings.append(time.monotonic() - started)
    # The first waits out its deadline; the next are answered at once, not a deadline each
    # (within the retry interval, deadlines.RETRY_INTERVAL: 1 s from the first's end).
    assert timings[0] > DEADLINE - 0.1
    assert max(timings[1:]) < DEADLINE / 2

    cluster.thaw()
    time.sleep(1.2)  # deadlines.RETRY_INTERVAL
    assert get(app, "/v1/pets", auth).status_code == 200


def test_probe_running_past_its_deadline_holds_no_request_back(make_app, auth, cluster):
    app = make_app(READYZ_TIMEOUT=0.3)
    assert get(app, "/readyz").status_code == 200
    cluster.freeze()
    assert get(app, "/readyz").status_code == 503
    cluster.thaw()
    # Right away: a probe's short deadline is its own; a request is not answered 503 for it.
    assert get(app, "/v1/pets", auth).status_code == 200


def test_a_known_key_is_served_while_its_cache_entry_is_fresh_and_no_longer(
    make_app, auth, cluster
):
    # docs/operations.rst, API keys: no serving on a stale entry, so a revoked key stops within
    # KEY_CACHE_SECONDS, outage or not.
    # A cache time a loaded machine's freeze and requests fit well within.
    app = make_app(DATABASE_DEADLINE=1, KEY_CACHE_SECONDS=3)
    pet = app.test_client().post("/v1/pets", headers=auth, json={"name": "Rex", "categoryId": 1})
    path = f"/v1/pets/{pet.get_json()['id']}"
    assert get(app, path, auth).status_code == 200  # the answer is kept, the key cached
    cluster.freeze()
    assert get(app, path, auth).status_code == 200  # needs no database
    time.sleep(3.1)
    assert get(app, path, auth).status_code == 503  # the key must be checked again


def test_a_kept_read_is_answered_for_at_most_a_second_once_the_database_stops(
    make_app, auth, cluster
):
    # docs/deploy.rst, High availability: reads are not spared by a failover. A worker answers
    # from what it kept for at most CONFIRM_EVERY (a second) after the database stops
    # answering, however fresh the key's cache entry, then with the JSON 503 as creations.
    app = make_app(DATABASE_DEADLINE=1)
    pet = app.test_client().post("/v1/pets", headers=auth, json={"name": "Rex", "categoryId": 1})
    path = f"/v1/pets/{pet.get_json()['id']}"
    assert get(app, path, auth).status_code == 200  # the answer is kept, the key cached
    cluster.freeze()
    frozen = time.monotonic()
    answers = []  # (seconds after the freeze the request was sent, its status)
    while not answers or answers[-1][1] == 200:
        assert time.monotonic() - frozen < CONFIRM_EVERY + SLACK, answers
        answers.append((time.monotonic() - frozen, get(app, path, auth).status_code))
        time.sleep(0.05)
    kept = [round(sent, 2) for sent, status in answers if status == 200]
    print(f"kept read answered 200 when sent at {kept} s, 503 at {answers[-1][0]:.2f} s")
    assert answers[-1][1] == 503, answers
    assert all(sent < CONFIRM_EVERY for sent in kept), answers


def test_outside_a_request_the_database_has_no_deadline(make_app):
    # The command line and migrations may run long; statement_timeout still bounds them.
    app = make_app(DATABASE_DEADLINE=0.2)
    with app.app_context():
        assert db.session.scalar(sa.text("SELECT 1 FROM pg_sleep(0.5)")) == 1


def setting(path: Path, pattern: str) -> float:
    """A number from a shipped configuration file (the file is never executed)."""
    found = re.findall(pattern, path.read_text(), flags=re.MULTILINE)
    assert len(found) == 1, f"{path.name}: {pattern!r} found {len(found)} times"
    return float(found[0])


def test_shipped_timeouts_form_a_ladder():
    """The app's database limits < gunicorn's timeout < nginx's, so through nginx the client
    gets the app's 503, not a killed worker's 502 or nginx's 504 (docs/deploy.rst)."""
    gunicorn_timeout = setting(PROJECT_DIR / "config" / "gunicorn.conf.py", r"^timeout = (\d+)")
    nginx = PROJECT_DIR / "config" / "nginx.conf"
    read_timeout = setting(nginx, r"^\s*proxy_read_timeout (\d+)s;")
    send_timeout = setting(nginx, r"^\s*proxy_send_timeout (\d+)s;")
    deadline = default_settings.DATABASE_DEADLINE
    assert default_settings.READYZ_TIMEOUT < READYZ_BOUND
    # A live server cancels a slow statement itself, keeping the connection, before the
    # deadline cuts it; the other waits fit within the deadline.
    limits = default_settings.DATABASE_CONNECT_TIMEOUT, default_settings.DATABASE_POOL_TIMEOUT
    assert max(limits) <= deadline > default_settings.DATABASE_STATEMENT_TIMEOUT
    assert deadline <= 5
    assert deadline < gunicorn_timeout < min(read_timeout, send_timeout)
