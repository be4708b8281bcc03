"""The /v1 API layer: a resource registered under it is authenticated, rate-limited, documented
and answers error objects, with no code of its own for any of that."""

import pytest
from declared import operations
from marshmallow import Schema, fields

from animal_store import RESOURCES, create_app, errors
from animal_store.api import Blueprint, public
from animal_store.extensions import db

# A throwaway resource, as a new engineer would add one: its views, schemas and errors only.
orders = Blueprint("orders", __name__)


class OrderSchema(Schema):
    id = fields.Integer(required=True)


class OrderQuerySchema(Schema):
    verbose = fields.Boolean()


@orders.route("/orders/<order_id>", methods=["GET"])
@orders.doc(operationId="getOrder")
@orders.errors(errors.NOT_FOUND, errors.VALIDATION_ERROR)
@orders.arguments(OrderQuerySchema(), location="query")
@orders.response(200, OrderSchema())
def get_order(query, order_id):
    """Return an order."""
    if order_id == "boom":
        raise RuntimeError("a bug in the new resource")
    if order_id != "1":
        raise errors.NOT_FOUND(path=f"/v1/orders/{order_id}")
    return {"id": 1}


@orders.route("/orders/opening-hours", methods=["GET"])
@public
def opening_hours():
    """Say when orders are taken: open to anyone."""
    return {"hours": "always"}


# The app's operations with this resource's among them.
ALL_OPERATIONS = operations(
    create_app({"TESTING": True, "DATABASE_URL": "sqlite://"}, resources=(*RESOURCES, orders))
)


@pytest.fixture
def app(database_url):
    app = create_app(
        {"TESTING": True, "DATABASE_URL": database_url, "RATE_LIMIT": "3 per minute"},
        resources=(*RESOURCES, orders),
    )
    yield app
    with app.app_context():
        db.engine.dispose()


def assert_error_object(response, status, code):
    assert response.status_code == status
    assert response.content_type == "application/json"
    body = response.get_json()
    assert (body["code"], body["status"]) == (code, status)
    assert body["message"]
    return body


@pytest.mark.parametrize(
    ("authorization", "challenge"),
    [(None, 'Bearer realm="animal-store"'), ("Bearer nope", 'error="invalid_token"')],
)
def test_new_resource_needs_a_key(client, authorization, challenge):
    headers = {"Authorization": authorization} if authorization else {}
    response = client.get("/v1/orders/1", headers=headers)
    assert_error_object(response, 401, "unauthorized")
    assert challenge in response.headers["WWW-Authenticate"]
    assert response.headers["Cache-Control"] == "no-store"


def test_new_resource_answers_a_key_holder(client, auth):
    response = client.get("/v1/orders/1", headers=auth)
    assert response.status_code == 200
    assert response.get_json() == {"id": 1}
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_new_resource_shares_the_key_rate_limit(client, auth):
    assert client.get("/v1/pets", headers=auth).status_code == 200
    for remaining in (1, 0):
        response = client.get("/v1/orders/1", headers=auth)
        assert response.status_code == 200
        assert response.headers["RateLimit-Limit"] == "3"
        assert response.headers["RateLimit-Remaining"] == str(remaining)
    response = client.get("/v1/orders/1", headers=auth)
    assert_error_object(response, 429, "too_many_requests")
    assert int(response.headers["Retry-After"]) >= 1


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/orders/2", 404, "not_found"),
        ("GET", "/v1/orders/1?verbose=perhaps", 400, "validation_error"),
        ("DELETE", "/v1/orders/1", 405, "method_not_allowed"),
        ("GET", "/v1/orders/boom", 500, "internal_error"),
    ],
)
def test_new_resource_errors_are_error_objects(client, auth, method, path, status, code):
    assert_error_object(client.open(path, method=method, headers=auth), status, code)


def test_public_route_needs_no_key_and_is_not_limited(client):
    for _ in range(5):
        response = client.get("/v1/orders/opening-hours")
        assert response.status_code == 200
        assert "RateLimit-Limit" not in response.headers
        assert "Cache-Control" not in response.headers


def test_new_resource_is_documented_with_what_the_layer_gives(app):
    views = {operation.endpoint.rpartition(".")[2]: operation for operation in operations(app)}
    operation = views["get_order"].documented
    assert operation["operationId"] == "getOrder"
    assert operation["tags"] == ["orders"]
    # What its view declares (200, 404, 400 for its arguments), and what the layer adds.
    assert set(operation["responses"]) == {str(status) for status in views["get_order"].statuses}
    assert {"200", "400", "404"} < set(operation["responses"])
    assert "WWW-Authenticate" in operation["responses"]["401"]["headers"]
    assert operation["security"] == [{"bearerAuth": ["read"]}]  # a GET needs the read scope
    assert "RateLimit-Remaining" in operation["responses"]["200"]["headers"]
    assert "Retry-After" in operation["responses"]["429"]["headers"]
    open_to_anyone = views["opening_hours"].documented
    assert open_to_anyone["security"] == []
    assert "401" not in open_to_anyone["responses"]


@pytest.mark.parametrize("operation", ALL_OPERATIONS, ids=str)
def test_an_operation_declared_deprecated_says_so_on_every_answer(client, auth, operation):
    # Whatever the answer (a body that is refused, an id that names nothing), and only for the
    # operations whose views declare it.
    response = client.open(operation.url, method=operation.method, headers=auth, json={})
    assert response.status_code < 500
    headers = {"Deprecation", "Sunset"} & set(response.headers.keys())
    assert headers == ({"Deprecation", "Sunset"} if operation.deprecated else set())
    if operation.deprecated:
        assert 'rel="successor-version"' in response.headers["Link"]
