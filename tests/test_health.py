"""Liveness and readiness probes: outside /v1, no key, a 503 error object without a database;
/readyz saying, from every worker alike, that commits wait for a synchronous standby that is gone
(a cluster of the test's own, tests/postgres_cluster.py), and ok again once they do not. A full
disk: tests/test_outages.py."""

import os
import signal
import time

import pytest
import requests
from conftest import TEST_DATABASE_URL, free_port, migrate_to_head, start_own_cluster
from test_metrics_listener import worker_pids

from animal_store import default_settings

# What a loaded machine may add to READYZ_TIMEOUT: far below DATABASE_DEADLINE (5 s), the least a
# creation waits for a standby that is not there, and the 22.6 s /readyz said ok meanwhile.
SLACK = 1.0
READY = {"status": "ok", "database": "ok", "rateLimits": "per process"}
WAITING = {
    "status": "degraded",
    "database": "waiting for a synchronous standby",
    "rateLimits": "per process",
}


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probe_answers_without_a_key(client, path):
    response = client.get(path)
    assert response.status_code == 200
    assert response.get_json()["status"] == "ok"


def test_readyz_of_a_healthy_database_is_ok_and_writes_nothing_visible(client, count_pets):
    # The probe writes (data/readiness.py) and commits, on either engine, and leaves no row.
    for _ in range(3):
        response = client.get("/readyz")
        assert response.status_code == 200
        assert response.get_json() == READY
    assert count_pets() == 0


@pytest.mark.parametrize("path", ["/v1/healthz", "/v1/readyz"])
def test_probes_live_outside_the_api_prefix(client, auth, path):
    assert client.get(path, headers=auth).status_code == 404


@pytest.mark.parametrize("method", ["post", "put", "delete"])
def test_probe_refuses_other_methods(client, method):
    response = getattr(client, method)("/readyz")
    assert response.status_code == 405
    assert response.get_json()["code"] == "method_not_allowed"


def unreachable_databases(tmp_path):
    return {
        "sqlite": f"sqlite:///{tmp_path}/no/such/directory/store.sqlite3",
        # Nothing listens on a fresh free port: the connection is refused at once.
        "postgresql": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothing",
    }


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_readyz_without_a_database_answers_503(make_app, tmp_path, backend):
    app = make_app(DATABASE_URL=unreachable_databases(tmp_path)[backend], DATABASE_RETRY_AFTER=7)
    started = time.monotonic()
    response = app.test_client().get("/readyz")
    assert time.monotonic() - started < 10
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "7"
    assert response.get_json() == {
        "code": "service_unavailable",
        "message": "The database is unavailable; retry later.",
        "status": 503,
    }


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_healthz_without_a_database_still_answers(make_app, tmp_path, backend):
    app = make_app(DATABASE_URL=unreachable_databases(tmp_path)[backend])
    assert app.test_client().get("/healthz").status_code == 200


@pytest.mark.skipif(not TEST_DATABASE_URL, reason="the database deadline is PostgreSQL's")
def test_readyz_deadline_does_not_outlive_the_probe(make_app, auth):
    # Out of time before it begins: 503; the next request has its own, full deadline.
    app = make_app(READYZ_TIMEOUT=0.000001)
    client = app.test_client()
    assert client.get("/readyz").status_code == 503
    assert client.get("/v1/pets", headers=auth).status_code == 200


def readyz_of_each_worker(server, times):
    """Ask /readyz `times` times of each worker, the others stopped (SIGSTOP) meanwhile, so that it
    alone accepts; return each worker's answers as (status, body, seconds)."""
    workers = worker_pids(server)
    assert len(workers) == 2
    answers = {}
    for worker in workers:
        others = [pid for pid in workers if pid != worker]
        for pid in others:
            os.kill(pid, signal.SIGSTOP)
        try:
            answers[worker] = []
            for _ in range(times):
                started = time.monotonic()
                response = requests.get(server.url + "/readyz", timeout=10)
                answers[worker].append(
                    (response.status_code, response.json(), time.monotonic() - started)
                )
        finally:
            for pid in others:
                os.kill(pid, signal.SIGCONT)
    return answers


def assert_every_worker_says(server, body, times=3):
    answers = readyz_of_each_worker(server, times)
    print({pid: [f"{seconds:.3f} s" for _, _, seconds in said] for pid, said in answers.items()})
    for said in answers.values():
        for status, answered, seconds in said:
            assert (status, answered) == (200, body)
            assert seconds < default_settings.READYZ_TIMEOUT + SLACK


def commits_waiting(cluster):
    """The server's backends whose COMMIT waits for a synchronous standby."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
    return int(cluster.sql(query, database="store"))


def test_readyz_says_when_commits_wait_for_a_synchronous_standby(start_gunicorn):
    # Strict synchronous mode: the primary names its one standby in synchronous_standby_names
    # (FIRST 1), so without it no commit returns.
    primary = start_own_cluster(replication="sync")
    standby = None
    try:
        url = primary.create_database("store")
        migrate_to_head(url)
        # Booting (seconds) while the standby is made.
        server = start_gunicorn(workers=2, database=url, wait=False)
        standby = primary.standby()
        server.wait_until_serving()
        # The probe commits, and the standby acknowledges it.
        assert_every_worker_says(server, READY)

        standby.kill()
        # Found by the probe itself, from each worker, within its timeout: no client wrote.
        assert_every_worker_says(server, WAITING)
        # No probe's commit is left waiting, holding a server connection: each was cancelled.
        assert commits_waiting(primary) == 0

        # The standby back and streaming: commits return, and so does the probe's.
        standby.start()
        primary.wait_for_streaming(standby)
        assert_every_worker_says(server, READY, times=1)

        # Lost again, then no longer waited for: the names cleared and the setting reloaded.
        standby.kill()
        assert_every_worker_says(server, WAITING, times=1)
        primary.sql("ALTER SYSTEM RESET synchronous_standby_names; SELECT pg_reload_conf();")
        # The checkpointer tells the backends; a CHECKPOINT waits until it has read the reload.
        primary.sql("CHECKPOINT")
        assert_every_worker_says(server, READY, times=1)
    finally:
        primary.stop()
        if standby is not None:
            standby.stop()
