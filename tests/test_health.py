"""Liveness and readiness probes: outside /v1, no key, a 503 error object without a database."""

import time

import pytest
from conftest import TEST_DATABASE_URL, free_port


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probe_answers_without_a_key(client, path):
    response = client.get(path)
    assert response.status_code == 200
    assert response.get_json()["status"] == "ok"


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
