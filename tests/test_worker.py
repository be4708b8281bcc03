"""The store's gunicorn worker (animal_store/serving/worker.py), straight against a real
gunicorn on the shipped config, with raw sockets so that what happens on the connection is what
the test sees: a body that stops coming is answered 408 and frees the worker; a connection whose
request is all read ends at once, so a client that keeps it open holds no worker; one whose body
the app left unread ends gracefully, so its answer arrives whole.

(Its error answers, idle time and counts are in tests/test_gunicorn.py and tests/test_metrics.py;
a reload onto a release with other worker code in tests/test_releases.py.)"""

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import IN_SQLITE_PASS, Gunicorn

from animal_store import errors
from animal_store.access.auth import issue_key
from animal_store.default_settings import MAX_CONTENT_LENGTH
from animal_store.extensions import db

pytestmark = IN_SQLITE_PASS

# Short enough for the test, long enough that no busy machine's pause reads as a stalled client.
BODY_TIMEOUT = 2
STALLED_BODIES = {
    "content-length": b"Content-Length: 100\r\n\r\n" + b'{"name":',
    "chunked": b"Transfer-Encoding: chunked\r\n\r\n8\r\n" + b'{"name":\r\n',
}


def send(port, head: bytes, key=None, body: bytes = b"") -> socket.socket:
    """Open a connection and send a request's head and what there is of its body."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    authorization = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    connection.sendall(head + b"Host: 127.0.0.1\r\n" + authorization + body)
    return connection


def read_answer(connection: socket.socket) -> tuple[int, dict, bytes]:
    """Read until the server closes, and close: the status, the JSON body, and the raw answer."""
    answer = b""
    with connection:
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), answer


@pytest.fixture(scope="module")
def worker_gunicorn(module_database, tmp_path_factory):
    """Two workers with a short body timeout for the module's tests (a boot is seconds); each
    test's app, its key and its count of animals, is on the database they serve."""
    log_path = tmp_path_factory.mktemp("worker-gunicorn") / "gunicorn.log"
    env = {"ANIMAL_STORE_REQUEST_BODY_TIMEOUT": str(BODY_TIMEOUT)}
    server = Gunicorn(module_database, workers=2, env=env, log_path=log_path)
    try:
        yield server.wait_until_serving()
    finally:
        server.stop()


@pytest.fixture
def database_url(emptied_module_database):
    return emptied_module_database


def get(port, key) -> socket.socket:
    return send(port, b"GET /v1/pets HTTP/1.1\r\n", key, b"\r\n")


@pytest.mark.parametrize("framing", STALLED_BODIES)
def test_a_body_that_stops_coming_is_answered_408_and_frees_the_worker(
    worker_gunicorn, api_key, count_pets, framing
):
    port, key = worker_gunicorn.port, api_key
    head = b"POST /v1/pets HTTP/1.1\r\nContent-Type: application/json\r\n"
    started = time.monotonic()
    # As many stalled clients as workers: before, each held its worker until gunicorn's timeout
    # killed it (30 s), and a list waited as long.
    stalled = [send(port, head, key, STALLED_BODIES[framing]) for _ in range(2)]
    time.sleep(0.2)
    status, _, _ = read_answer(get(port, key))
    listed_after = time.monotonic() - started
    answers = [read_answer(connection) for connection in stalled]
    assert status == 200
    # The bound is the body timeout with a loaded machine's margin, far below gunicorn's 30 s.
    assert listed_after < BODY_TIMEOUT + 4
    expected = errors.REQUEST_TIMEOUT.message.format(seconds=BODY_TIMEOUT)
    for status, body, _ in answers:
        assert (status, body["code"], body["message"]) == (408, "request_timeout", expected)
    assert count_pets() == 0
    assert '"status":500' not in worker_gunicorn.log()


def test_a_connection_a_worker_holds_is_blocking_and_closed_on_exec(worker_gunicorn, api_key):
    # The worker skips gunicorn's fcntl(2) calls that make both so (Worker.accept): Python's
    # accept must have made them so already, read here from the kernel's own record of the
    # worker's descriptor. Non-blocking, the worker's reads would fail; inherited, a process
    # the app started would hold the client's connection open.
    head = b"POST /v1/pets HTTP/1.1\r\nContent-Type: application/json\r\n"
    stalled = send(worker_gunicorn.port, head, api_key, STALLED_BODIES["content-length"])
    try:
        client_port = stalled.getsockname()[1]
        flags = descriptor_flags(worker_gunicorn.process.pid, worker_gunicorn.port, client_port)
    finally:
        read_answer(stalled)
    assert flags & os.O_CLOEXEC, f"flags {flags:o}"
    assert not flags & os.O_NONBLOCK, f"flags {flags:o}"


