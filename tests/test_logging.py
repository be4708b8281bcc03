"""Request IDs and JSON log lines: shape, the request ID in every line, and never the key."""

import json
import logging
import os
import re
import subprocess
import sys
from datetime import UTC, datetime

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st
from nginx_server import PROJECT_DIR, free_port, stop_process, wait_for_port

from animal_store.observability.logs import utc_time


def log_lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_request_id_generated_when_absent(client, auth):
    first = client.get("/v1/pets", headers=auth).headers["X-Request-ID"]
    second = client.get("/v1/pets", headers=auth).headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert first != second


@pytest.mark.parametrize(
    "request_id", ["abc", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "trace:span.1_x", "x" * 200]
)
def test_valid_request_id_kept(client, auth, request_id):
    response = client.get("/v1/pets", headers={**auth, "X-Request-ID": request_id})
    assert response.headers["X-Request-ID"] == request_id


@pytest.mark.parametrize("request_id", ["", "x" * 201, "has space", "semi;colon", "é", "a/b"])
def test_invalid_request_id_replaced(client, auth, request_id):
    response = client.get("/v1/pets", headers={**auth, "X-Request-ID": request_id})
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-ID"])


@pytest.mark.parametrize(
    ("path", "status"), [("/v1/pets", 401), ("/nowhere", 404), ("/healthz", 200)]
)
def test_request_id_on_every_response(client, path, status):
    response = client.get(path, headers={"X-Request-ID": "given-id"})
    assert response.status_code == status
    assert response.headers["X-Request-ID"] == "given-id"


