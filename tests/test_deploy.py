"""End to end through the shipped deployment: real nginx (config/nginx.conf, TLS) in front of real
gunicorn (config/gunicorn.conf.py, wsgi.py), on free loopback ports, stopped by PID."""

import json
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import psycopg
import pytest
import requests
import sqlalchemy as sa
from conftest import IN_POSTGRESQL_PASS, TEST_DATABASE_URL, Gunicorn
from flask import Flask
from nginx_server import NGINX, Nginx
from pgbouncer_server import PGBOUNCER, PgBouncer
from psycopg.rows import dict_row
from requests.structures import CaseInsensitiveDict
from test_connections import FRAMING_REFUSALS, VALID, Connection, framed_request

from animal_store import create_app, default_settings, errors
from animal_store.access.auth import issue_key
from animal_store.data.models import Pet
from animal_store.extensions import db

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)")


@pytest.fixture
def start_gunicorn(start_gunicorn, production_env):
    """gunicorn as docs/deploy.rst runs it behind nginx: with the production settings file."""

    def start(workers=2, env=None, wait=True, **where):
        env = {**production_env, **(env or {})}
        return start_gunicorn(workers, env, wait, **where)

    return start


@pytest.fixture
def session(certificate):
    with requests.Session() as session:
        # Not REQUESTS_CA_BUNDLE or a proxy from the environment: this certificate, directly.
        session.trust_env = False
        session.verify = str(certificate[0])
        yield session


def address(gunicorn):
    return gunicorn.url.removeprefix("http://")


def request_lines(gunicorn, since=0):
    """The app's per-request JSON lines from a gunicorn's stdout, but the fixture's probes; with
    `since`, only those after that many characters of it."""
    output = gunicorn.log()[since:]
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [
        line
        for line in lines
        if line["logger"] == "animal_store.request" and line["path"] != "/healthz"
    ]


@dataclass
class Edge:
    """gunicorn as deployed (one worker) behind nginx on the shipped config, on a database of
    their own, shared by the tests that only send requests and read what came back: a pair of
    their own for each of them (gunicorn's boot, mostly) was most of this module's time. A test
    takes it through the `edge` fixture, which marks where the test's own lines begin in
    gunicorn's log; the app on the same database issues the test's key and counts what is
    stored."""

    gunicorn: Gunicorn
    nginx: Nginx
    app: Flask
    started_at: int = 0
    key: str = field(default="")

    def begin(self):
        """Start a test: a key of its own, and its request lines from here on."""
        with self.app.app_context():
            # Issued now, not once: on PostgreSQL the tests between empty the shared database.
            # Names are unique: one of its own each.
            _, self.key = issue_key(f"tester-{uuid.uuid4().hex}")
            db.session.commit()
        self.started_at = len(self.gunicorn.log())
        return self

    @property
    def auth(self):
        return {"Authorization": f"Bearer {self.key}"}

    def request_lines(self):
        """The app's request lines since the test began."""
        return request_lines(self.gunicorn, since=self.started_at)

    def count_pets(self):
        with self.app.app_context():
            return db.session.scalar(sa.select(sa.func.count()).select_from(Pet))


@pytest.fixture(scope="module")
def shared_edge(migrated_database, certificate, tmp_path_factory, suite_redis):
    """One Edge for the module, on a copy of the migrated SQLite template, or on PostgreSQL on
    the test database (each test's own key is issued there when it begins)."""
    directory = tmp_path_factory.mktemp("edge")
    database = TEST_DATABASE_URL
    if not database:
        shutil.copyfile(migrated_database, directory / "store.sqlite3")
        database = f"sqlite:///{directory / 'store.sqlite3'}"
    # As deployed, but counting rate limits in the suite's Redis (conftest.production_env).
    env = {"ANIMAL_STORE_ENV": "production", "ANIMAL_STORE_RATELIMIT_STORAGE_URI": suite_redis.url}
    gunicorn = Gunicorn(database, workers=1, env=env, log_path=directory / "gunicorn.log")
    app = create_app({"TESTING": True, "DATABASE_URL": database})
    try:
        gunicorn.wait_until_serving()
        nginx = Nginx(directory / "nginx", [address(gunicorn)], *certificate).wait_until_serving()
    except BaseException:
        gunicorn.stop()
        raise
    yield Edge(gunicorn, nginx, app)
    nginx.stop()
    gunicorn.stop()
    with app.app_context():
        db.engine.dispose()


