"""Per-key rate limits: 429 with the error object, Retry-After and RateLimit-* headers; one
budget per key across the pets operations; never on documents or health; off by a setting; a
broken store serves unlimited; with Redis the limit holds across gunicorn workers."""

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests
from conftest import IN_SQLITE_PASS, free_port

from animal_store import create_app
from animal_store.extensions import db

pytestmark = IN_SQLITE_PASS


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def limited(make_app, make_key):
    """A client of an app allowing 3 requests per hour per key, and headers with a fresh key."""

    def make(limit="3 per hour", **settings):
        app = make_app(RATE_LIMIT=limit, **settings)
        return app.test_client()

    return make


def test_limit_answers_429_with_error_object_and_headers(limited, make_key):
    client, headers = limited(), bearer(make_key())
    for remaining in (2, 1, 0):
        response = client.get("/v1/pets", headers=headers)
        assert response.status_code == 200
        assert response.headers["RateLimit-Limit"] == "3"
        assert response.headers["RateLimit-Remaining"] == str(remaining)
        assert 0 < int(response.headers["RateLimit-Reset"]) <= 3600
    response = client.get("/v1/pets", headers=headers)
    assert response.status_code == 429
    assert response.get_json() == {
        "code": "too_many_requests",
        "message": "Too many requests: the limit is 3 per 1 hour; see Retry-After.",
        "status": 429,
    }
    assert 0 < int(response.headers["Retry-After"]) <= 3600
    assert response.headers["RateLimit-Remaining"] == "0"
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_each_key_has_its_own_budget(limited, make_key):
    client, first, second = limited(), bearer(make_key("first")), bearer(make_key("second"))
    for _ in range(3):
        assert client.get("/v1/pets", headers=first).status_code == 200
    assert client.get("/v1/pets", headers=first).status_code == 429
    assert client.get("/v1/pets", headers=second).status_code == 200


def test_the_operations_share_one_budget(limited, make_key, count_pets):
    client, headers = limited(), bearer(make_key())
    assert client.get("/v1/pets", headers=headers).status_code == 200
    assert (
        client.post("/v1/pets", headers=headers, json={"name": "Rex", "categoryId": 1}).status_code
        == 201
    )
    assert client.get("/v1/pets/1", headers=headers).status_code == 200
    refused = client.post("/v1/pets", headers=headers, json={"name": "Max", "categoryId": 1})
    assert refused.status_code == 429
    assert count_pets() == 1  # the refused creation created nothing


@pytest.mark.parametrize("headers", [{}, bearer("ask_unknown"), {"Authorization": "Basic eDp5"}])
def test_requests_without_a_valid_key_are_refused_not_counted(limited, make_key, headers):
    client = limited("2 per hour")
    assert [client.get("/v1/pets", headers=headers).status_code for _ in range(3)] == [401] * 3
    # From the same address, a valid key still has its whole budget.
    valid = bearer(make_key())
    assert [client.get("/v1/pets", headers=valid).status_code for _ in range(3)] == [200, 200, 429]


@pytest.mark.parametrize("path", ["/v1/openapi.json", "/v1/docs", "/healthz", "/readyz", "/"])
def test_documents_and_health_are_never_limited(limited, make_key, path):
    client, headers = limited("1 per hour"), bearer(make_key())
    for _ in range(3):
        with client.get(path, headers=headers) as response:
            assert response.status_code != 429
            assert "RateLimit-Limit" not in response.headers


def test_limiting_can_be_switched_off(limited, make_key):
    client, headers = limited("1 per hour", RATELIMIT_ENABLED=False), bearer(make_key())
    for _ in range(3):
        response = client.get("/v1/pets", headers=headers)
        assert response.status_code == 200
        assert "RateLimit-Limit" not in response.headers


