"""A hostile barrage against a live gunicorn: each request gets a 4xx error object, or a 2xx
where it is valid, never a 5xx and never a hang; the store changes only by what was accepted."""

import errno
import json
import socket

import pytest
import sqlalchemy as sa

from animal_store.data.models import Pet
from animal_store.extensions import db

# Every answer must come within this many seconds, or the request counts as a hang.
ANSWER_TIMEOUT = 15
VALID = b'{"name":"Rex","categoryId":1}'


def post(body, content_type="application/json", headers=b""):
    def build(key):
        head = (
            b"POST /v1/pets HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n"
        )
        if content_type is not None:
            head += b"Content-Type: " + content_type.encode() + b"\r\n"
        if b"Transfer-Encoding" not in headers and b"Content-Length" not in headers:
            head += b"Content-Length: %d\r\n" % len(body)
        return head + headers + b"\r\n" + body

    return build


def get(target, headers=b""):
    def build(key):
        return (
            b"GET " + target + b" HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n" + headers + b"\r\n"
        )

    return build


def chunked(*chunks, end=b"0\r\n\r\n"):
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks) + end
    return post(body, headers=b"Transfer-Encoding: chunked\r\n")


def nested(depth, opener=b"[", closer=b"]"):
    return opener * depth + closer * depth


