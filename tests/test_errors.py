"""Every failure is the error object {code, message, status} as JSON, never an HTML page."""

import json
import logging
import re

import pytest
import sqlalchemy as sa
from conftest import PROJECT_DIR
from declared import PATHS, REFUSED, sample_url

from animal_store.data.models import Pet
from animal_store.errors import (
    CATALOGUE,
    KIND_OF_STATUS,
    NGINX_ANSWERS,
    NOT_FOUND,
    error_body,
)
from animal_store.extensions import db


def assert_error_object(response, status, code):
    assert response.status_code == status
    assert response.content_type == "application/json"
    body = response.get_json()
    assert body["code"] == code
    assert body["status"] == status
    assert isinstance(body["message"], str)
    assert body["message"]
    return body


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/v1",
        "/v1/",
        "/v1/pets/",
        "/v1/pets/1/",
        "/v2/pets",
        "/v1/store/orders",
        "/v1/pets/1/photos",
    ],
)
def test_unknown_route_returns_404_error_object(client, auth, path):
    assert_error_object(client.get(path, headers=auth), 404, "not_found")


@pytest.mark.parametrize(("rule", "method"), REFUSED)
def test_unsupported_method_returns_405_with_allow(client, auth, rule, method):
    # Allow names every method the path's routes declare, in order, whoever asks.
    path, allowed = sample_url(rule), ", ".join(sorted(PATHS[rule]))
    response = client.open(path, method=method, headers=auth)
    body = assert_error_object(response, 405, "method_not_allowed")
    assert response.headers["Allow"] == allowed
    assert body["message"] == f"Method {method} is not allowed on {path}; use {allowed}."


@pytest.fixture
def failing_app(app):
    """The app with two extra routes that fail the way real bugs do."""

    @app.get("/boom")
    def boom():
        raise RuntimeError("secret connection string postgres://u:p@db")

    @app.get("/broken-write")
    def broken_write():
        db.session.add(Pet(name="half", category_id=1))
        db.session.flush()
        db.session.execute(sa.text("SELECT * FROM no_such_table"))

    return app


def test_unexpected_exception_returns_500_without_details(failing_app, caplog):
    with caplog.at_level(logging.ERROR):
        response = failing_app.test_client().get("/boom")
    body = assert_error_object(response, 500, "internal_error")
    assert "secret" not in response.get_data(as_text=True)
    assert body["message"] == "The server failed to handle the request."
    assert "RuntimeError: secret connection string" in caplog.text
    assert "Traceback" in caplog.text


def test_failed_request_leaves_session_clean(failing_app, client, auth, count_pets):
    client = failing_app.test_client()
    assert_error_object(client.get("/broken-write"), 500, "internal_error")
    assert count_pets() == 0
    response = client.post("/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=auth)
    assert response.status_code == 201
    assert count_pets() == 1


@pytest.mark.parametrize(
    ("command", "path"),
    [("table", "docs/errors.rst"), ("nginx", "config/nginx.conf")],
)
def test_catalogue_outputs_are_what_the_files_hold(runner, command, path):
    # docs/errors.rst's table and nginx's error bodies are the catalogue's, not copies by hand.
    result = runner.invoke(args=["errors", command])
    assert result.exit_code == 0
    assert result.output.strip() in (PROJECT_DIR / path).read_text()


def test_every_nginx_error_body_comes_from_the_catalogue():
    answered = re.findall(
        r"return (\d{3}) '(\{.*\})';", (PROJECT_DIR / "config/nginx.conf").read_text()
    )
    # Its own refusals, and the 404 that hides /metrics from the internet.
    assert {int(status) for status, _ in answered} == {*NGINX_ANSWERS, 404}
    for status, body in answered:
        kind = KIND_OF_STATUS[int(status)]
        assert json.loads(body)["code"] == kind.code
        if kind is NOT_FOUND:
            assert json.loads(body) == error_body(kind, kind.message.format(path="/metrics"))


def test_catalogue_codes_keep_one_status_each():
    statuses = {}
    for kind in CATALOGUE:
        statuses.setdefault(kind.code, set()).add(kind.status)
    assert all(len(of_code) == 1 for of_code in statuses.values()), statuses
