"""End to end: the shipped gunicorn config serving wsgi:app on a loopback port, over real HTTP."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import gunicorn
import pytest
import requests
from conftest import IN_POSTGRESQL_PASS, PROJECT_DIR, break_release, copy_release, free_port
from test_settings import EVERY_KIND_OF_BAD_SETTING, EVERY_KIND_SAID

GUNICORN = (sys.executable, "-m", "gunicorn", "-c", "config/gunicorn.conf.py", "wsgi:app")


def test_first_session_over_http(start_gunicorn, api_key):
    server = start_gunicorn(workers=2)
    auth = {"Authorization": f"Bearer {api_key}"}

    created = requests.post(
        f"{server.url}/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=auth, timeout=10
    )
    assert created.status_code == 201
    pet = created.json()
    assert created.headers["Location"] == f"{server.url}/v1/pets/{pet['id']}"

    listed = requests.get(f"{server.url}/v1/pets", headers=auth, timeout=10)
    assert listed.json() == [pet]

    fetched = requests.get(created.headers["Location"], headers=auth, timeout=10)
    assert fetched.json() == pet
    assert fetched.headers["Sunset"] == "Thu, 05 Dec 2030 00:00:00 GMT"

    unauthorized = requests.get(f"{server.url}/v1/pets", timeout=10)
    assert unauthorized.status_code == 401
    assert unauthorized.headers["Content-Type"] == "application/json"
    assert unauthorized.json()["code"] == "unauthorized"

    missing = requests.get(f"{server.url}/nowhere", headers=auth, timeout=10)
    assert missing.status_code == 404
    assert missing.json() == {
        "code": "not_found",
        "message": "No resource at /nowhere.",
        "status": 404,
    }


def test_writes_from_several_workers_all_land(start_gunicorn, api_key, count_pets):
    from concurrent.futures import ThreadPoolExecutor

    server = start_gunicorn(workers=3)
    auth = {"Authorization": f"Bearer {api_key}"}

    def create(n):
        return requests.post(
            f"{server.url}/v1/pets",
            json={"name": f"pet{n}", "categoryId": n},
            headers=auth,
            timeout=30,
        ).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(create, range(200)))
    assert statuses == [201] * 200
    assert count_pets() == 200


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_command_line_workers_override_the_config(start_gunicorn):
    server = start_gunicorn(workers=3)
    # Serving means one worker is up; the others may still be forking.
    deadline = time.monotonic() + 20
    while True:
        workers = subprocess.run(
            ["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        if len(workers) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(workers) == 3


def test_an_unreachable_database_does_not_stop_the_boot(start_gunicorn):
    # Nothing listens there: the service starts, says so once, and answers 503 until it does.
    server = start_gunicorn(
        workers=1, database=f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"
    )
    assert requests.get(server.url + "/readyz", timeout=10).status_code == 503
    said = [json.loads(line) for line in server.log().splitlines()]
    assert next(r["message"] for r in said if r["level"] in ("WARNING", "ERROR")).startswith(
        "The database does not answer (postgresql+psycopg://po"
    )


def test_production_start_without_database_url_fails_loudly(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    environment["ANIMAL_STORE_ENV"] = "production"
    result = subprocess.run(
        [*GUNICORN, "--bind", "127.0.0.1:0", "--workers", "1"],
        cwd=PROJECT_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "needs 'DATABASE_URL' in the environment" in result.stdout + result.stderr


def test_app_imports_without_gunicorn(tmp_path):
    # A stand-in package that fails to import, first on the path, hides the real gunicorn.
    (tmp_path / "gunicorn").mkdir()
    (tmp_path / "gunicorn" / "__init__.py").write_text("raise ImportError('no gunicorn here')\n")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import animal_store; animal_store.create_app({'DATABASE_URL': 'sqlite:///x.db'})",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{PROJECT_DIR}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_control_socket_is_off_unless_a_path_is_given(start_gunicorn, tmp_path):
    # gunicorn's default would put it in the service user's home: the checkout, in docs/deploy.rst.
    home = tmp_path / "home"
    home.mkdir()
    start_gunicorn(workers=1, env={"HOME": str(home)})
    assert list(home.iterdir()) == []
    socket_path = tmp_path / "gunicorn.ctl"
    start_gunicorn(workers=1, env={"HOME": str(home), "GUNICORN_CONTROL_SOCKET": str(socket_path)})
    # The arbiter opens it on a thread of its own, not before the workers serve.
    deadline = time.monotonic() + 10
    while not socket_path.is_socket() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert socket_path.is_socket()
    assert list(home.iterdir()) == []


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_a_slow_request_does_not_hold_up_one_an_idle_worker_can_serve(
    start_gunicorn, api_key, slow_insert
):
    """Behind a creation that takes about 2 s, a read sent on a fresh connection is served by
    the idle worker at once: it is answered before the slow one, every time. (A worker that
    accepted connections while its one thread was busy made it wait in about half the tries.)"""
    server = start_gunicorn(workers=2)
    auth = {"Authorization": f"Bearer {api_key}"}

    def finished(method, url, **kwargs):
        response = requests.request(method, url, headers=auth, timeout=30, **kwargs)
        assert response.ok, response.text
        return time.monotonic()

    for _ in range(4):
        with ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(
                finished,
                "POST",
                server.url + "/v1/pets",
                json={"name": "Slowpoke", "categoryId": 1},
            )
            time.sleep(0.3)
            quick = finished("GET", server.url + "/v1/pets?limit=1")
            assert quick < slow.result()


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_the_metrics_directory_it_made_is_removed_when_it_stops(start_gunicorn, tmp_path, auth):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    server = start_gunicorn(env={"TMPDIR": str(temporary), "PROMETHEUS_MULTIPROC_DIR": ""})
    assert requests.get(f"{server.url}/v1/pets", headers=auth, timeout=10).status_code == 200
    (made,) = temporary.iterdir()
    assert made.name.startswith("animal-store-metrics-")
    assert any(made.glob("*.db"))  # the workers' figures are there
    server.stop()
    assert server.process.returncode == 0
    assert list(temporary.iterdir()) == []


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_a_metrics_directory_it_was_given_is_kept(start_gunicorn, tmp_path):
    given = tmp_path / "metrics"
    given.mkdir()
    server = start_gunicorn(workers=1, env={"PROMETHEUS_MULTIPROC_DIR": str(given)})
    requests.get(f"{server.url}/healthz", timeout=10)
    server.stop()
    assert given.is_dir()


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("ANIMAL_STORE_MAX_CONTENT_LENGTH", "64k"),
        ("ANIMAL_STORE_OPENAPI_SERVERS", '[{"url": "https://pets.example.net/v1"'),
        ("ANIMAL_STORE_RATELIMIT_ENABLED", "False"),
        ("ANIMAL_STORE_MAX_CONTENT_LENTGH", "131072"),
    ],
)
def test_a_bad_setting_stops_gunicorn_before_any_worker_in_one_line(tmp_path, variable, text):
    refusal = refused_boot(tmp_path, {variable: text})
    assert len(refusal) == 1
    assert refusal[0]["message"].startswith(
        (f"Setting {variable[13:]} from {variable} is {text!r}", f"{variable} names no setting")
    )


def test_every_bad_setting_is_its_own_record_in_gunicorns_log(tmp_path):
    refusal = refused_boot(tmp_path, EVERY_KIND_OF_BAD_SETTING)
    said = [line["message"] for line in refusal]
    assert [line[: len(start)] for start, line in zip(EVERY_KIND_SAID, said, strict=True)] == (
        EVERY_KIND_SAID
    )


def refused_boot(tmp_path, variables, release=PROJECT_DIR) -> list[dict]:
    """Start gunicorn on a release with these settings in its environment; return the records
    of its log after its start line, once it has exited 1 before any worker, leaving no
    temporary files."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ANIMAL_STORE_")}
    environment |= {**variables, "TMPDIR": str(temporary), "PROMETHEUS_MULTIPROC_DIR": ""}
    result = subprocess.run(
        [*GUNICORN, "--bind", "127.0.0.1:0", "--workers", "2"],
        cwd=release,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr == ""
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["message"] == f"Starting gunicorn {gunicorn.__version__}"
    assert {line["level"] for line in lines[1:]} == {"ERROR"}
    assert list(temporary.iterdir()) == []
    return lines[1:]


def tracebacks(lines) -> list[dict]:
    """The records of these gunicorn log lines that carry a traceback."""
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if "exception" in r or "Traceback" in r["message"]]


