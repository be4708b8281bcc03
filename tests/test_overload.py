"""Overload: a surge of clients is queued and served at the workers' pace; a request that waited
longer than REQUEST_QUEUE_TIMEOUT for a worker is answered 503 unserved, with Retry-After, by the
worker that takes it (animal_store/http/shedding.py), and one whose client has gone is not run at
all (animal_store/serving/worker.py); the metrics listener shows the queue and counts the shed
and the abandoned.

The shedding rule is tried in the app; the surge with real nginx on the shipped files, gunicorn
on the production config and wrk's keep-alive clients, its workers frozen (SIGSTOP) past the
queue timeout while the clients keep coming.
"""

import json
import os
import re
import signal
import socket
import ssl
import time

import pytest
import sqlalchemy as sa
import wrk
from conftest import PROJECT_DIR, TEST_DATABASE_URL, free_port
from nginx_server import NGINX, Nginx
from test_metrics_listener import scrape, worker_pids

from animal_store.access.auth import issue_key
from animal_store.extensions import db

NEW_PET = {"name": "Rex", "categoryId": 1, "status": "available"}


def stamp(seconds_ago: float) -> str:
    return f"t={time.time() - seconds_ago:.3f}"


@pytest.fixture
def keyed(make_app):
    """An app with REQUEST_QUEUE_TIMEOUT 2 s, and a key for it."""
    app = make_app(REQUEST_QUEUE_TIMEOUT=2)
    with app.app_context():
        _, key = issue_key("surge")
        db.session.commit()
    return app, {"Authorization": f"Bearer {key}"}


def test_a_request_that_waited_too_long_is_answered_503_at_once_and_changes_nothing(keyed):
    app, headers = keyed
    client = app.test_client()
    answer = client.post(
        "/v1/pets", json=NEW_PET, headers={**headers, "X-Request-Start": stamp(2.5)}
    )
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "5"
    assert answer.get_json() == {
        "code": "service_unavailable",
        "message": "The service is overloaded: the request waited too long for a worker; "
        "retry later.",
        "status": 503,
    }
    assert answer.headers["X-Request-ID"]
    with app.app_context():
        assert db.session.scalar(sa.text("SELECT count(*) FROM pets")) == 0


@pytest.mark.parametrize(
    "start",
    [
        pytest.param(lambda: stamp(1.5), id="waited-less"),
        pytest.param(lambda: stamp(-60), id="from-the-future"),
        pytest.param(lambda: "t=soon", id="not-a-number"),
        pytest.param(lambda: f"{time.time() - 60:.3f}", id="without-t="),
        pytest.param(lambda: f"s={time.time() - 60:.3f}", id="another-prefix"),
        pytest.param(lambda: "t=nan", id="nan"),
        pytest.param(lambda: "t=-inf", id="minus-infinity"),
        pytest.param(lambda: "", id="empty"),
        pytest.param(lambda: None, id="absent"),
    ],
)
def test_a_request_is_served_unless_it_says_it_waited_too_long(keyed, start):
    app, headers = keyed
    value = start()
    sent = headers if value is None else {**headers, "X-Request-Start": value}
    answer = app.test_client().post("/v1/pets", json=NEW_PET, headers=sent)
    assert answer.status_code == 201, answer.get_json()


def test_a_queue_timeout_of_0_sheds_nothing(make_app):
    app = make_app(REQUEST_QUEUE_TIMEOUT=0)
    answer = app.test_client().get("/healthz", headers={"X-Request-Start": stamp(3600)})
    assert answer.status_code == 200


def test_the_shipped_nginx_stamps_when_it_passed_the_request_on():
    site = (PROJECT_DIR / "config" / "nginx.conf").read_text()
    assert re.search(r'^\s+proxy_set_header X-Request-Start "t=\$\{msec\}";$', site, re.M)