def test_environment_switches_limiting_off(monkeypatch, database_url):
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("ANIMAL_STORE_RATELIMIT_ENABLED", "false")
    monkeypatch.delenv("ANIMAL_STORE_ENV", raising=False)
    app = create_app()
    assert app.config["RATELIMIT_ENABLED"] is False
    try:
        for _ in range(3):
            response = app.test_client().get("/v1/pets")
            assert "RateLimit-Limit" not in response.headers
    finally:
        with app.app_context():
            db.engine.dispose()  # on PostgreSQL the request asked which server it is


def synced(*clients):
    """Have each app's worker sync its counts with Redis now, as its thread does every
    RATELIMIT_SYNC_INTERVAL."""
    for client in clients:
        client.application.extensions["animal_store_rate_limits"].sync()


def test_unreachable_storage_counts_per_process_and_logs_once(limited, make_key, caplog):
    client = limited("2 per hour", RATELIMIT_STORAGE_URI=f"redis://127.0.0.1:{free_port()}/0")
    headers = bearer(make_key())
    with caplog.at_level(logging.ERROR, logger="animal_store"):
        responses = []
        for _ in range(3):
            responses.append(client.get("/v1/pets", headers=headers))
            synced(client)
    assert [response.status_code for response in responses] == [200, 200, 429]
    assert [response.headers["RateLimit-Remaining"] for response in responses] == ["1", "0", "0"]
    assert caplog.text.count("Rate limit storage failed; each worker counts alone") == 1


def test_redis_storage_is_shared_between_apps(limited, make_key, redis_url):
    # Two apps stand for two workers: with Redis they count together once they have synced.
    first, second = (
        limited(RATELIMIT_STORAGE_URI=redis_url),
        limited(RATELIMIT_STORAGE_URI=redis_url),
    )
    headers = bearer(make_key())
    statuses = []
    for client in (first, second) * 2:
        statuses.append(client.get("/v1/pets", headers=headers).status_code)
        synced(first, second)
    assert statuses == [200, 200, 200, 429]


def test_the_suite_counts_in_a_redis_server_it_started(redis_url, suite_redis):
    # Never the machine's Redis at 127.0.0.1:6379, which the suite must not read, count in or
    # flush: the server behind the tests' URL is the process the suite started.
    with redis.Redis.from_url(redis_url) as connection:
        assert connection.info("server")["process_id"] == suite_redis.process.pid
    assert redis_url == f"redis://127.0.0.1:{suite_redis.port}/0" != "redis://127.0.0.1:6379/0"


def test_production_settings_count_in_the_suites_redis(
    start_gunicorn, production_env, redis_url, make_key
):
    server = start_gunicorn(workers=1, env=production_env)
    response = requests.get(server.url + "/v1/pets", headers=bearer(make_key()), timeout=10)
    assert response.status_code == 200
    assert requests.get(server.url + "/readyz", timeout=10).json()["rateLimits"] == "shared"
    with redis.Redis.from_url(redis_url) as connection:
        assert connection.dbsize() == 1  # the key's window, synced by its first request


def test_a_server_on_deployment_settings_without_a_redis_of_the_tests_is_refused(start_gunicorn):
    with pytest.raises(ValueError, match="count rate limits in the machine's Redis"):
        start_gunicorn(env={"ANIMAL_STORE_ENV": "production"})


def statuses_of_parallel_requests(url, headers, count):
    def get(_):
        # A new connection per request, so the requests spread over the workers.
        return requests.get(url, headers=headers, timeout=10).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(get, range(count)))


def test_limit_holds_across_four_gunicorn_workers(start_gunicorn, make_key, redis_url):
    # Requests further apart than a sync interval: each syncs, itself included, before its
    # worker decides, so every worker decides on the whole count.
    server = start_gunicorn(
        workers=4,
        env={
            "ANIMAL_STORE_RATE_LIMIT": "10 per hour",
            "ANIMAL_STORE_RATELIMIT_STORAGE_URI": redis_url,
        },
    )
    headers, statuses = bearer(make_key()), []
    for _ in range(16):
        # A new connection per request, so the requests spread over the workers.
        statuses.append(requests.get(server.url + "/v1/pets", headers=headers, timeout=10))
        time.sleep(0.1)
    assert [response.status_code for response in statuses] == [200] * 10 + [429] * 6
    remaining = [int(response.headers["RateLimit-Remaining"]) for response in statuses]
    assert remaining == [*range(9, -1, -1)] + [0] * 6


