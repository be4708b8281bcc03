"""A connection survives an error answer to a request whose body was never read, or the answer
says `Connection: close` and the server closes it: against gunicorn directly and through nginx,
for bodies below, at and far above the limit, sent with Content-Length and chunked. A body sent
in a way the service does not take gets the same refusal on every path.

A raw HTTP/1.1 client, so that what happens on the connection is what the test sees: a library
would reconnect behind its back.

Every test sends requests and reads the answers on connections of its own, so all of them share one
gunicorn (a boot each was most of this module's time), on a database of the module's; nginx, whose
upstream is marked failed for 10 s after one error (max_fails), is started afresh for each test, so
one test's failure cannot become the next one's.
"""

import contextlib
import json
import socket
import ssl
import threading

import pytest
from conftest import IN_SQLITE_PASS
from werkzeug.serving import make_server

from animal_store import errors

LIMIT = 64 * 1024
SIZES = [1024, LIMIT, LIMIT + 1, 200_000, 2_000_000]
FRAMINGS = ["content-length", "chunked"]
# Requests the app answers without reading their body, and the status it answers with.
UNREAD = {
    "no-key": ("POST", "/v1/pets", {}, 401),
    "no-route": ("POST", "/v1/nowhere", {"auth": True}, 404),
    "wrong-method": ("PUT", "/v1/pets", {"auth": True}, 405),
    "not-json": ("POST", "/v1/pets", {"auth": True, "type": "text/plain"}, 415),
    # The body is read up to the limit: what is below it is no JSON (400), what is over is 413.
    "too-large": ("POST", "/v1/pets", {"auth": True, "type": "application/json"}, 413),
}

# A body sent in a way the service does not take, by the header that says how, and the one status
# every path refuses it with, before any view (docs/errors.rst): a transfer coding other than
# chunked alone, any in HTTP/1.0, and an expectation other than 100-continue.
# tests/test_deploy.py sends them through nginx.
FRAMING_REFUSALS = {
    "Transfer-Encoding: gzip": 501,
    "Transfer-Encoding: identity": 501,
    "Transfer-Encoding: x-unknown": 501,
    # gunicorn lets this one by, the body still compressed: the app refuses it.
    "Transfer-Encoding: gzip, chunked": 501,
    "Transfer-Encoding: chunked, gzip": 501,
    "Transfer-Encoding: chunked, chunked": 501,
    "HTTP/1.0 Transfer-Encoding: chunked": 400,
    "HTTP/1.0 Transfer-Encoding: gzip": 400,
    "Expect: pay-first": 417,
    "Expect: 100-continue, pay-first": 417,
}
VALID = b'{"name":"Rex","categoryId":1}'
# A body that ends (the client closes its side) before its framing says it does, or whose chunked
# framing is broken, by its header lines and bytes, and the catalogue's message every server
# answers it with. With an Idempotency-Key the body is read first for its fingerprint.
TRUNCATED = errors.TRUNCATED_BODY.message.format(received=len(VALID), expected=500)
MALFORMED = errors.MALFORMED_BODY.message
IDEMPOTENT = "Idempotency-Key: broken-body"
BROKEN_BODIES = {
    "Content-Length past the body": (["Content-Length: 500"], VALID, TRUNCATED),
    "Content-Length past the body, idempotent": (
        ["Content-Length: 500", IDEMPOTENT],
        VALID,
        TRUNCATED,
    ),
    "chunk size not hexadecimal": (
        ["Transfer-Encoding: chunked"],
        b"zz\r\n%s\r\n0\r\n\r\n" % VALID,
        MALFORMED,
    ),
    "chunk size not hexadecimal, idempotent": (
        ["Transfer-Encoding: chunked", IDEMPOTENT],
        b"zz\r\n%s\r\n0\r\n\r\n" % VALID,
        MALFORMED,
    ),
    "chunk size negative": (
        ["Transfer-Encoding: chunked"],
        b"-1d\r\n%s\r\n0\r\n\r\n" % VALID,
        MALFORMED,
    ),
    "chunk without its CRLF": (
        ["Transfer-Encoding: chunked"],
        b"%x\r\n%sXX0\r\n\r\n" % (len(VALID), VALID),
        MALFORMED,
    ),
    "body ended inside a chunk": (["Transfer-Encoding: chunked"], b"40\r\n%s" % VALID, MALFORMED),
    "body ended before the last chunk": (
        ["Transfer-Encoding: chunked"],
        b"%x\r\n%s\r\n" % (len(VALID), VALID),
        MALFORMED,
    ),
}


def framed_request(case, api_key):
    """The HTTP version, header lines and body of a creation that says how its body comes by the
    header of `case`: chunked where the header ends with chunked, with a Content-Length where it
    sends no coding."""
    version, header = case.split(" ", 1) if case.startswith("HTTP/") else ("HTTP/1.1", case)
    name = header.partition(": ")[0]
    lines = [f"Authorization: Bearer {api_key}", "Content-Type: application/json", header]
    if name == "Transfer-Encoding":
        return version, lines, b"%x\r\n%s\r\n0\r\n\r\n" % (len(VALID), VALID)
    return version, [*lines, f"Content-Length: {len(VALID)}"], VALID