# The surge: more keep-alive clients than the machine serves at once, every one from 127.0.0.1,
# which the site's geo block lists as uncapped (a gateway's address, as the deploy guide allows).
CLIENTS = 1024
QUEUE_TIMEOUT = 1.0
FROZEN = 3.0  # seconds the workers are stopped: past the queue timeout, with a margin


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)")
@pytest.mark.skipif(wrk.WRK is None, reason="wrk is not installed (Debian: wrk)")
def test_a_surge_is_served_in_turn_and_what_waited_too_long_is_shed(
    start_gunicorn, production_env, certificate, make_app, tmp_path
):
    gunicorn, key, metrics = start_instance(
        start_gunicorn, production_env, make_app, "surge", QUEUE_TIMEOUT
    )
    nginx = Nginx(
        tmp_path / "nginx",
        [f"127.0.0.1:{gunicorn.port}"],
        *certificate,
        uncapped=("127.0.0.1",),
    ).wait_until_serving()
    try:
        listener = (("listener", f"127.0.0.1:{gunicorn.port}"),)
        shed_before = scrape(metrics)["animal_store_requests_shed_total", ()]
        assert shed_before == 0  # a series from the first scrape, before any request is shed
        run = wrk.start(f"{nginx.url}/v1/pets?limit=20", key, CLIENTS, 14, tmp_path)
        time.sleep(4)  # every client connected and served in turn
        workers = worker_pids(gunicorn)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(1)
            started = time.monotonic()
            frozen = scrape(metrics, timeout=5)
            took = time.monotonic() - started
            time.sleep(FROZEN - 1)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        answers = wrk.finish(run, timeout=90)
        shed = wait_for_shed(metrics, shed_before, answers.statuses.get(503, 0))
        own_p99 = p99_bound(scrape(metrics), "listPets")
    finally:
        nginx.stop()
    queued = frozen["animal_store_listen_queue_connections", listener]
    print(
        f"{CLIENTS} clients, workers frozen {FROZEN} s: answers {answers.statuses}, socket errors "
        f"{answers.errors}; scrape while frozen {took * 1000:.0f} ms, {queued:.0f} queued; "
        f"{shed:.0f} shed; p99 {answers.percentiles.get(99)} s, the app's own at most {own_p99} s"
    )
    # Every client answered: nothing refused, reset or left waiting, and no 5xx but the shed.
    assert not any(answers.errors.values()), answers.errors
    assert set(answers.statuses) <= {200, 503}, answers.statuses
    assert answers.bare == 0, "a 503 without Retry-After or a JSON body"
    assert answers.statuses.get(200, 0) > CLIENTS
    # The requests that waited past the timeout were shed, and counted.
    assert answers.statuses.get(503, 0) > 0
    assert shed >= answers.statuses[503]
    # With the workers stopped, the clients' requests wait in the queue, and the scrape shows it.
    assert queued >= CLIENTS // 2
    assert took < 2
    # AnimalStoreSaturated's tell (config/prometheus/alerts.yml): with the workers short of CPU
    # (here none at all for FROZEN s) the clients wait seconds, and the app's own p99, which
    # leaves the wait out, stays within the list's objective (the two requests frozen mid-way are
    # far under 1 %). tests/test_prometheus.py has it high when the database holds requests.
    assert answers.percentiles[99] >= 1
    assert own_p99 <= 0.1


def p99_bound(samples, operation) -> float:
    """The least bucket bound of the app's 2xx durations of an operation that holds 99 % of them:
    its p99 is at most that."""
    buckets = sorted(
        (float(dict(labels)["le"]), count)
        for (name, labels), count in samples.items()
        if name == "animal_store_request_duration_seconds_bucket"
        and dict(labels)["operation"] == operation
        and dict(labels)["status_class"] == "2xx"
    )
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= 0.99 * total)


def wait_for_shed(metrics, before, at_least, timeout=10) -> float:
    """The shed requests counted since `before`, once the workers wrote at least `at_least`
    (each writes its counts at most every METRICS_WRITE_INTERVAL)."""
    deadline = time.monotonic() + timeout
    while True:
        shed = scrape(metrics)["animal_store_requests_shed_total", ()] - before
        if shed >= at_least or time.monotonic() > deadline:
            return shed
        time.sleep(0.2)


# Clients gone, and answers only a worker gives: real nginx on the shipped files in front of
# gunicorn on the production config, its workers frozen (SIGSTOP) while requests queue.
QUEUE_TIMEOUT_WHILE_FROZEN = 1  # seconds: well under FROZEN, so every queued request is stale
GONE = 6


def open_request(nginx, method, key) -> ssl.SSLSocket:
    """Send a request through nginx's TLS port on a connection of its own, and leave it there:
    the caller reads the answer (read_status) or closes the connection, a client that has gone."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    connection = context.wrap_socket(
        socket.create_connection(("127.0.0.1", nginx.https_port), timeout=60)
    )
    body = json.dumps(NEW_PET).encode() if method == "POST" else b""
    head = (
        f"{method} /v1/pets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\n"
        + (f"Content-Length: {len(body)}\r\n" if body else "")
        + "Connection: close\r\n\r\n"
    )
    connection.sendall(head.encode() + body)
    return connection


def read_status(connection: ssl.SSLSocket) -> tuple[int, dict[str, str]]:
    """The status and headers (lower-case names) of the answer, read to the end."""
    answer = b""
    with connection:
        while chunk := connection.recv(65536):
            answer += chunk
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in head[1:])
    return int(head[0].split()[1]), {name.lower(): value.strip() for name, _, value in fields}


@pytest.fixture
def frozen_instance(start_gunicorn, production_env, start_nginx, make_app):
    """gunicorn with 2 workers and REQUEST_QUEUE_TIMEOUT 1 s behind the shipped nginx, a key, the
    metrics listener's URL, and a way to freeze its workers."""
    gunicorn, key, metrics = start_instance(
        start_gunicorn,
        production_env,
        make_app,
        "gone",
        QUEUE_TIMEOUT_WHILE_FROZEN,
        ANIMAL_STORE_METRICS_WRITE_INTERVAL="0",
    )
    nginx = start_nginx([f"127.0.0.1:{gunicorn.port}"], uncapped=("127.0.0.1",))
    return gunicorn, nginx, key, metrics