def test_an_interval_of_0_counts_exactly_at_any_pace(start_gunicorn, make_key, redis_url):
    server = start_gunicorn(
        workers=4,
        env={
            "ANIMAL_STORE_RATE_LIMIT": "20 per hour",
            "ANIMAL_STORE_RATELIMIT_STORAGE_URI": redis_url,
            "ANIMAL_STORE_RATELIMIT_SYNC_INTERVAL": "0",
        },
    )
    statuses = statuses_of_parallel_requests(server.url + "/v1/pets", bearer(make_key()), 60)
    assert statuses.count(200) == 20
    assert statuses.count(429) == 40


def test_memory_storage_multiplies_the_limit_by_the_workers(start_gunicorn, make_key):
    # Why docs/operations.rst says to use Redis with several workers: each counts on its own.
    server = start_gunicorn(workers=4, env={"ANIMAL_STORE_RATE_LIMIT": "20 per hour"})
    # 100 requests exceed even four separate budgets of 20, so some are refused whatever the spread.
    statuses = statuses_of_parallel_requests(server.url + "/v1/pets", bearer(make_key()), 100)
    assert 20 < statuses.count(200) <= 4 * 20
    assert set(statuses) == {200, 429}


def test_a_key_has_the_limit_the_cli_gives_it(limited, runner, count_pets):
    client = limited("5 per hour")
    created = runner.invoke(args=["keys", "create", "bulk", "--rate-limit", "2 per hour"])
    assert created.exit_code == 0, created.output
    headers = bearer(created.output.strip().splitlines()[-1])
    statuses = [client.get("/v1/pets", headers=headers).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    assert client.get("/v1/pets", headers=headers).headers["RateLimit-Limit"] == "2"


@pytest.mark.parametrize(
    ("limit", "expected", "said"),
    [
        ("3/hour", "3", "API key 'changing' now has the rate limit 3/hour.\n"),
        (
            "default",
            "5",
            "API key 'changing' now has the default rate limit, 5 per hour (RATE_LIMIT).\n",
        ),
    ],
)
def test_set_limit_changes_a_keys_limit_within_the_key_cache_delay(
    make_app, make_key, limit, expected, said
):
    # A cache of 0 s: the change applies to the next request (KEY_CACHE_SECONDS otherwise).
    app = make_app(RATE_LIMIT="5 per hour", KEY_CACHE_SECONDS=0)
    headers = bearer(make_key("changing"))
    runner, client = app.test_cli_runner(), app.test_client()
    assert runner.invoke(args=["keys", "set-limit", "changing", "1/second"]).exit_code == 0
    assert client.get("/v1/pets", headers=headers).headers["RateLimit-Limit"] == "1"
    result = runner.invoke(args=["keys", "set-limit", "changing", limit])
    assert result.exit_code == 0, result.output
    assert result.stdout == said
    assert client.get("/v1/pets", headers=headers).headers["RateLimit-Limit"] == expected
    listed = runner.invoke(args=["keys", "list"]).output
    assert (limit if limit != "default" else "5 per hour (default)") in listed


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "create", "bad", "--rate-limit", "lots"],
        ["keys", "create", "bad", "--rate-limit", "10 per fortnight"],
        ["keys", "set-limit", "tester", "0.5/second"],
        ["keys", "set-limit", "tester", ""],
        ["keys", "set-limit", "nobody", "1/second"],
    ],
)
def test_a_limit_that_is_no_limit_is_refused_and_nothing_changes(runner, make_key, args):
    make_key("tester")
    before = runner.invoke(args=["keys", "list"]).output
    result = runner.invoke(args=args)
    assert result.exit_code != 0
    assert "not a rate limit" in result.output or "No key named 'nobody'" in result.output
    assert runner.invoke(args=["keys", "list"]).output == before


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({}, "per process"),
        ({"RATELIMIT_ENABLED": False}, "off"),
        ({"RATELIMIT_STORAGE_URI": f"redis://127.0.0.1:{free_port()}/0"}, "storage unreachable"),
    ],
)
def test_readyz_says_how_limits_are_counted(make_app, settings, said):
    response = make_app(**settings).test_client().get("/readyz")
    assert response.status_code == 200
    status = "degraded" if said == "storage unreachable" else "ok"
    assert response.get_json() == {"status": status, "database": "ok", "rateLimits": said}