def test_one_json_line_per_request(client, auth, capsys):
    capsys.readouterr()
    client.post(
        "/v1/pets?dry=1",
        json={"name": "Rex", "categoryId": 1},
        headers={**auth, "X-Request-ID": "req-1"},
        environ_base={"REMOTE_ADDR": "192.0.2.7"},
    )
    [line] = log_lines(capsys)
    assert set(line) == {
        "time",
        "level",
        "logger",
        "message",
        "request_id",
        "method",
        "path",
        "query",
        "status",
        "duration_ms",
        "remote_addr",
        "api_key_name",
        "api_key_prefix",
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", line["time"])
    assert line["level"] == "INFO"
    assert line["logger"] == "animal_store.request"
    assert line["request_id"] == "req-1"
    # createPet declares no query parameter: the name is kept, the value is not.
    assert (line["method"], line["path"], line["query"]) == ("POST", "/v1/pets", "dry=***")
    assert line["status"] == 201
    assert line["duration_ms"] >= 0
    assert line["remote_addr"] == "192.0.2.7"
    assert line["api_key_name"] == "tester"
    assert line["api_key_prefix"] == auth["Authorization"].removeprefix("Bearer ")[:10]


# A query as sent, and as the request line writes it: the values of the parameters the
# operation declares (listPets: limit, status, cursor) as sent, every other value masked.
MASKED_QUERIES = {
    "api-key": ("/v1/pets?api_key={key}", "api_key=***"),
    "access-token": ("/v1/pets?limit=5&access_token={key}", "limit=5&access_token=***"),
    "unknown-parameter": ("/v1/pets?x-token={key}&status=sold", "x-token=***&status=sold"),
    "repeated": ("/v1/pets?key=1&key={key}", "key=***&key=***"),
    "escaped-name": ("/v1/pets?api%5Fkey={key}&lim%69t=3", "api%5Fkey=***&lim%69t=3"),
    "bare-key": ("/v1/pets?{key}", "***"),
    "empty-parts": ("/v1/pets?&limit=2&&token={key}", "&limit=2&&token=***"),
    "operation-without-parameters": ("/v1/pets/1?limit={key}", "limit=***"),
    "no-route": ("/v1/nowhere?limit={key}", "limit=***"),
    "public-route": ("/healthz?api_key={key}", "api_key=***"),
}


@pytest.mark.parametrize(("url", "logged"), MASKED_QUERIES.values(), ids=MASKED_QUERIES.keys())
def test_query_values_not_declared_are_masked(client, api_key, capsys, url, logged):
    capsys.readouterr()
    client.get(url.format(key=api_key))
    output = capsys.readouterr().out
    [line] = [json.loads(text) for text in output.splitlines()]
    assert line["query"] == logged
    assert api_key not in output


NGINX_CONFIG = PROJECT_DIR / "config" / "nginx.conf"
# One map per query parameter nginx logs: the first value of exactly that name, from $args.
NGINX_PARAMETER_MAP = re.compile(
    r'^map \$args \$(\w+) \{\n    "~\(\?:\^\|&\)(\w+)=\(\?<(\w+)>\[\^&\]\*\)" \$\3;\n'
    r'    default "";\n\}$',
    re.MULTILINE,
)


def nginx_log_format():
    """The text of the shipped access log format, its quoted pieces joined."""
    directive = re.search(
        r"^log_format animal_store_json escape=json\n(.*?);$",
        NGINX_CONFIG.read_text(),
        re.MULTILINE | re.DOTALL,
    )
    return "".join(re.findall(r"'([^']*)'", directive[1]))


def test_nginx_logs_the_values_of_exactly_the_query_parameters_the_service_defines(client):
    document = client.get("/v1/openapi.json").json
    defined = {
        parameter["name"]
        for path in document["paths"].values()
        for operation in path.values()
        if isinstance(operation, dict)
        for parameter in operation.get("parameters", [])
        if parameter["in"] == "query"
    }
    log_format = nginx_log_format()
    # Nothing that holds the query as sent: not the URI, the request line or the arguments.
    for variable in ("$request_uri", "$request ", '$request"', "$args", "$query_string", "$arg_"):
        assert variable not in log_format
    maps = {
        variable: name
        for variable, name, _ in NGINX_PARAMETER_MAP.findall(NGINX_CONFIG.read_text())
    }
    query = re.search(r'"query":\{([^}]*)\}', log_format)[1]
    logged = dict(re.findall(r'"(\w+)":"\$(\w+)"', query))
    assert {name: maps.get(variable) for name, variable in logged.items()} == {
        name: name for name in defined
    }


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_logs_never_hold_the_key(client, api_key, capsys, scheme):
    capsys.readouterr()
    client.get("/v1/pets", headers={"Authorization": f"{scheme} {api_key}"})
    client.get("/v1/pets", headers={"Authorization": f"{scheme} {api_key}x"})  # a wrong key
    output = capsys.readouterr().out
    assert api_key not in output
    assert "Authorization" not in output
    assert len(output.splitlines()) == 2


def test_unauthenticated_request_logs_no_key_name(client, capsys):
    capsys.readouterr()
    client.get("/v1/pets")
    [line] = log_lines(capsys)
    assert (line["status"], line["api_key_name"], line["api_key_prefix"]) == (401, None, None)


def test_every_line_of_a_request_has_its_id(make_app, capsys):
    app = make_app()

    @app.get("/fails")
    def fails():
        app.logger.warning("about to fail")
        raise RuntimeError("boom")

    capsys.readouterr()
    response = app.test_client().get("/fails", headers={"X-Request-ID": "req-2"})
    assert response.status_code == 500
    lines = log_lines(capsys)
    messages = [line["message"] for line in lines]
    assert messages == ["about to fail", "Unhandled exception", "request"]
    assert {line["request_id"] for line in lines} == {"req-2"}
    assert "RuntimeError: boom" in lines[1]["exception"]
    assert lines[1]["level"] == "ERROR"


def test_log_level_setting_filters_request_lines(make_app, capsys):
    app = make_app(LOG_LEVEL="WARNING")
    capsys.readouterr()
    app.test_client().get("/healthz")
    assert capsys.readouterr().out == ""


def test_a_handler_the_operator_adds_gets_the_request_lines(client, capsys):
    # The line is written straight to stdout only while nothing else listens: an operator's
    # handler receives the record, and stdout still gets the same line through logging.
    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    collect = Collect()
    logger = logging.getLogger("animal_store.request")
    logger.addHandler(collect)
    try:
        capsys.readouterr()
        client.get("/healthz", headers={"X-Request-ID": "req-3"})
    finally:
        logger.removeHandler(collect)
    [record] = collect.records
    assert (record.getMessage(), record.fields["path"], record.fields["status"]) == (
        "request",
        "/healthz",
        200,
    )
    [line] = log_lines(capsys)
    assert (line["path"], line["request_id"]) == ("/healthz", "req-3")


# `quickstart` (the README's) migrates in process first, where Alembic configures logging.
@pytest.mark.parametrize("command", ["run", "quickstart"])
def test_the_development_server_writes_one_line_a_request_and_no_colour_codes(
    database_url, tmp_path, command
):
    port = free_port()
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "flask", "--app", "animal_store", command, "--port", str(port)],
            cwd=PROJECT_DIR,
            env={**os.environ, "DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=err,
        )
        try:
            wait_for_port(server, port, "flask run", stderr.read_text, timeout=30)
            for path in ("/healthz", "/nowhere"):
                requests.get(f"http://127.0.0.1:{port}{path}", timeout=10)
        finally:
            stop_process(server, timeout=10)
    # Flask says " * Serving Flask app ..." on stdout; the app's lines are the JSON ones.
    printed = stdout.read_text().splitlines()
    lines = [json.loads(line) for line in printed if line.startswith("{")]
    assert [(line["path"], line["status"]) for line in lines] == [
        ("/healthz", 200),
        ("/nowhere", 404),
    ]
    said = stderr.read_text()
    assert f" * Running on http://127.0.0.1:{port}" in said
    assert "Press CTRL+C to quit" in said
    others = [line for line in printed if not line.startswith("{")] + said.splitlines()
    assert not [line for line in others if "/healthz" in line or "/nowhere" in line]
    assert "\x1b[" not in stdout.read_text() + said


@pytest.mark.parametrize(
    "created",
    [0.0, 1.0004999, 1.0005, 1.9994999, 1.9995, 1.9999996, 1764230000.9999999, 1795768142.2979994],
)
def test_a_lines_time_is_datetimes_to_the_millisecond(created):
    # The second before, so the second's text is made anew and then reused.
    for moment in (created - 1, created, created + 0.25):
        expected = datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds")
        assert utc_time(moment) == expected


@given(st.floats(min_value=0, max_value=2**33, allow_nan=False))
def test_any_lines_time_is_datetimes_to_the_millisecond(created):
    expected = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    assert utc_time(created) == expected