@pytest.fixture
def edge(shared_edge):
    return shared_edge.begin()


def test_create_list_and_fetch_through_nginx(start_gunicorn, start_nginx, session, auth):
    nginx = start_nginx([address(start_gunicorn(workers=1))])
    created = [
        session.post(
            f"{nginx.url}/v1/pets", json={"name": f"pet{n}", "categoryId": n}, headers=auth
        )
        for n in range(2)
    ]
    assert [response.status_code for response in created] == [201, 201]
    first = created[0].json()
    assert created[0].headers["Location"] == f"{nginx.url}/v1/pets/{first['id']}"

    page = session.get(f"{nginx.url}/v1/pets?limit=1", headers=auth)
    assert page.json() == [first]
    assert page.links["next"]["url"].startswith(f"{nginx.url}/v1/pets?")
    assert session.get(page.links["next"]["url"], headers=auth).json() == [created[1].json()]
    assert session.get(created[0].headers["Location"], headers=auth).json() == first


def test_missing_key_through_nginx_is_the_apps_401(edge, session):
    response = session.get(f"{edge.nginx.url}/v1/pets")
    assert response.status_code == 401
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="animal-store"'
    assert response.json()["code"] == "unauthorized"


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
@pytest.mark.parametrize("host", ["evil.example", "a@evil.example", ""])
def test_links_through_nginx_are_on_the_public_url_whatever_the_host(
    start_gunicorn, start_nginx, session, auth, host
):
    public_url = "https://api.animal-store.example"
    gunicorn = start_gunicorn(workers=1, env={"ANIMAL_STORE_PUBLIC_URL": public_url})
    nginx = start_nginx([address(gunicorn)])
    headers = {**auth, "Host": host}
    created = session.post(
        f"{nginx.url}/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=headers
    )
    if host in ("a@evil.example", ""):
        # Refused 400 with the error object, no link at all: the empty Host by nginx, the other
        # by the app (nginx passes it on; Werkzeug cannot read it).
        assert created.status_code == 400
        assert created.json()["code"] == "bad_request"
        assert "Location" not in created.headers
        return
    assert created.headers["Location"] == f"{public_url}/v1/pets/{created.json()['id']}"
    session.post(f"{nginx.url}/v1/pets", json={"name": "Rex", "categoryId": 2}, headers=headers)
    page = session.get(f"{nginx.url}/v1/pets?limit=1", headers=headers)
    assert page.links["next"]["url"].startswith(f"{public_url}/v1/pets?")


def test_plain_http_redirects_to_https(edge):
    response = requests.post(
        f"{edge.nginx.http_url}/v1/pets?limit=1", json={}, allow_redirects=False, timeout=10
    )
    assert response.status_code == 308
    assert response.headers["Location"] == "https://127.0.0.1/v1/pets?limit=1"
    # No HTML page: an empty body, and the headers every answer carries.
    assert response.content == b""
    assert "Content-Type" not in response.headers
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-ID"])