def test_readyz_says_shared_with_redis(make_app, redis_url):
    response = make_app(RATELIMIT_STORAGE_URI=redis_url).test_client().get("/readyz")
    assert response.get_json() == {"status": "ok", "database": "ok", "rateLimits": "shared"}


@pytest.mark.parametrize(("storage", "warned"), [("memory://", True), ("redis", False)])
def test_workers_warn_at_boot_when_they_count_apart(start_gunicorn, redis_url, storage, warned):
    uri = redis_url if storage == "redis" else storage
    server = start_gunicorn(workers=2, env={"ANIMAL_STORE_RATELIMIT_STORAGE_URI": uri})
    warning = "Rate limits are counted in each worker's memory"
    assert server.log().count(warning) == (2 if warned else 0)
    if warned:
        assert "with 2 workers a key may make up to 2 times its limit" in server.log()
    expected = "per process" if warned else "shared"
    assert requests.get(server.url + "/readyz", timeout=5).json()["rateLimits"] == expected


def test_a_worker_that_did_not_open_the_window_learns_its_end(limited, make_key, redis_url):
    # The second app (a second worker) finds the window open at its first sync: Redis tells it
    # the count and when the window ends.
    first, second = (
        limited("5 per hour", RATELIMIT_STORAGE_URI=redis_url),
        limited("5 per hour", RATELIMIT_STORAGE_URI=redis_url),
    )
    headers = bearer(make_key())
    opened = first.get("/v1/pets", headers=headers).headers
    synced(first)
    second.get("/v1/pets", headers=headers)
    synced(second)
    found = second.get("/v1/pets", headers=headers).headers
    assert found["RateLimit-Remaining"] == "2"
    assert 3590 <= int(found["RateLimit-Reset"]) <= 3600
    assert abs(int(found["RateLimit-Reset"]) - int(opened["RateLimit-Reset"])) <= 1


def test_a_new_window_opens_when_the_last_ends(limited, make_key):
    client, headers = limited("1 per second"), bearer(make_key())
    assert client.get("/v1/pets", headers=headers).status_code == 200
    refused = client.get("/v1/pets", headers=headers)
    assert refused.status_code == 429
    time.sleep(int(refused.headers["Retry-After"]) + 0.1)
    again = client.get("/v1/pets", headers=headers)
    assert again.status_code == 200
    assert again.headers["RateLimit-Remaining"] == "0"
    assert int(again.headers["RateLimit-Reset"]) == 1


@pytest.mark.parametrize(
    ("limit", "statuses", "shown"),
    [("5/second;2/hour", [200, 200, 429], "2"), ("2/second;5/hour", [200, 200, 429], "2")],
)
def test_each_of_several_limits_is_counted(limited, make_key, limit, statuses, shown):
    client, headers = limited(limit), bearer(make_key())
    responses = [client.get("/v1/pets", headers=headers) for _ in statuses]
    assert [response.status_code for response in responses] == statuses
    assert responses[-1].headers["RateLimit-Limit"] == shown
    # Until one is exceeded, the headers show the shortest window's.
    assert responses[0].headers["RateLimit-Limit"] == limit.split("/")[0]