def start_instance(start_gunicorn, production_env, make_app, name, queue_timeout, **env):
    """gunicorn with 2 workers, the metrics listener and this REQUEST_QUEUE_TIMEOUT, and a key no
    rate limit stops: (gunicorn, the key, the listener's URL). In the pass without
    TEST_DATABASE_URL only: the queue is the same on both."""
    if TEST_DATABASE_URL:
        pytest.skip("runs in the pass without TEST_DATABASE_URL: the queue is the same on both")
    app = make_app()
    with app.app_context():
        _, key = issue_key(name, rate_limit="100000000/minute")
        db.session.commit()
    metrics_port = free_port()
    gunicorn = start_gunicorn(
        workers=2,
        env={
            **production_env,
            "ANIMAL_STORE_METRICS_BIND": f"127.0.0.1:{metrics_port}",
            "ANIMAL_STORE_REQUEST_QUEUE_TIMEOUT": str(queue_timeout),
            **env,
        },
    )
    return gunicorn, key, f"http://127.0.0.1:{metrics_port}/metrics"


def wait_for_queue(metrics, gunicorn, length, timeout=30):
    """Return once `length` connections wait in gunicorn's listening socket."""
    listener = (("listener", f"127.0.0.1:{gunicorn.port}"),)
    deadline = time.monotonic() + timeout
    while (queued := scrape(metrics)["animal_store_listen_queue_connections", listener]) < length:
        assert time.monotonic() < deadline, f"{queued} queued, not {length}"
        time.sleep(0.05)


def answers_counted(samples) -> dict[tuple[str, str], float]:
    """animal_store_requests_total by (operation, status), the series above 0."""
    return {
        (dict(labels)["operation"], dict(labels)["status"]): value
        for (name, labels), value in samples.items()
        if name == "animal_store_requests_total" and value
    }


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)")
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_request_whose_client_has_gone_is_not_served_and_counted_apart(
    frozen_instance, count_pets, method
):
    gunicorn, nginx, key, metrics = frozen_instance
    before = scrape(metrics)
    # A series from the first scrape, before any request is abandoned.
    assert before["animal_store_requests_abandoned_total", ()] == 0
    operation = "listPets" if method == "GET" else "createPet"
    workers = worker_pids(gunicorn)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        staying = open_request(nginx, method, key)
        gone = [open_request(nginx, method, key) for _ in range(GONE)]
        wait_for_queue(metrics, gunicorn, GONE + 1)
        for connection in gone:
            connection.close()
        # nginx gives up on each (499) and closes its connection to gunicorn: still queued.
        logged = nginx.access_log(lines=GONE, timeout=10).splitlines()
        assert sorted(json.loads(line)["status"] for line in logged) == [499] * GONE
        time.sleep(QUEUE_TIMEOUT_WHILE_FROZEN + 0.5)  # every request in the queue is stale
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    status, headers = read_status(staying)
    deadline = time.monotonic() + 10
    while (after := scrape(metrics)).get(("animal_store_requests_abandoned_total", ()), 0) < GONE:
        assert time.monotonic() < deadline, f"answered {answers_counted(after)}"
        time.sleep(0.1)
    # The client still there gets its 503; the gone ones cost no answer and no error.
    assert (status, headers["retry-after"]) == (503, "5")
    assert after["animal_store_requests_abandoned_total", ()] == GONE
    assert after["animal_store_requests_shed_total", ()] == 1
    answered = answers_counted(after)
    assert answered.pop((operation, "503")) == 1
    assert not {series for series in answered if series[0] == operation}, answered
    assert count_pets() == 0


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)")
def test_what_waited_too_long_is_answered_once_a_worker_takes_it(frozen_instance):
    # Only a worker sheds (docs/deploy.rst, Overload): with every worker stopped, the 503 for a
    # request that waited past REQUEST_QUEUE_TIMEOUT (1 s) comes as they resume, not at 1 s.
    gunicorn, nginx, key, _ = frozen_instance
    workers = worker_pids(gunicorn)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        sent = time.monotonic()
        waiting = open_request(nginx, "GET", key)
        time.sleep(FROZEN)
        resumed = time.monotonic()
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    status, headers = read_status(waiting)
    answered = time.monotonic()
    print(
        f"workers stopped {FROZEN} s, REQUEST_QUEUE_TIMEOUT {QUEUE_TIMEOUT_WHILE_FROZEN} s: "
        f"the 503 after {answered - sent:.2f} s, {answered - resumed:.2f} s after they resumed"
    )
    assert (status, headers["retry-after"]) == (503, "5")
    assert answered - sent >= FROZEN
    assert answered - resumed < 2  # a loaded machine's slack
