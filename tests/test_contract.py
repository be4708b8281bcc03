"""The service keeps its OpenAPI document: schemathesis sends generated valid and invalid requests
to every operation, through WSGI, with every check on. The contract's own operations are written
out here, once: the document must hold them, whatever it adds.

The run is bounded and seeded so CI is short and repeatable; CONTRACT_MAX_EXAMPLES and
CONTRACT_SEED make a longer or different run locally (docs/development.rst, "Contract tests").
"""

import os
from datetime import UTC, datetime

import pytest
import schemathesis
import sqlalchemy as sa
from hypothesis import HealthCheck, settings

from animal_store import create_app
from animal_store.access.auth import VISIBLE_PREFIX_LENGTH, hash_key
from animal_store.data.filters import LIST_FILTERS, walk_of
from animal_store.data.models import ApiKey, IdempotencyRecord
from animal_store.data.pagination import CURSOR_TEXT, Position, decode_cursor, encode_cursor
from animal_store.extensions import db

CONTRACT_SEED = int(os.environ.get("CONTRACT_SEED", "20261122"))
CONTRACT_MAX_EXAMPLES = int(os.environ.get("CONTRACT_MAX_EXAMPLES", "30"))
# A fixed key, because schemathesis builds its coverage-phase requests at collection, before any
# test has a database to make a key in; contract_app stores it (its hash) in each test's database.
CONTRACT_API_KEY = "ask_contract-tests-only-0000000000000000000000000"


class RunningTestApp:
    """The WSGI app schemathesis calls: the app of the test running now, on its own database.

    schemathesis.pytest.from_fixture would load the schema per test instead, but it breaks on
    pytest 9.2 (it sets the node's _nodeid, which pytest 9.2 no longer has).
    """

    def __init__(self):
        # The document does not depend on the data: at collection, an app on an unused
        # in-memory database serves it.
        self.app = create_app({"TESTING": True, "DATABASE_URL": "sqlite://"})

    def __call__(self, environ, start_response):
        return self.app(environ, start_response)


running_test_app = RunningTestApp()
schema = schemathesis.openapi.from_wsgi(
    "/v1/openapi.json",
    running_test_app,
    config=schemathesis.Config.from_dict(
        {
            "seed": CONTRACT_SEED,
            "generation": {"max-examples": CONTRACT_MAX_EXAMPLES, "database": "none"},
            # Through schemathesis's auth, so its checks can also leave the key out or spoil it.
            "auth": {"openapi": {"bearerAuth": {"bearer": CONTRACT_API_KEY}}},
        }
    ),
)


# JSON Schema's "integer" admits 1.0, so schemathesis sends whole floats such as 150518.0 as
# valid integers; the service refuses them on purpose (400, tests/test_validation.py), a rule JSON
# Schema cannot express and the document states in words. Such bodies are left out of generation,
# never the check that would catch a rejected valid request.
INTEGER_PROPERTIES = {
    name
    for component in schema.raw_schema["components"]["schemas"].values()
    for name, property_schema in component.get("properties", {}).items()
    if property_schema.get("type") == "integer"
}


@schema.hook("filter_body")
def no_whole_floats_for_integers(context, body):
    return not (
        isinstance(body, dict)
        and any(
            isinstance(body.get(name), float) and body[name].is_integer()
            for name in INTEGER_PROPERTIES
        )
    )


# A cursor is opaque: only the service makes valid ones, so a random string of the documented
# shape is refused (400), as the document says. Where schemathesis means a valid cursor, it gets a
# real one for the same walk; cursors of the wrong shape (negative data) go out untouched. Done on
# the case itself, because the coverage phase's requests bypass the generation hooks.
def with_real_cursor(case):
    cursor = case.query.get("cursor") if isinstance(case.query, dict) else None
    if isinstance(cursor, str) and CURSOR_TEXT.fullmatch(cursor):
        try:
            decode_cursor(cursor)
        except ValueError:
            # The walk of the filters the case gives valid values, as the service loads them.
            given = {
                list_filter.name: case.query[list_filter.name]
                for list_filter in LIST_FILTERS
                if case.query.get(list_filter.name) in list_filter.choices
            }
            case.query["cursor"] = encode_cursor(Position(1, walk_of(given)))
    return case


# The contract's operations (its section 4): method, path, name, the statuses it names and whether
# it is deprecated. The document may add operations and statuses (docs/api.rst, The operations),
# never drop these; every other test derives the operations from the app.
CONTRACT_OPERATIONS = [
    ("get", "/pets", "listPets", {"200", "401"}, False),
    ("post", "/pets", "createPet", {"201", "400", "401"}, False),
    ("get", "/pets/{petId}", "getPet", {"200", "401", "404"}, True),
]


@pytest.mark.parametrize(
    ("method", "path", "operation_id", "statuses", "deprecated"), CONTRACT_OPERATIONS
)
def test_document_has_the_contracts_operations(
    client, method, path, operation_id, statuses, deprecated
):
    operation = client.get("/v1/openapi.json").get_json()["paths"][path][method]
    assert operation["operationId"] == operation_id
    assert statuses <= set(operation["responses"])
    assert operation.get("deprecated", False) is deprecated


@pytest.fixture
def app(make_app):
    # A contract run is one address sending keys left out and spoilt by the thousand: the flood
    # that AUTH_FAILURE_LIMIT answers 429 once past its budget, where schemathesis rightly checks
    # for 401. Off here, as the run is about the document; the limit has tests of its own
    # (tests/test_auth_failures.py, tests/test_key_floods.py).
    return make_app(AUTH_FAILURE_LIMIT=None)


@pytest.fixture
def contract_app(app, make_pet):
    """Make the test's app the one schemathesis calls, with CONTRACT_API_KEY a valid key and an
    animal with id 1 (the smallest id, which schemathesis tries) for getPet to find."""
    make_pet()
    with app.app_context():
        db.session.add(
            ApiKey(
                name="contract-tests",
                prefix=CONTRACT_API_KEY[:VISIBLE_PREFIX_LENGTH],
                key_hash=hash_key(CONTRACT_API_KEY),
                created_at=datetime.now(UTC),
            )
        )
        db.session.commit()
    collection_app, running_test_app.app = running_test_app.app, app
    yield app
    running_test_app.app = collection_app


@schema.parametrize()
# One app and database per operation, shared by its generated requests as a live server's is.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_service_keeps_its_openapi_document(case, contract_app):
    # Each generated request stands alone, but its Idempotency-Key is drawn from a small space:
    # a key an earlier case used with another body would rightly get 422. Forget earlier keys.
    with contract_app.app_context():
        db.session.execute(sa.delete(IdempotencyRecord))
        db.session.commit()
    with_real_cursor(case).call_and_validate()