CASES = {
    "json nested 100,000 deep": (post(nested(100_000)), {413}),
    "json nested 30,000 deep": (post(nested(30_000)), {400}),
    "objects nested 10,000 deep": (post(b'{"a":' * 10_000 + b"1" + b"}" * 10_000), {400}),
    "1e400": (post(b'{"name":"Rex","categoryId":1e400}'), {400}),
    "-1e400": (post(b'{"name":"Rex","categoryId":-1e400}'), {400}),
    "-0": (post(b'{"name":"Rex","categoryId":-0}'), {201}),
    "-0.0": (post(b'{"name":"Rex","categoryId":-0.0}'), {400}),
    "2**64": (post(b'{"name":"Rex","categoryId":18446744073709551616}'), {400}),
    "NaN": (post(b'{"name":"Rex","categoryId":NaN}'), {400}),
    "5 MB name": (post(b'{"name":"' + b"a" * 5_000_000 + b'","categoryId":1}'), {413}),
    "invalid UTF-8": (post(b'{"name":"\xff\xfe\xc3","categoryId":1}'), {400}),
    "lone surrogate": (post(b'{"name":"\\ud800","categoryId":1}'), {400}),
    "escaped NUL": (post(b'{"name":"a\\u0000b","categoryId":1}'), {400}),
    "raw NUL": (post(b'{"name":"a\x00b","categoryId":1}'), {400}),
    "NUL after the body": (post(VALID + b"\x00"), {400}),
    "duplicate keys": (post(b'{"name":"Rex","name":"Max","categoryId":1}'), {400}),
    "BOM": (post(b"\xef\xbb\xbf" + VALID), {400}),
    "empty body": (post(b""), {400}),
    "Content-Type upper case": (post(VALID, "APPLICATION/JSON"), {201}),
    "Content-Type with charset": (post(VALID, "Application/Json; Charset=UTF-8"), {201}),
    "Content-Type latin-1": (post(VALID, "application/json; charset=iso-8859-1"), {201}),
    "Content-Type utf-16": (post(VALID, "application/json; charset=utf-16"), {201}),
    "Content-Type text/plain": (post(VALID, "text/plain"), {415}),
    "Content-Type json-patch": (post(VALID, "application/json-patch+json"), {415}),
    "Content-Type garbage": (post(VALID, ";;;==="), {415}),
    "no Content-Type": (post(VALID, None), {415}),
    "chunked": (chunked(VALID[:10], VALID[10:]), {201}),
    "chunked, bad size": (
        post(b"zz\r\nabc\r\n0\r\n\r\n", headers=b"Transfer-Encoding: chunked\r\n"),
        {400},
    ),
    "chunked, no terminator": (
        post(b"3\r\nabcXX", headers=b"Transfer-Encoding: chunked\r\n"),
        {400},
    ),
    "chunked, cut short": (
        post(b"40\r\n" + VALID, headers=b"Transfer-Encoding: chunked\r\n"),
        {400},
    ),
    "chunked, 100 KB": (chunked(b"[" * 50_000, b"]" * 50_000), {413}),
    "Content-Length larger than the body": (post(VALID, headers=b"Content-Length: 500\r\n"), {400}),
    "Content-Length negative": (post(VALID, headers=b"Content-Length: -1\r\n"), {400}),
    "Content-Length and chunked": (
        post(b"0\r\n\r\n", headers=b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
        {400},
    ),
    "unknown Transfer-Encoding": (post(VALID, headers=b"Transfer-Encoding: gzip\r\n"), {501}),
    "100 KB header": (get(b"/v1/pets", b"X-Big: " + b"a" * 100_000 + b"\r\n"), {431}),
    "300 headers": (get(b"/v1/pets", b"".join(b"X-%d: a\r\n" % n for n in range(300))), {431}),
    "100 KB URL": (get(b"/v1/pets?status=" + b"a" * 100_000), {414}),
    "limit in fullwidth digits": (get(b"/v1/pets?limit=%EF%BC%95"), {400}),
    "limit in Arabic-Indic digits": (get(b"/v1/pets?limit=%D9%A3"), {400}),
    "limit with NUL": (get(b"/v1/pets?limit=5%00"), {400}),
    "limit huge": (get(b"/v1/pets?limit=" + b"9" * 2000), {400}),
    "petId in fullwidth digits": (get(b"/v1/pets/%EF%BC%91"), {404}),
    "petId in Arabic-Indic digits": (get(b"/v1/pets/%D9%A1"), {404}),
    "petId with NUL": (get(b"/v1/pets/1%00"), {404}),
    "petId superscript": (get(b"/v1/pets/%C2%B9"), {404}),
    "petId past int64": (get(b"/v1/pets/9223372036854775808"), {404}),
    # An animal the barrage created, by another spelling of its id: one URL per animal.
    "petId with a leading zero": (get(b"/v1/pets/01"), {404}),
    # Werkzeug matches with leading slashes stripped: the same resource, nothing escapes.
    "double slash in front": (get(b"//v1/pets"), {200}),
    "double slash inside": (get(b"/v1//pets"), {404}),
    "dot-dot segment": (get(b"/v1/pets/../pets"), {404}),
    "encoded dot-dot": (get(b"/v1/pets/%2e%2e"), {404}),
    "encoded dot-dot out of v1": (get(b"/v1/%2e%2e/v1/pets"), {404}),
    # WSGI decodes PATH_INFO, so %2F is a slash: /v1/pets/1, an animal the barrage created.
    "encoded slash": (get(b"/v1/pets%2F1"), {200}),
    "trailing slash": (get(b"/v1/pets/"), {404}),
    "upper-case path": (get(b"/V1/PETS"), {404}),
    "absolute-form target": (get(b"http://evil.example/v1/pets"), {200}),
}


def send(port, request):
    """Send raw bytes, close our side, and return (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT) as connection:
        try:
            connection.sendall(request)
            connection.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading everything: read its answer
        except OSError as error:
            if error.errno != errno.ENOTCONN:  # closed already, before our shutdown: the same
                raise
        answer = b""
        while chunk := connection.recv(65536):  # socket.timeout here is a hang: the test fails
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in header_lines)
    }
    return int(status_line.split()[1]), headers, body


@pytest.fixture
def server(start_gunicorn):
    return start_gunicorn(workers=2)


def test_barrage_gets_error_objects_and_changes_only_what_was_accepted(server, app, make_key):
    # One live server for the whole barrage, every case's outcome collected: a failure lists all
    # the cases that went wrong, and the store is compared with everything accepted.
    key = make_key()
    outcomes, created = {}, []
    for name, (build, expected) in CASES.items():
        try:
            status, headers, body = send(server.port, build(key))
        except TimeoutError:
            outcomes[name] = "no answer within the timeout"
            continue
        problem = check_answer(status, headers, body, expected)
        if problem:
            outcomes[name] = problem
        if status == 201:
            created.append(json.loads(body))
    assert outcomes == {}, outcomes
    assert "Traceback" not in server.log()
    with app.app_context():
        rows = db.session.execute(sa.select(Pet.id, Pet.name, Pet.category_id, Pet.status))
        stored = {
            row.id: {"id": row.id, "name": row.name, "categoryId": row.category_id} for row in rows
        }
    assert stored == {pet["id"]: pet for pet in created}


def check_answer(status, headers, body, expected):
    """Return what is wrong with the answer, or None."""
    if status not in expected:
        return f"{status} (expected {sorted(expected)}): {body[:200]!r}"
    if status >= 400:
        if headers.get("content-type") != "application/json":
            return f"{status} is not JSON: {headers.get('content-type')}"
        error = json.loads(body)
        if set(error) - {"errors"} != {"code", "message", "status"} or error["status"] != status:
            return f"{status} is not an error object: {body[:200]!r}"
    return None