def descriptor_flags(master: int, port: int, client_port: int, timeout: float = 10) -> int:
    """Return the open flags of the descriptor by which a worker of `master` holds the connection
    from `client_port` to `port`, once a worker has accepted it (/proc/net/tcp names its inode)."""
    local, remote = f"0100007F:{port:04X}", f"0100007F:{client_port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inodes = {
            fields[9]
            for fields in map(str.split, Path("/proc/net/tcp").read_text().splitlines()[1:])
            if (fields[1], fields[2]) == (local, remote)
        }
        workers = Path(f"/proc/{master}/task/{master}/children").read_text().split()
        for worker in workers:
            for descriptor in Path(f"/proc/{worker}/fd").iterdir():
                try:
                    target = os.readlink(descriptor)
                except FileNotFoundError:
                    continue  # closed meanwhile
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    info = Path(f"/proc/{worker}/fdinfo/{descriptor.name}").read_text()
                    return int(info.split("flags:")[1].split()[0], 8)
        time.sleep(0.05)
    raise AssertionError(f"no worker of {master} holds the connection from port {client_port}")


def test_a_client_that_keeps_its_connection_open_holds_no_worker(worker_gunicorn, api_key):
    # gunicorn's graceful end waits up to 2 s for the client's side to close: ten clients in
    # turn that read their answer and keep the connection open held the two workers 8 to 10 s.
    port = worker_gunicorn.port
    started = time.monotonic()
    held = []
    for _ in range(10):
        connection = get(port, api_key)
        answer = b""
        while not answer.endswith(b"]"):
            answer += connection.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        held.append(connection)
    took = time.monotonic() - started
    for connection in held:
        # The server closed its side at once: the connection reads as ended.
        connection.settimeout(5)
        assert connection.recv(1) == b""
        connection.close()
    assert took < 5, f"ten answers took {took:.1f} s: a worker waited for clients to close"


def test_an_answer_to_a_request_whose_body_was_not_read_arrives_whole(worker_gunicorn):
    # The app answers 401 before it reads the body: closing at once with those bytes unread
    # would send a reset, which can cut the answer before the client reads it.
    port = worker_gunicorn.port
    body = b"x" * 32_768
    head = f"POST /v1/pets HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode()
    connection = send(port, head, body=b"\r\n" + body)
    # What a reset would do has happened by the time the client reads.
    time.sleep(0.3)
    status, answer, _ = read_answer(connection)
    assert (status, answer["code"]) == (401, "unauthorized")


def test_a_body_sent_in_pieces_within_the_deadline_is_served(worker_gunicorn, api_key):
    port, key = worker_gunicorn.port, api_key
    body = b'{"name": "Rex", "categoryId": 1}'
    head = (
        b"POST /v1/pets HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
    )
    connection = send(port, head, key, b"\r\n")
    # Four pauses, 0.4 s in all: a fifth of the deadline, which a busy machine's delays keep.
    trickle(connection, body, BODY_TIMEOUT * 0.05, pieces=4)
    status, created, _ = read_answer(connection)
    assert (status, created["name"]) == (201, "Rex")


def test_a_body_trickling_past_the_deadline_is_answered_408_at_the_deadline(
    worker_gunicorn, api_key, count_pets
):
    # A byte every 0.2 s: no read waits long, which a bound on each read (gunicorn's, or this
    # worker's before) never stopped; the deadline bounds the whole body.
    port, key = worker_gunicorn.port, api_key
    body = b'{"name": "Rex", "categoryId": 1}'
    head = (
        b"POST /v1/pets HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
    )
    started = time.monotonic()
    connection = send(port, head, key, b"\r\n")
    sender = threading.Thread(target=trickle, args=(connection, body, 0.2, len(body)))
    sender.start()
    status, answer, _ = read_answer(connection)
    answered_after = time.monotonic() - started
    sender.join()
    expected = errors.REQUEST_TIMEOUT.message.format(seconds=BODY_TIMEOUT)
    assert (status, answer["code"], answer["message"]) == (408, "request_timeout", expected)
    # The whole body would take 6.4 s.
    assert BODY_TIMEOUT <= answered_after < BODY_TIMEOUT + 3
    assert count_pets() == 0