def test_an_unimportable_release_stops_the_boot_with_its_import_error_once(tmp_path):
    release = copy_release(tmp_path / "release")
    said = break_release(release)
    database = {"DATABASE_URL": f"sqlite:///{tmp_path / 'store.sqlite3'}"}
    errors = refused_boot(tmp_path, database, release)
    assert [(line["level"], line["message"]) for line in errors] == [
        ("ERROR", "The release cannot be imported")
    ]
    assert errors[0]["exception"].splitlines()[-1] == said


@IN_POSTGRESQL_PASS  # not about the database (conftest.py)
def test_a_reload_onto_an_unimportable_release_says_its_import_error_once_a_worker(
    start_gunicorn, tmp_path
):
    release = copy_release(tmp_path / "release")
    server = start_gunicorn(workers=2, directory=release)
    said = break_release(release)
    server.process.send_signal(signal.SIGHUP)
    # gunicorn stops the instance when a worker cannot load the app.
    assert server.process.wait(timeout=60) != 0
    after_reload = server.log().partition("Hang up: Master")[2].splitlines()
    said_with_traceback = tracebacks(after_reload)
    assert 1 <= len(said_with_traceback) <= 2, said_with_traceback
    for record in said_with_traceback:
        assert record["message"] == "Exception in worker process"
        assert record["exception"].splitlines()[-1] == said


