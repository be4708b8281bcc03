"""Clients that send nothing, or send slowly, straight to gunicorn on the shipped config and
settings (two sync workers): one such client per worker, renewed as soon as it ends, in one phase
after another (an idle connection; a head sent a byte a second; a body sent a byte a second),
while another client lists twice a second.

In every phase each slow client is done with within the deadline (REQUEST_HEADER_TIMEOUT for the
head, REQUEST_BODY_TIMEOUT for the body: 5 s each), with the 408 error object, or, having sent
nothing, a clean close; the list is answered within the deadline and a second every time; no
worker is killed, and nothing is logged as a 500 or a traceback. Before the deadlines each slow
client held its worker until gunicorn killed it (30 s) and got a 500.

Each phase lasts SLOW_CLIENTS_PHASE_SECONDS (10 s: two rounds of the deadline; docs/deploy.rst
gives the figures of a run at 60 s a phase).
"""

import json
import os
import select
import socket
import threading
import time

import pytest
import requests
from conftest import IN_POSTGRESQL_PASS

from animal_store import default_settings, errors

pytestmark = IN_POSTGRESQL_PASS

PHASE_SECONDS = float(os.environ.get("SLOW_CLIENTS_PHASE_SECONDS", "10"))
HEAD_DEADLINE = default_settings.REQUEST_HEADER_TIMEOUT
BODY_DEADLINE = default_settings.REQUEST_BODY_TIMEOUT
# What a busy 2-core machine may add to a deadline before a slow client hears of it.
MARGIN = 1.5
WORKERS = 2


def idle(connection: socket.socket, key: str) -> None:
    """Send nothing."""


def head_byte_a_second(connection: socket.socket, key: str) -> None:
    head = f"GET /v1/pets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n"
    byte_a_second(connection, head.encode())


def body_byte_a_second(connection: socket.socket, key: str) -> None:
    body = b'{"name": "Slow", "categoryId": 1, "status": "available"}'
    connection.sendall(
        b"POST /v1/pets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    byte_a_second(connection, body)


def byte_a_second(connection: socket.socket, data: bytes) -> None:
    """Send `data` a byte a second, until the server answers or closes."""
    for byte in data:
        connection.sendall(bytes([byte]))
        if select.select([connection], [], [], 1)[0]:
            return


# What each phase's slow clients do, and the deadline that ends them.
PHASES = {
    "idle": (idle, HEAD_DEADLINE),
    "head a byte a second": (head_byte_a_second, HEAD_DEADLINE),
    "body a byte a second": (body_byte_a_second, BODY_DEADLINE),
}


def slow_client(port, key, behave, stop, outcomes):
    """Connect and `behave`, then read what the server says, until `stop`; each round's
    (seconds from the connection to the server's end of it, what it answered) goes to
    `outcomes`."""
    while not stop.is_set():
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
            try:
                behave(connection, key)
                answer = b""
                while chunk := connection.recv(65536):
                    answer += chunk
            except OSError as error:  # a reset: the test fails on it
                answer = repr(error).encode()
        outcomes.append((time.monotonic() - started, answer))


def lister(url, key, stop, latencies):
    """List twice a second until `stop`; each (seconds, status) goes to `latencies`."""
    session = requests.Session()
    while not stop.is_set():
        started = time.monotonic()
        status = session.get(
            url + "/v1/pets", headers={"Authorization": f"Bearer {key}"}, timeout=60
        ).status_code
        took = time.monotonic() - started
        latencies.append((took, status))
        stop.wait(max(0.0, 0.5 - took))


@pytest.mark.parametrize("phase", PHASES)
def test_slow_clients_hold_a_worker_no_longer_than_the_deadline(
    start_gunicorn, api_key, count_pets, phase
):
    behave, deadline = PHASES[phase]
    server = start_gunicorn(workers=WORKERS)
    stop = threading.Event()
    outcomes: list[tuple[float, bytes]] = []
    latencies: list[tuple[float, int]] = []
    threads = [
        threading.Thread(target=slow_client, args=(server.port, api_key, behave, stop, outcomes))
        for _ in range(WORKERS)
    ]
    threads.append(threading.Thread(target=lister, args=(server.url, api_key, stop, latencies)))
    for thread in threads:
        thread.start()
    time.sleep(PHASE_SECONDS)
    stop.set()
    for thread in threads:
        thread.join(timeout=deadline + 30)

    # Every list answered, within the deadline and a second, however the slow clients held the
    # workers.
    assert latencies
    assert all(status == 200 for _, status in latencies), latencies
    slowest = max(took for took, _ in latencies)
    assert slowest <= deadline + 1, f"a list waited {slowest:.1f} s"
    # Every slow client done with within the deadline: a silent one closed, others answered 408.
    assert len(outcomes) >= WORKERS, outcomes
    expected = (
        errors.REQUEST_TIMEOUT.message.format(seconds=f"{BODY_DEADLINE:g}")
        if behave is body_byte_a_second
        else errors.HEAD_TIMEOUT.message.format(seconds=f"{HEAD_DEADLINE:g}")
    )
    for took, answer in outcomes:
        assert deadline - 0.1 <= took <= deadline + MARGIN, (took, answer)
        if behave is idle:
            assert answer == b""
        else:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), answer
            assert json.loads(body) == {
                "code": "request_timeout",
                "message": expected,
                "status": 408,
            }
    assert count_pets() == 0
    log = server.log()
    for sign in ("WORKER TIMEOUT", "Traceback", '"status":500', "Error handling request"):
        assert sign not in log
    # The two workers that started are the two that serve: none was killed and replaced.
    assert log.count("Worker ready") == WORKERS