class Connection:
    """One TCP (or TLS) connection, spoken to in HTTP/1.1 by hand."""

    def __init__(self, port, tls_context=None):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.tls = tls_context is not None
        self.sock = tls_context.wrap_socket(raw, server_hostname="127.0.0.1") if self.tls else raw
        self.buffer = b""

    def send(self, method, path, headers, body=None, chunked=False):
        """Send a request; over plain TCP the body goes from a thread, as the server may answer
        and close first. (A TLS socket cannot send and receive from two threads: nginx reads a
        refused body to its end before it closes, so there it is sent first.)"""
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
        if body is not None:
            lines.append(
                "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
            )
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        if body is None:
            self.sock.sendall(head)
            return
        if chunked:
            pieces = [body[i : i + 16384] for i in range(0, len(body), 16384)]
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        if self.tls:
            self.send_quietly(head + body)
        else:
            threading.Thread(target=self.send_quietly, args=(head + body,), daemon=True).start()

    def send_raw(self, version, method, path, headers, body):
        """Send a request with exactly these header lines and body bytes."""
        lines = [f"{method} {path} {version}", "Host: 127.0.0.1", "Connection: close", *headers]
        self.send_quietly(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    def send_quietly(self, data):
        # The server may answer and close before it takes it all: the answer counts.
        with contextlib.suppress(OSError):
            self.sock.sendall(data)

    def read_response(self):
        """Return (status, headers by lower-case name, body) of the next answer."""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.receive()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", 0))
        while len(self.buffer) < length:
            self.buffer += self.receive()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def receive(self):
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed before a whole answer")
        return data

    def closed_by_server(self):
        """True once the server has closed its side: end of stream or a reset, nothing else."""
        try:
            return self.sock.recv(65536) == b""
        except (ConnectionResetError, ssl.SSLError):
            return True

    def close(self):
        self.sock.close()


def check_connection_after_unread_body(port, api_key, case, behind_nginx, tls_context=None):
    method, path, options, status = UNREAD[case]
    headers = []
    if options.get("auth"):
        headers.append(f"Authorization: Bearer {api_key}")
    if "type" in options:
        headers.append(f"Content-Type: {options['type']}")
    for size in SIZES:
        for framing in FRAMINGS:
            what = f"{case}, {size} bytes, {framing}"
            sized_body = framing == "content-length" or behind_nginx
            connection = Connection(port, tls_context)
            try:
                connection.send(method, path, headers, b"x" * size, framing == "chunked")
                answered, answer_headers, body = connection.read_response()
                if behind_nginx and size > LIMIT:
                    expected = 413  # nginx refuses the body before the app sees the request
                elif case == "too-large" and (size < LIMIT or (size == LIMIT and sized_body)):
                    # Read, and no JSON. (A chunked body that fills the limit is refused: the
                    # app cannot tell it from one cut there, animal_store/http/body.py; nginx passes
                    # bodies on with a Content-Length.)
                    expected = 400
                else:
                    expected = status
                assert answered == expected, what
                assert json.loads(body)["status"] == expected, what
                if answer_headers.get("connection", "").lower() == "close":
                    assert connection.closed_by_server(), what
                else:
                    # Promised to stay open: the next request on it gets its answer.
                    connection.send("GET", "/healthz", [])
                    assert connection.read_response()[0] == 200, what
            finally:
                connection.close()


@pytest.fixture
def database_url(emptied_module_database):
    """Every test's app (its key, its count of animals) on the database module_gunicorn serves."""
    return emptied_module_database


@pytest.mark.parametrize("case", UNREAD)
def test_gunicorn_keeps_its_word_after_an_unread_body(module_gunicorn, api_key, case):
    check_connection_after_unread_body(module_gunicorn.port, api_key, case, behind_nginx=False)


@pytest.mark.parametrize("case", UNREAD)
def test_nginx_keeps_the_clients_connection_after_an_unread_body(
    module_gunicorn, start_nginx, certificate, api_key, case
):
    nginx = start_nginx([module_gunicorn.url.removeprefix("http://")])
    context = ssl.create_default_context(cafile=str(certificate[0]))
    check_connection_after_unread_body(nginx.https_port, api_key, case, True, context)


# The development server, which only quickstart and `flask run` serve with, in one pass: its framing
# is the same on either database (conftest.py).
@pytest.fixture(params=["gunicorn", pytest.param("development server", marks=IN_SQLITE_PASS)])
def server_port(request, app):
    """The port of gunicorn, or of the threaded development server (`flask run`, quickstart)."""
    if request.param == "gunicorn":
        yield request.getfixturevalue("module_gunicorn").port
        return
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.port
    server.shutdown()


@pytest.mark.parametrize(("case", "status"), FRAMING_REFUSALS.items())
def test_a_body_sent_in_a_way_not_taken_is_refused_alike(
    server_port, api_key, count_pets, case, status
):
    connection = Connection(server_port)
    try:
        version, lines, body = framed_request(case, api_key)
        connection.send_raw(version, "POST", "/v1/pets", lines, body)
        answered, _, body = connection.read_response()
    finally:
        connection.close()
    assert (answered, json.loads(body)["status"]) == (status, status)
    assert count_pets() == 0


@pytest.mark.parametrize("case", BROKEN_BODIES)
def test_a_broken_body_gets_the_catalogues_answer_on_every_server(
    server_port, api_key, count_pets, case
):
    # The catalogue's words, not Werkzeug's ("The browser (or proxy) sent a request that this
    # server could not understand.") nor gunicorn's, which quote what the client sent.
    headers, body, message = BROKEN_BODIES[case]
    lines = [f"Authorization: Bearer {api_key}", "Content-Type: application/json", *headers]
    connection = Connection(server_port)
    try:
        connection.send_raw("HTTP/1.1", "POST", "/v1/pets", lines, body)
        # The end of what the client sends: a body cut short stays so.
        connection.sock.shutdown(socket.SHUT_WR)
        answered, _, body = connection.read_response()
    finally:
        connection.close()
    assert answered == 400
    assert json.loads(body) == {"code": "bad_request", "message": message, "status": 400}
    assert count_pets() == 0
