"""The instance's metrics on a listener of their own (ANIMAL_STORE_METRICS_BIND), served by a
process beside gunicorn's master (animal_store/observability/master_metrics.py): answered while
every worker is stuck, with the listening socket's queue; a listener that cannot start stops the
boot; the process goes with its master."""

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
import requests
from conftest import IN_SQLITE_PASS, PROJECT_DIR, free_port
from prometheus_client.parser import text_string_to_metric_families

from animal_store.version import VERSION

pytestmark = IN_SQLITE_PASS

BACKLOG = int(
    re.search(
        r"^backlog = (\d+)$", (PROJECT_DIR / "config" / "gunicorn.conf.py").read_text(), re.M
    )[1]
)


def scrape(url, timeout=10) -> dict:
    """{(name, labels as a sorted tuple): value} of one scrape."""
    response = requests.get(url, timeout=timeout)
    response.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def figure(samples, name) -> float:
    (value,) = [value for (found, _labels), value in samples.items() if found == name]
    return value


def worker_pids(server) -> list[int]:
    return [int(pid) for pid in re.findall(r"Worker ready \(pid: (\d+)\)", server.log())]


@pytest.fixture
def metrics_gunicorn(start_gunicorn):
    port = free_port()
    server = start_gunicorn(workers=2, env={"ANIMAL_STORE_METRICS_BIND": f"127.0.0.1:{port}"})
    server.metrics_port = port
    server.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return server


def test_metrics_are_answered_with_the_queue_while_every_worker_is_stuck(metrics_gunicorn):
    server = metrics_gunicorn
    listener = f"127.0.0.1:{server.port}"
    requests.get(server.url + "/healthz", timeout=10).raise_for_status()
    workers = worker_pids(server)
    assert len(workers) == 2
    waiting = []
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        # Six clients' requests that no worker takes: they wait in the listening socket's queue.
        for _ in range(6):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            waiting.append(client)
        with pytest.raises(requests.Timeout):
            requests.get(server.url + "/metrics", timeout=1)  # waits behind them
        started = time.monotonic()
        samples = scrape(server.metrics_url, timeout=5)
        took = time.monotonic() - started
        print(f"a scrape with every worker stuck: {took * 1000:.1f} ms")
        labels = (("listener", listener),)
        # The six, and the app's own /metrics just tried.
        assert samples["animal_store_listen_queue_connections", labels] == 7
        assert samples["animal_store_listen_queue_connections_max", labels] == 7
        # gunicorn's backlog as shipped, as far as the kernel grants it.
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert samples["animal_store_listen_queue_backlog", labels] == min(BACKLOG, somaxconn)
        assert figure(samples, "animal_store_listen_queue_overflows_total") >= 0
        assert figure(samples, "animal_store_processes") == 4  # master, 2 workers, this one
        # The workers' own figures, summed from their files though none of them runs.
        assert samples["animal_store_build_info", (("version", VERSION),)] == 1
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    for client in waiting:
        assert client.recv(64).startswith(b"HTTP/1.1 200 "), "a waiting request was not served"
        client.close()
    # Served: the queue is empty, and its highest since the last scrape was 7 at most.
    samples = scrape(server.metrics_url)
    assert samples["animal_store_listen_queue_connections", labels] == 0
    assert samples["animal_store_listen_queue_connections_max", labels] <= 7


def test_the_metrics_process_goes_with_its_master(metrics_gunicorn):
    server = metrics_gunicorn
    scrape(server.metrics_url)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", server.metrics_port), timeout=1).close()
        except ConnectionRefusedError:
            break  # its port is free again
        assert time.monotonic() < deadline, "the metrics' process outlived its master"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("bind", "said"),
    [
        ("9101", "ANIMAL_STORE_METRICS_BIND is '9101': expected host:port"),
        ("127.0.0.1:0", "ANIMAL_STORE_METRICS_BIND is '127.0.0.1:0': expected host:port"),
        ("127.0.0.1:70000", "ANIMAL_STORE_METRICS_BIND is '127.0.0.1:70000': expected host:port"),
        ("taken", "Cannot serve the metrics on 127.0.0.1:{port}: Address already in use."),
    ],
)
def test_a_metrics_listener_that_cannot_start_stops_the_boot_in_one_line(
    start_gunicorn, bind, said
):
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        if bind == "taken":
            bind = f"127.0.0.1:{port}"
        server = start_gunicorn(env={"ANIMAL_STORE_METRICS_BIND": bind}, wait=False)
        assert server.process.wait(timeout=60) == 1
    log = server.log()
    assert [line for line in log.splitlines() if '"level":"ERROR"' in line] == [
        line for line in log.splitlines() if said.format(port=port) in line
    ]
    assert said.format(port=port) in log
    assert "Worker ready" not in log


def test_a_new_instance_has_every_reasons_series_at_zero(metrics_gunicorn):
    # Before any refusal: rate() over a series that does not exist yet reads nothing, and misses
    # the first refusal.
    samples = scrape(metrics_gunicorn.metrics_url)
    for name, reasons in [
        ("animal_store_refusals_total", ("rate_limit", "auth_failures")),
        ("animal_store_auth_failures_total", ("missing", "invalid", "expired", "scope")),
    ]:
        for reason in reasons:
            assert samples[name, (("reason", reason),)] == 0, (name, reason)
