"""A Redis that hangs (stopped with SIGSTOP, connections open, nothing answered) never holds up a
request: each worker counts alone while it does, /readyz says so at once, and the shared counts
resume by themselves when it answers again. The Redis is the test's own, never the machine's."""

import re
import time

import requests
from test_rate_limits import bearer, synced

# Recovery as the issue asks it: shared counts within 5 s of Redis answering again.
RECOVERY = 5.0
# /readyz answers within 0.5 s whatever hangs; the rest is this machine's slack.
READYZ_BUDGET = 0.5 + 0.5


def timed_get(get, path, **kwargs):
    started = time.monotonic()
    response = get(path, **kwargs)
    return response, time.monotonic() - started


def wait_for_counting(readyz, state, within):
    """Return the seconds until /readyz (what `readyz()` reads of it) says the counts are
    `state`; fail after `within`."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        answer, elapsed = timed_get(lambda _path: readyz(), "/readyz")
        assert elapsed < READYZ_BUDGET
        if answer["rateLimits"] == state:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"/readyz did not say {state!r} within {within}s")


def test_a_hung_redis_never_holds_up_a_request_and_no_count_is_lost(make_app, make_key, own_redis):
    worker, other_worker = (
        make_app(RATE_LIMIT="100 per hour", RATELIMIT_STORAGE_URI=own_redis.url).test_client()
        for _ in range(2)
    )
    headers = bearer(make_key())
    readyz = lambda: worker.get("/readyz").get_json()  # noqa: E731
    assert worker.get("/v1/pets", headers=headers).status_code == 200
    wait_for_counting(readyz, "shared", RECOVERY)

    own_redis.freeze()
    try:
        answers = [timed_get(worker.get, "/v1/pets", headers=headers) for _ in range(20)]
        # The first request waits out the socket timeout (0.1 s) and opens the breaker: the
        # others, within the retry interval (1 s), do not wait at all. None goes uncounted.
        waits = sorted(elapsed for _, elapsed in answers)
        assert waits[-1] < 0.1 + 0.3
        assert waits[-2] < 0.05
        remaining = [int(response.headers["RateLimit-Remaining"]) for response, _ in answers]
        assert remaining == list(range(98, 78, -1))
        wait_for_counting(readyz, "storage unreachable", RECOVERY)
        assert readyz()["status"] == "degraded"
    finally:
        own_redis.thaw()

    wait_for_counting(readyz, "shared", RECOVERY)
    assert readyz() == {"status": "ok", "database": "ok", "rateLimits": "shared"}
    # The 20 hits counted alone reached the shared count: another worker sees all 21.
    other_worker.get("/v1/pets", headers=headers)
    synced(worker, other_worker)
    shown = other_worker.get("/v1/pets", headers=headers).headers["RateLimit-Remaining"]
    assert shown == str(100 - 23)


def metric(url, name):
    text = requests.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def requests_served_in(url, headers, seconds):
    """Answers (all 200) to one client asking one after another for `seconds`."""
    session, served = requests.Session(), 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert session.get(url + "/v1/pets", headers=headers, timeout=10).status_code == 200
        served += 1
    return served


def test_gunicorn_serves_on_while_redis_hangs(start_gunicorn, make_key, own_redis):
    server = start_gunicorn(workers=2, env={"ANIMAL_STORE_RATELIMIT_STORAGE_URI": own_redis.url})
    readyz = lambda: requests.get(server.url + "/readyz", timeout=10).json()  # noqa: E731
    headers = bearer(make_key())
    healthy = requests_served_in(server.url, headers, 1.0)
    wait_for_counting(readyz, "shared", RECOVERY)

    own_redis.freeze()
    try:
        # From the moment it hangs: the figure is benchmarks/hung_redis.py's; this is a
        # loose bound (before, each request waited out the 0.5 s socket timeout: 3 a second).
        hung = requests_served_in(server.url, headers, 1.0)
        assert hung >= 0.5 * healthy
        wait_for_counting(readyz, "storage unreachable", RECOVERY)
    finally:
        own_redis.thaw()

    wait_for_counting(readyz, "shared", RECOVERY)
    assert metric(server.url, "animal_store_rate_limit_degraded_seconds_total") > 0
    assert "WORKER TIMEOUT" not in server.log()