def test_client_address_is_nginxs_peer_not_a_spoofed_header(edge, session):
    session.get(
        f"{edge.nginx.url}/v1/pets", headers={**edge.auth, "X-Forwarded-For": "203.0.113.9"}
    )
    [line] = edge.request_lines()
    assert line["remote_addr"] == "127.0.0.1"


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_request_id_round_trip(start_gunicorn, start_nginx, session, auth):
    gunicorn = start_gunicorn(workers=1)
    nginx = start_nginx([address(gunicorn)])
    kept = session.get(f"{nginx.url}/v1/pets", headers={**auth, "X-Request-ID": "client-id-1"})
    generated = session.get(f"{nginx.url}/v1/pets", headers=auth)
    replaced = session.get(f"{nginx.url}/v1/pets", headers={**auth, "X-Request-ID": "bad id!"})
    assert kept.headers["X-Request-ID"] == "client-id-1"
    for response in (generated, replaced):
        # nginx's $request_id, chosen at the edge and passed on to the app.
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-ID"])
    sent = [r.headers["X-Request-ID"] for r in (kept, generated, replaced)]
    assert [line["request_id"] for line in request_lines(gunicorn)] == sent
    access_log = [json.loads(line) for line in nginx.access_log(lines=3).splitlines()]
    assert [line["request_id"] for line in access_log] == sent


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_log_lines_are_json_and_never_hold_the_key(start_gunicorn, start_nginx, session, api_key):
    gunicorn = start_gunicorn(workers=1)
    nginx = start_nginx([address(gunicorn)])
    auth = {"Authorization": f"Bearer {api_key}"}
    session.post(f"{nginx.url}/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=auth)
    session.get(f"{nginx.url}/v1/pets", headers={"Authorization": f"Bearer {api_key}0"})
    gunicorn.stop()
    output = gunicorn.log()
    # Everything on gunicorn's stdout, its own boot and shutdown lines too, is a JSON line.
    lines = [json.loads(line) for line in output.splitlines()]
    assert any(line["logger"] == "gunicorn.error" for line in lines)
    created, refused = request_lines(gunicorn)
    assert created["method"] == "POST"
    assert created["path"] == "/v1/pets"
    assert created["status"] == 201
    assert created["api_key_name"] == "tester"
    assert isinstance(created["duration_ms"], float)
    assert (refused["status"], refused["api_key_name"]) == (401, None)
    assert api_key not in output
    assert "Bearer" not in output
    assert api_key not in nginx.access_log() + nginx.error_log()


# A key sent in the query, where a client might put it: each URL is refused 401 (the key is not
# read there), and neither nginx's access log nor the app's request line may hold it.
KEY_IN_QUERY = {
    "api-key": "/v1/pets/1?api_key={key}",
    "access-token": "/v1/pets?access_token={key}",
    "unknown-parameter": "/v1/pets?limit=1&x={key}",
    "declared-name-in-other-case": "/v1/pets?LIMIT={key}&Status={key}",
    "alone": "/v1/pets?{key}",
}


def access_log_line(nginx, response):
    """nginx's access log line of this response, once nginx has written it (after the answer)."""
    request_id = response.headers["X-Request-ID"]
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(text) for text in nginx.access_log().splitlines()]
        found = [line for line in lines if line["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            [line] = found
            return line
        time.sleep(0.02)


@pytest.mark.parametrize("url", KEY_IN_QUERY.values(), ids=KEY_IN_QUERY.keys())
def test_a_key_in_the_query_never_reaches_a_log(edge, session, url):
    response = session.get(edge.nginx.url + url.format(key=edge.key))
    assert response.status_code == 401
    assert access_log_line(edge.nginx, response)["path"] == url.partition("?")[0]
    [app_line] = edge.request_lines()
    assert edge.key not in edge.nginx.access_log() + edge.nginx.error_log()
    assert edge.key not in json.dumps(app_line)


def test_nginx_logs_the_path_and_the_defined_parameters(edge, session):
    query = "limit=1&status=sold&x=secret"
    response = session.get(f"{edge.nginx.url}/v1/pets?{query}", headers=edge.auth)
    assert response.status_code == 200
    line = access_log_line(edge.nginx, response)
    assert (line["path"], line["status"]) == ("/v1/pets", 200)
    assert line["query"] == {"limit": "1", "status": "sold", "cursor": ""}
    [app_line] = edge.request_lines()
    assert app_line["query"] == "limit=1&status=sold&x=***"


PROTOCOLS = ["HTTP/1.1", "HTTP/2"]


CURL = shutil.which("curl")


@dataclass
class CurlResponse:
    http_version: str
    status_code: int
    headers: CaseInsensitiveDict
    content: bytes

    def json(self):
        return json.loads(self.content)


def curl(protocol, method, url, certificate, headers=(), content=None, timeout=10):
    """One request with curl over "HTTP/1.1" or "HTTP/2", as a user would send it.

    curl rather than a Python client: over HTTP/2, httpx keeps sending a body nginx has refused
    and waits for flow-control credit that never comes; curl reads the early answer.
    """
    with tempfile.TemporaryDirectory() as directory:
        head, body = Path(directory) / "head", Path(directory) / "body"
        command = [CURL, "--silent", "--show-error", "--cacert", str(certificate)]
        command += ["--http2" if protocol == "HTTP/2" else "--http1.1", "--max-time", str(timeout)]
        command += ["--request", method, "--dump-header", str(head), "--output", str(body)]
        for name, value in dict(headers).items():
            command += ["--header", f"{name}: {value}"]
        if content is not None:
            command += ["--data-binary", "@-"]
        subprocess.run([*command, url], input=content, check=True, capture_output=True)
        status_line, *lines = head.read_bytes().decode().split("\r\n\r\n")[-2].splitlines()
        version, status = status_line.split()[:2]
        fields = (line.partition(":") for line in lines)
        return CurlResponse(
            "HTTP/2" if version == "HTTP/2" else version,
            int(status),
            CaseInsensitiveDict({name: value.strip() for name, _, value in fields}),
            body.read_bytes(),
        )


class Curl:
    def __init__(self, protocol, certificate):
        self.protocol, self.certificate = protocol, certificate

    def request(self, method, url, headers=(), content=None):
        return curl(self.protocol, method, url, self.certificate, headers, content)

    def get(self, url, headers=()):
        return self.request("GET", url, headers)


@pytest.fixture(params=PROTOCOLS)
def http(request, certificate):
    """curl speaking one protocol to nginx (curl's default over TLS is HTTP/2)."""
    if CURL is None:
        pytest.skip("curl is not installed (Debian: curl)")
    return Curl(request.param, certificate[0])


def catalogue_body(status):
    """The app's error object for the condition nginx (or gunicorn) refuses with `status`."""
    kind = errors.NGINX_KINDS[status]
    return errors.error_body(kind, kind.message.format(limit=default_settings.MAX_CONTENT_LENGTH))


def assert_error_object(response, status, protocol):
    assert response.http_version == protocol
    assert response.status_code == status
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-ID"])
    assert response.json() == catalogue_body(status)


# gunicorn refuses a request line over 4094 bytes: "GET " + URI + " HTTP/1.1" (nginx answers
# those itself), a header field over 8190 (gunicorn answers up to nginx's own limit, 128 KiB).
LONGEST_GET_URI = 4094 - len("GET  HTTP/1.1")
REFUSALS = {
    "body-just-over": ({"method": "POST", "content": b"x" * (64 * 1024 + 1)}, 413),
    "body-far-over": ({"method": "POST", "content": b"x" * 200_000}, 413),
    "uri-just-over": ({"method": "GET", "url": "/v1/pets?q=" + "x" * (LONGEST_GET_URI - 10)}, 414),
    "uri-far-over": ({"method": "GET", "url": "/v1/pets?q=" + "x" * 20_000}, 414),
    "header-9k": ({"method": "GET", "headers": {"X-Big": "x" * 9_000}}, 431),
    "header-15k": ({"method": "GET", "headers": {"X-Big": "x" * 15_000}}, 431),
    "header-60k": ({"method": "GET", "headers": {"X-Big": "x" * 60_000}}, 431),
}


@pytest.mark.parametrize(("request_kwargs", "status"), REFUSALS.values(), ids=REFUSALS.keys())
def test_refusals_at_the_edge_are_the_apps_error_objects(edge, http, request_kwargs, status):
    """Over HTTP/1.1 and HTTP/2 alike: nginx's (and gunicorn's) refusals carry the catalogue's
    code and message, nosniff and a request ID; the app never sees the request."""
    kwargs = dict(request_kwargs)
    headers = {**edge.auth, "Content-Type": "application/json", **kwargs.pop("headers", {})}
    url = edge.nginx.url + kwargs.pop("url", "/v1/pets")
    response = http.request(url=url, headers=headers, **kwargs)
    assert_error_object(response, status, http.protocol)
    assert edge.request_lines() == []


def test_trace_is_refused_with_the_error_object(edge, http):
    """nginx refuses TRACE itself, on every path, before the app could: the catalogue's 405."""
    for path in ("/v1/pets", "/v1/pets/1", "/nowhere"):
        response = http.request("TRACE", edge.nginx.url + path, headers=edge.auth)
        assert_error_object(response, 405, http.protocol)
    assert edge.request_lines() == []


@pytest.mark.parametrize("version", ["HTTP/2.0", "HTTP/3.0"])
def test_an_http_version_nginx_does_not_speak_is_the_error_object(edge, certificate, version):
    """In a request line, over TLS (an HTTP/2 connection has no request line)."""
    context = ssl.create_default_context(cafile=str(certificate[0]))
    connection = Connection(edge.nginx.https_port, context)
    try:
        connection.send_raw(version, "GET", "/v1/pets", [], b"")
        status, headers, content = connection.read_response()
    finally:
        connection.close()
    assert status == 505
    assert headers["content-type"] == "application/json"
    assert json.loads(content) == catalogue_body(505)


def h2_request(port, tls_context, method, path, headers, body):
    """One request over HTTP/2 with exactly these header fields, even those HTTP/2 forbids (curl
    drops a Transfer-Encoding); return (status, headers, body) of the answer."""
    tls_context.set_alpn_protocols(["h2"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with tls_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        # h2 would drop the fields HTTP/2 forbids, or refuse them: neither, here.
        config = h2.config.H2Configuration(
            validate_outbound_headers=False, normalize_outbound_headers=False
        )
        connection = h2.connection.H2Connection(config)
        connection.initiate_connection()
        pseudo = [(":method", method), (":scheme", "https"), (":authority", "127.0.0.1")]
        fields = [(name.lower(), value) for name, value in headers]
        connection.send_headers(1, [*pseudo, (":path", path), *fields])
        connection.send_data(1, body, end_stream=True)
        tls.sendall(connection.data_to_send())
        answer, content = {}, b""
        while True:
            for event in connection.receive_data(tls.recv(65536)):
                if isinstance(event, h2.events.ResponseReceived):
                    answer = {name.decode(): value.decode() for name, value in event.headers}
                elif isinstance(event, h2.events.DataReceived):
                    content += event.data
                elif isinstance(event, h2.events.StreamEnded):
                    return int(answer.pop(":status")), answer, content
            tls.sendall(connection.data_to_send())


# Each case over both protocols, but HTTP/1.0's over HTTP/1.1's connection only.
FRAMING_CASES = [
    (protocol, case, status)
    for case, status in FRAMING_REFUSALS.items()
    for protocol in PROTOCOLS
    if protocol == "HTTP/1.1" or not case.startswith("HTTP/1.0")
]


@pytest.mark.parametrize(("protocol", "case", "status"), FRAMING_CASES)
def test_a_body_sent_in_a_way_not_taken_is_refused_as_gunicorn_does(
    edge, certificate, protocol, case, status
):
    """The same status and error object as gunicorn and the development server answer
    (tests/test_connections.py), from nginx itself: the app never sees the request."""
    nginx = edge.nginx
    stored = edge.count_pets()
    context = ssl.create_default_context(cafile=str(certificate[0]))
    version, lines, body = framed_request(case, edge.key)
    if protocol == "HTTP/2":
        # HTTP/2 frames the body itself: the header is sent as it is, the body bare.
        fields = [line.split(": ", 1) for line in lines if not line.startswith("Content-Length")]
        answered, headers, content = h2_request(
            nginx.https_port, context, "POST", "/v1/pets", fields, VALID
        )
    else:
        connection = Connection(nginx.https_port, context)
        try:
            connection.send_raw(version, "POST", "/v1/pets", lines, body)
            answered, headers, content = connection.read_response()
        finally:
            connection.close()
    assert answered == status
    assert headers["content-type"] == "application/json"
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
    assert json.loads(content) == catalogue_body(status)
    assert edge.request_lines() == []
    assert edge.count_pets() == stored


def test_the_longest_uri_gunicorn_takes_reaches_the_app(edge, http):
    url = edge.nginx.url + "/v1/pets?q=" + "x" * (LONGEST_GET_URI - 11)
    response = http.get(url, headers=edge.auth)
    assert response.status_code == 200  # an unknown query parameter is ignored
    assert [line["status"] for line in edge.request_lines()] == [200]


def test_request_nginx_cannot_parse_is_a_json_400(edge, certificate):
    nginx = edge.nginx
    context = ssl.create_default_context(cafile=str(certificate[0]))
    with (
        socket.create_connection(("127.0.0.1", nginx.https_port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"GET /v1/pets HTTP/1.1\r\nHost: bad/host\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"\r\nContent-Type: application/json\r\n" in head
    assert json.loads(body) == {
        "code": "bad_request",
        "message": "The request is malformed.",
        "status": 400,
    }


def test_largest_body_nginx_allows_reaches_the_app(edge, session):
    body = json.dumps({"name": "Rex", "categoryId": 1}).ljust(64 * 1024).encode()
    response = session.post(
        f"{edge.nginx.url}/v1/pets",
        data=body,
        headers={**edge.auth, "Content-Type": "application/json"},
    )
    assert response.status_code == 201


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_stopped_upstream_is_a_json_502(start_gunicorn, start_nginx, http, auth):
    gunicorn = start_gunicorn(workers=1)
    nginx = start_nginx([address(gunicorn)])
    gunicorn.stop()
    response = http.get(f"{nginx.url}/v1/pets", headers=auth)
    assert_error_object(response, 502, http.protocol)
    assert response.headers["Retry-After"] == "5"


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_silent_upstream_is_a_json_504(start_nginx, http, auth):
    # Accepts connections (the kernel's backlog) and never answers, like a hung instance.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        upstream = f"127.0.0.1:{silent.getsockname()[1]}"
        nginx = start_nginx([upstream], proxy_read_timeout="1s")
        response = http.get(f"{nginx.url}/v1/pets", headers=auth)
    assert_error_object(response, 504, http.protocol)


def test_sigterm_during_writes_loses_nothing_acknowledged(
    start_gunicorn, start_nginx, session, auth, app
):
    gunicorn = start_gunicorn(workers=2)
    nginx = start_nginx([address(gunicorn)])
    acknowledged, statuses = [], []
    enough_written = threading.Event()

    def write(worker):
        for n in range(10_000):
            response = session.post(
                f"{nginx.url}/v1/pets",
                json={"name": f"w{worker}-{n}", "categoryId": n},
                headers=auth,
            )
            statuses.append(response.status_code)
            if response.status_code == 201:
                acknowledged.append(response.json())
            if len(acknowledged) >= 40:
                enough_written.set()
            if response.status_code == 502:
                return

    with ThreadPoolExecutor(4) as pool:
        writers = [pool.submit(write, worker) for worker in range(4)]
        assert enough_written.wait(60)
        gunicorn.process.send_signal(signal.SIGTERM)
        assert gunicorn.process.wait(timeout=35) == 0
        for writer in writers:
            writer.result(timeout=30)

    # Every request either was acknowledged or refused at the door; none failed halfway.
    assert set(statuses) == {201, 502}
    with app.test_client() as client:
        stored = client.get("/v1/pets?limit=100", headers=auth)
        stored_pets = stored.json
        while "next" in stored.headers.get("Link", ""):
            next_url = re.search(r"<([^>]+)>", stored.headers["Link"]).group(1)
            stored = client.get(next_url, headers=auth)
            stored_pets += stored.json
    assert sorted(stored_pets, key=lambda pet: pet["id"]) == sorted(
        acknowledged, key=lambda pet: pet["id"]
    )


@pytest.mark.skipif(
    not TEST_DATABASE_URL, reason="scale-out needs PostgreSQL (SQLite serves one machine only)"
)
def create_and_read_concurrently(instances, nginx, session, auth, count_pets):
    """200 creations and 100 reads at once through nginx: every creation stored once, every
    instance serving, nothing lost in a walk."""

    def create(n):
        response = session.post(
            f"{nginx.url}/v1/pets", json={"name": f"pet{n}", "categoryId": n}, headers=auth
        )
        assert response.status_code == 201
        return response.json()

    def read(n):
        response = session.get(f"{nginx.url}/v1/pets?limit=5", headers=auth)
        assert response.status_code == 200
        return response.json()

    with ThreadPoolExecutor(8) as pool:
        creations = pool.map(create, range(200))
        reads = pool.map(read, range(100))
        created, _ = list(creations), list(reads)

    ids = [pet["id"] for pet in created]
    assert len(set(ids)) == 200
    assert count_pets() == 200
    walked, pages, url = [], 0, f"{nginx.url}/v1/pets?limit=100"
    while url:
        page = session.get(url, headers=auth)
        pages += 1
        walked += page.json()
        url = page.links.get("next", {}).get("url")
    assert sorted(walked, key=lambda pet: pet["id"]) == sorted(created, key=lambda pet: pet["id"])
    served = [len(request_lines(instance)) for instance in instances]
    assert all(count > 0 for count in served), served
    assert sum(served) == 200 + 100 + pages


def test_two_instances_on_one_postgresql_lose_and_duplicate_nothing(
    start_gunicorn, start_nginx, session, auth, count_pets
):
    instances = [start_gunicorn(workers=1), start_gunicorn(workers=1)]
    nginx = start_nginx([address(instance) for instance in instances])
    create_and_read_concurrently(instances, nginx, session, auth, count_pets)

    # An Idempotency-Key is honoured whichever instance the retry reaches: the record is shared.
    retry = {**auth, "Idempotency-Key": "scale-out-1"}
    first = session.post(
        f"{nginx.url}/v1/pets", json={"name": "Once", "categoryId": 1}, headers=retry
    )
    second = session.post(
        f"{nginx.url}/v1/pets", json={"name": "Once", "categoryId": 1}, headers=retry
    )
    assert first.json() == second.json()
    answered_by = [
        next(
            i
            for i, instance in enumerate(instances)
            if any(
                line["request_id"] == response.headers["X-Request-ID"]
                for line in request_lines(instance)
            )
        )
        for response in (first, second)
    ]
    assert sorted(answered_by) == [0, 1]
    assert count_pets() == 201


# A role whose PostgreSQL connections are capped below what the fleet's workers hold.
POOLED_ROLE, ROLE_CONNECTION_LIMIT, PGBOUNCER_POOL_SIZE = "animal_store_pooled", 4, 3


@pytest.fixture
def pooled_role(app):
    """The test database's role for PgBouncer, dropped afterwards: at most ROLE_CONNECTION_LIMIT
    connections, the statement timeout set on it (PgBouncer passes no `options`), rights on the
    tables."""
    with app.app_context(), db.engine.begin() as connection:
        exists = connection.scalar(
            sa.text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": POOLED_ROLE}
        )
        if not exists:
            connection.execute(sa.text(f"CREATE ROLE {POOLED_ROLE} LOGIN"))
        connection.execute(
            sa.text(f"ALTER ROLE {POOLED_ROLE} CONNECTION LIMIT {ROLE_CONNECTION_LIMIT}")
        )
        connection.execute(sa.text(f"ALTER ROLE {POOLED_ROLE} SET statement_timeout = '10s'"))
        for grant in (
            "ALL ON SCHEMA public",
            "ALL ON ALL TABLES IN SCHEMA public",
            "ALL ON ALL SEQUENCES IN SCHEMA public",
        ):
            connection.execute(sa.text(f"GRANT {grant} TO {POOLED_ROLE}"))
    yield POOLED_ROLE
    # The role is the server's, not the database's: nothing of the test is left behind.
    with app.app_context(), db.engine.begin() as connection:
        connection.execute(sa.text(f"DROP OWNED BY {POOLED_ROLE}"))
        connection.execute(sa.text(f"DROP ROLE {POOLED_ROLE}"))


@pytest.fixture
def pgbouncer(pooled_role):
    if PGBOUNCER is None:
        pytest.skip("PgBouncer is not installed (Debian: pgbouncer)")
    server = PgBouncer(sa.engine.make_url(TEST_DATABASE_URL), pooled_role, PGBOUNCER_POOL_SIZE)
    yield server.wait_until_serving()
    server.stop()


def pgbouncer_show(pgbouncer, what) -> list:
    """SHOW CLIENTS or SHOW SERVERS on PgBouncer's admin console, rows of the test database."""
    url = pgbouncer.url.set(database="pgbouncer", drivername="postgresql").render_as_string()
    with psycopg.connect(
        url, autocommit=True, prepare_threshold=None, row_factory=dict_row
    ) as admin:
        return [row for row in admin.execute(f"SHOW {what}") if row["database"] == "test"]


@pytest.mark.skipif(
    not TEST_DATABASE_URL, reason="scale-out needs PostgreSQL (SQLite serves one machine only)"
)
def test_instances_behind_pgbouncer_hold_more_connections_than_postgresql_allows(
    start_gunicorn, start_nginx, session, auth, count_pets, pgbouncer
):
    """Three instances of two workers through PgBouncer in transaction pooling: their client
    connections outnumber the role's PostgreSQL connections, and nothing is lost, duplicated or
    refused."""
    env = {
        "DATABASE_URL": pgbouncer.url.render_as_string(hide_password=False),
        "ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true",
    }
    instances = [start_gunicorn(workers=2, env=env) for _ in range(3)]
    nginx = start_nginx([address(instance) for instance in instances])
    create_and_read_concurrently(instances, nginx, session, auth, count_pets)

    clients, servers = pgbouncer_show(pgbouncer, "CLIENTS"), pgbouncer_show(pgbouncer, "SERVERS")
    assert len(clients) > ROLE_CONNECTION_LIMIT  # more than PostgreSQL would let the role open
    assert len(servers) <= PGBOUNCER_POOL_SIZE
    for instance in instances:
        assert "too many connections" not in instance.log()
        assert "prepared statement" not in instance.log()