# A chunk size that says the body goes past the limit, and the answer nginx gives it at once.
OVERSIZED_CHUNKS = {
    "overflowing 64 bits": (b"ffffffffffffffff", 400, errors.MALFORMED_BODY),
    "over the largest nginx takes": (b"8000000000000000", 400, errors.MALFORMED_BODY),
    "the largest nginx takes": (b"7fffffffffffffff", 413, errors.PAYLOAD_TOO_LARGE),
    "a byte over the limit": (
        f"{MAX_CONTENT_LENGTH + 1:x}".encode(),
        413,
        errors.PAYLOAD_TOO_LARGE,
    ),
}


@pytest.mark.parametrize("chunk", OVERSIZED_CHUNKS)
def test_a_chunk_past_the_limit_is_refused_at_once(worker_gunicorn, api_key, count_pets, chunk):
    # gunicorn read on, waiting for the bytes the size promised, until the body's deadline (408).
    size, status, kind = OVERSIZED_CHUNKS[chunk]
    head = b"POST /v1/pets HTTP/1.1\r\nContent-Type: application/json\r\n"
    started = time.monotonic()
    connection = send(worker_gunicorn.port, head, api_key, b"Transfer-Encoding: chunked\r\n\r\n")
    connection.sendall(size + b'\r\n{"name":')
    answered, answer, _ = read_answer(connection)
    assert (answered, answer["code"]) == (status, kind.code)
    assert time.monotonic() - started < BODY_TIMEOUT
    assert count_pets() == 0


def trickle(connection, body, pause, pieces):
    """Send a body in `pieces` pieces, `pause` seconds apart; stop when the server has closed."""
    size = -(-len(body) // pieces)
    for start in range(0, len(body), size):
        time.sleep(pause)
        try:
            connection.sendall(body[start : start + size])
        except OSError:
            return


# Expect: 100-continue. A client that sends it waits for 100 Continue before it sends its body:
# a refusal the headers decide (the key, its scope, the Content-Type, a Content-Length over
# MAX_CONTENT_LENGTH) is answered instead, so the body is never sent; the body is asked for when
# the app reads it.
CREATE = b"POST /v1/pets HTTP/1.1\r\nExpect: 100-continue\r\n"
JSON = "application/json"
# The key sent (none, one that may only read, one that may write), the Content-Type and the
# Content-Length, and the answer.
REFUSED_BEFORE_THE_BODY = {
    "no key": (None, JSON, 2_000_000, 401, "unauthorized"),
    "a key that may only read": (("read",), JSON, 2_000_000, 403, "forbidden"),
    "not JSON": (("read", "write"), "text/plain", 2_000_000, 415, "unsupported_media_type"),
    "2 MB": (("read", "write"), JSON, 2_000_000, 413, "payload_too_large"),
    "a byte over the limit": (
        ("read", "write"),
        JSON,
        MAX_CONTENT_LENGTH + 1,
        413,
        "payload_too_large",
    ),
}


@pytest.fixture
def key_with(app):
    """Make a key with these scopes; return the key itself."""

    def make(scopes):
        with app.app_context():
            _, key = issue_key(f"scopes-{'-'.join(scopes)}", scopes=scopes)
            db.session.commit()
        return key

    return make


@pytest.mark.parametrize(
    ("scopes", "content_type", "length", "status", "code"),
    REFUSED_BEFORE_THE_BODY.values(),
    ids=REFUSED_BEFORE_THE_BODY.keys(),
)
def test_a_refusal_the_headers_decide_comes_instead_of_100_continue(
    module_gunicorn, key_with, count_pets, scopes, content_type, length, status, code
):
    head = CREATE + f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n".encode()
    key = key_with(scopes) if scopes else None
    # The headers alone: the client sends its body only once asked.
    connection = send(module_gunicorn.port, head, key, b"\r\n")
    answer = b""
    with connection:
        while chunk := connection.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["code"] == code
    assert count_pets() == 0


def test_a_body_the_app_reads_is_asked_for_with_100_continue(module_gunicorn, api_key):
    body = b'{"name": "Rex", "categoryId": 1}'
    head = CREATE + f"Content-Type: {JSON}\r\nContent-Length: {len(body)}\r\n".encode()
    connection = send(module_gunicorn.port, head, api_key, b"\r\n")
    asked = b""
    while not asked.endswith(b"\r\n\r\n"):
        data = connection.recv(1)
        assert data, f"closed without asking for the body: {asked!r}"
        asked += data
    assert asked == b"HTTP/1.1 100 Continue\r\n\r\n"
    connection.sendall(body)
    status, created, _ = read_answer(connection)
    assert (status, created["name"]) == (201, "Rex")