CLIENT_ID = "client-id-7"
# Requests gunicorn refuses itself, before any app runs: (request line, header lines, status,
# whether gunicorn had parsed the headers, so that the client's own ID comes back).
OWN_REFUSALS = {
    "expectation": ("POST /v1/pets HTTP/1.1", ["Expect: pay-first"], 417, False),
    "unknown-coding": ("POST /v1/pets HTTP/1.1", ["Transfer-Encoding: x-unknown"], 501, False),
    "coding-not-decoded": ("POST /v1/pets HTTP/1.1", ["Transfer-Encoding: gzip"], 501, True),
    "bad-request-line": ("GET /v1/pets HTTP/1.1 x", [], 400, False),
    "bad-version": ("GET /v1/pets HTTP/9.9", [], 400, False),
    "uri-too-long": ("GET /v1/pets?q=" + "x" * 5000 + " HTTP/1.1", [], 414, False),
    "header-too-large": ("GET /v1/pets HTTP/1.1", ["X-Big: " + "x" * 9000], 431, False),
}


def raw_exchange(port, request_line, header_lines) -> tuple[int, dict[str, str]]:
    """Send one request as these exact lines; return the answer's status and headers."""
    lines = [request_line, "Host: 127.0.0.1", *header_lines, "Content-Length: 0"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer and (data := connection.recv(65536)):
            answer += data
    status_line, *fields = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = dict(field.split(": ", 1) for field in fields)
    return int(status_line.split()[1]), headers


@pytest.mark.parametrize(
    ("request_line", "header_lines", "status", "parsed"),
    OWN_REFUSALS.values(),
    ids=OWN_REFUSALS.keys(),
)
def test_gunicorns_own_refusals_carry_a_request_id_its_log_line_names(
    module_gunicorn, request_line, header_lines, status, parsed
):
    # One request on a connection of its own to the module's gunicorn: its log from here on.
    server, since = module_gunicorn, len(module_gunicorn.log())
    sent = [f"X-Request-ID: {CLIENT_ID}", *header_lines]
    answered, headers = raw_exchange(server.port, request_line, sent)
    assert answered == status
    request_id = headers["X-Request-ID"]
    if parsed:
        assert request_id == CLIENT_ID
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    # gunicorn's warning about the refusal names the same ID.
    deadline = time.monotonic() + 30
    while (
        f'"request_id":"{request_id}"' not in server.log()[since:] and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    named = [
        record
        for record in map(json.loads, re.findall(r"^{.*}$", server.log()[since:], re.MULTILINE))
        if record.get("request_id") == request_id
    ]
    assert [record["message"][:16] for record in named] == ["Invalid request "]
