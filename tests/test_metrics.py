"""Prometheus metrics at /metrics: under gunicorn the figures are the sum over its workers, and a
scrape after a known set of requests counts exactly those (each worker's within a second or two,
or at once with METRICS_WRITE_INTERVAL 0); no label holds a key, a query or an address; nginx
hides /metrics from the internet."""

import os
import re
import signal
import time
from urllib.parse import urlsplit

import pytest
import requests
from conftest import IN_SQLITE_PASS
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from animal_store.observability.metrics import DURATION_BUCKETS, SeriesCounts, request_metrics

pytestmark = IN_SQLITE_PASS

# Every answer written to the worker's files at once: a scrape right after counts it.
WRITTEN_AT_ONCE = {"ANIMAL_STORE_METRICS_WRITE_INTERVAL": "0"}


def scrape(url) -> dict:
    """{(name, labels as a sorted tuple): value} of one scrape."""
    response = requests.get(url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples, response.text


def count(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0)


def test_a_scrape_counts_exactly_what_two_workers_answered(
    app, runner, api_key, make_pet, redis_url, start_gunicorn
):
    pet_id = make_pet()
    limited = runner.invoke(args=["keys", "create", "limited", "--rate-limit", "2/hour"])
    limited_key = limited.output.split()[-1]
    reader = runner.invoke(args=["keys", "create", "reader", "--scopes", "read"]).output.split()[-1]
    # Rate limits counted in Redis, exactly (synced on every request), so the limited key's third
    # request is refused by either worker.
    server = start_gunicorn(
        workers=2,
        env={
            "ANIMAL_STORE_RATELIMIT_STORAGE_URI": redis_url,
            "ANIMAL_STORE_RATELIMIT_SYNC_INTERVAL": "0",
            **WRITTEN_AT_ONCE,
        },
    )
    url, auth = server.url, {"Authorization": f"Bearer {api_key}"}

    def send(method, path, headers=auth, **kwargs):
        # A new connection each time (sync workers close them), so both workers answer some.
        return requests.request(method, url + path, headers=headers, timeout=10, **kwargs)

    sent = {}
    for _ in range(5):
        sent.setdefault(("listPets", "200"), []).append(send("GET", "/v1/pets?limit=3"))
    for n in range(3):
        body = {"name": f"Rex {n}", "categoryId": n}
        sent.setdefault(("createPet", "201"), []).append(send("POST", "/v1/pets", json=body))
    replay = {**auth, "Idempotency-Key": "metrics-1"}
    for _ in range(2):  # the second is a replay, a 201 too
        sent[("createPet", "201")].append(
            send("POST", "/v1/pets", replay, json={"name": "Kitty", "categoryId": 9})
        )
    for _ in range(4):
        sent.setdefault(("getPet", "200"), []).append(send("GET", f"/v1/pets/{pet_id}"))
    sent[("getPet", "404")] = [send("GET", "/v1/pets/999999") for _ in range(2)]
    sent[("listPets", "401")] = [
        send("GET", "/v1/pets", {}),
        send("GET", "/v1/pets", {}),
        send("GET", "/v1/pets", {"Authorization": "Bearer ask_wrong"}),
    ]
    sent[("createPet", "403")] = [send("POST", "/v1/pets", {"Authorization": f"Bearer {reader}"})]
    sent[("listPets", "429")] = []
    for _ in range(3):
        response = send("GET", "/v1/pets", {"Authorization": f"Bearer {limited_key}"})
        sent.setdefault(("listPets", str(response.status_code)), []).append(response)
    sent[("unmatched", "404")] = [send("GET", "/v1/nowhere?secret=1")]
    sent[("preflight", "204")] = [send("OPTIONS", "/v1/pets", {})]
    for (_, status), responses in sent.items():
        assert [r.status_code for r in responses] == [int(status)] * len(responses)

    samples, text = scrape(url)
    for (operation, status), responses in sent.items():
        assert count(
            samples, "animal_store_requests_total", operation=operation, status=status
        ) == len(responses), (operation, status)
    assert count(samples, "animal_store_rate_limited_total") == 1
    assert count(samples, "animal_store_idempotent_replays_total") == 1
    assert count(samples, "animal_store_auth_failures_total", reason="missing") == 2
    assert count(samples, "animal_store_auth_failures_total", reason="invalid") == 1
    assert count(samples, "animal_store_auth_failures_total", reason="scope") == 1
    list_200 = count(
        samples,
        "animal_store_request_duration_seconds_count",
        operation="listPets",
        status_class="2xx",
    )
    assert list_200 == 5 + 2  # the limited key's two answered lists
    # The 13 answered reads reached the primary, all but those a worker's kept answers served
    # (answers.py): at least the 404s and the limited key's last pages, never kept. No standby
    # is configured: no series of theirs, and nothing sent back from one.
    assert 4 <= count(samples, "animal_store_database_reads_total", server="primary") <= 13
    assert ("animal_store_database_reads_total", (("server", "standby"),)) not in samples
    for reason in ("walk", "lag", "promoted", "timeline", "down", "not_found"):
        assert (
            count(samples, "animal_store_database_reads_sent_to_primary_total", reason=reason) == 0
        )
    assert count(samples, "animal_store_processes") == 3  # the master and two workers
    assert count(samples, "process_resident_memory_bytes") > 0
    # The scrape is counted by the next one.
    again, _ = scrape(url)
    assert count(again, "animal_store_requests_total", operation="metrics", status="200") == 1

    # No label holds a key, its prefix, a query string or a client's address. The one address a
    # label holds is the Redis the workers count in (access/rate_limits.py), on purpose.
    storage = {
        labels for (name, labels) in samples if name == "animal_store_rate_limit_storage_workers"
    }
    assert storage == {(("address", urlsplit(redis_url).netloc),)}
    labels = " ".join(
        re.findall(r"\{[^}]*\}", text.replace(f'{{address="{urlsplit(redis_url).netloc}"}}', ""))
    )
    for secret in (api_key, api_key[:10], limited_key[:10], "secret=1", "127.0.0.1", "nowhere"):
        assert secret not in labels


def test_counters_survive_a_worker_being_replaced(api_key, start_gunicorn):
    server = start_gunicorn(workers=1)
    auth = {"Authorization": f"Bearer {api_key}"}
    for _ in range(3):
        requests.get(server.url + "/v1/pets", headers=auth, timeout=10)
    before, _ = scrape(server.url)  # the one worker writes its counts first
    assert count(before, "animal_store_processes") == 2
    (worker_pid,) = re.findall(r"Worker ready \(pid: (\d+)\)", server.log())
    os.kill(int(worker_pid), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while server.log().count("Worker ready") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    after, _ = scrape(server.url)
    assert count(after, "animal_store_requests_total", operation="listPets", status="200") == 3


def written(metrics_dir) -> dict:
    """{(name, labels as a sorted tuple): value} as the workers' files hold them now, read
    without a request to any worker."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def test_idle_workers_write_what_they_counted_and_their_idle_time(
    api_key, start_gunicorn, tmp_path
):
    server = start_gunicorn(workers=2, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    auth = {"Authorization": f"Bearer {api_key}"}
    for _ in range(40):  # each worker's first answer is written at once, the others later
        requests.get(server.url + "/v1/pets", headers=auth, timeout=10)
    sent = time.monotonic()
    lists = []
    while time.monotonic() - sent < 10:
        lists.append(
            count(
                written(tmp_path), "animal_store_requests_total", operation="listPets", status="200"
            )
        )
        if lists[-1] == 40:
            break
        time.sleep(0.1)
    # Counted in memory first: the files lagged the answers. Then, with no request to either
    # worker, the workers woke and wrote them (gunicorn.conf.py's notify hook).
    assert lists[0] < 40
    assert lists[-1] == 40, lists
    # Within two seconds of the last request (the hook wakes an idle worker every second), with
    # a loaded machine's slack: well under the 15 s an idle worker would otherwise wait.
    assert time.monotonic() - sent < 5

    # Idle, each worker counts the time it waits for a connection, and the time it runs: two
    # workers, two seconds a second each (give or take what each leaves unwritten at either end).
    names = ("animal_store_worker_idle_seconds_total", "animal_store_worker_seconds_total")
    before = written(tmp_path)
    time.sleep(3)
    after = written(tmp_path)
    idle, run = (count(after, name) - count(before, name) for name in names)
    assert 2 * 3 - 2 * 2 <= idle <= 2 * 3 + 2 * 2, idle
    assert 2 * 3 - 2 * 2 <= run <= 2 * 3 + 2 * 2, run


def test_a_worker_writes_what_it_counted_when_it_stops(api_key, start_gunicorn):
    # An interval no test reaches: only the first answer and the worker's exit write.
    server = start_gunicorn(workers=1, env={"ANIMAL_STORE_METRICS_WRITE_INTERVAL": "3600"})
    auth = {"Authorization": f"Bearer {api_key}"}
    for _ in range(3):
        requests.get(server.url + "/v1/pets", headers=auth, timeout=10)
    os.kill(server.process.pid, signal.SIGHUP)  # a reload: the worker exits, another starts
    deadline = time.monotonic() + 20
    while server.log().count("Worker ready") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    after, _ = scrape(server.url)
    assert count(after, "animal_store_requests_total", operation="listPets", status="200") == 3


def test_answers_are_counted_in_memory_until_written(make_app, make_key):
    app = make_app(METRICS_WRITE_INTERVAL=3600)
    client, key = app.test_client(), make_key()
    labels = {"operation": "listPets", "status": "200"}

    def lists():
        return REGISTRY.get_sample_value("animal_store_requests_total", labels) or 0

    first = lists()
    # Run seconds only beside idle ones (a gunicorn sync worker's): alone they would read busy.
    run = REGISTRY.get_sample_value("animal_store_worker_seconds_total")
    for _ in range(4):
        assert client.get("/v1/pets", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert lists() == first + 1  # the first answer found the write due; the rest wait for it
    request_metrics(app).write()
    assert REGISTRY.get_sample_value("animal_store_worker_seconds_total") == run
    assert lists() == first + 4
    assert client.get("/metrics").status_code == 200  # a scrape writes its process's counts
    assert REGISTRY.get_sample_value("animal_store_requests_total", labels) == first + 4


def test_answers_written_together_read_as_each_observed():
    seconds = [0.0004, 0.001, 0.001, 0.003, 0.7, 2.5, 30, 0]
    observed, together = CollectorRegistry(), CollectorRegistry()
    observed_histogram = Histogram("t", "t", buckets=DURATION_BUCKETS, registry=observed)
    for value in seconds:
        observed_histogram.observe(value)
    answers = SeriesCounts()
    for value in seconds:
        answers.add(value)
    answers.write(Histogram("t", "t", buckets=DURATION_BUCKETS, registry=together))

    def text(registry):  # without the moment each was created
        return [
            line
            for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line
        ]

    assert text(together) == text(observed)


@pytest.mark.parametrize("path", ["/metrics", "/metrics?x=1"])
def test_nginx_hides_metrics_from_the_internet(start_gunicorn, start_nginx, certificate, path):
    gunicorn = start_gunicorn(workers=1)
    nginx = start_nginx([gunicorn.url.removeprefix("http://")])
    response = requests.get(nginx.url + path, verify=str(certificate[0]), timeout=10)
    assert response.status_code == 404
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    # The very object the app answers for a path it does not have.
    app_answer = requests.get(gunicorn.url + "/metrics-nowhere", timeout=10).json()
    assert response.json() == {**app_answer, "message": "No resource at /metrics."}
