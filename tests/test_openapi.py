"""The OpenAPI document: served without a key, valid, and saying what the service enforces."""

import json
import re
import socket
import sys
import threading
import unicodedata

import pytest
from declared import OPERATIONS, PROTECTED, declared_fields, operations
from marshmallow import ValidationError
from openapi_spec_validator import validate
from werkzeug.serving import make_server

from animal_store.data.filters import LIST_FILTERS
from animal_store.data.pagination import MAX_CURSOR_LENGTH
from animal_store.errors import APIError
from animal_store.idempotency.header import KEY_PATTERN as IDEMPOTENCY_KEY_PATTERN
from animal_store.idempotency.header import idempotency_key
from animal_store.openapi import DOCS_CSP
from animal_store.schemas import (
    INT64_MAX,
    INT64_MIN,
    NAME_PATTERN,
    EnumField,
    NewPetSchema,
    validate_name,
)

RATE_LIMIT_HEADERS = ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset")
READ_METHODS = {"GET", "HEAD"}


def all_operations(document):
    return [
        operation
        for operations in document["paths"].values()
        for method, operation in operations.items()
        if method != "parameters"
    ]


def schemas_in(value):
    """Yield every JSON schema object in a part of the document (properties, parameters, ...)."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from schemas_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from schemas_in(item)


def test_each_enum_field_refers_to_its_one_component(document):
    # Every field of an enum type that a view loads or dumps is a reference to the enum's
    # component, wherever it appears (a query parameter, a body, an answer), and no other place
    # spells the values out again.
    referred = set()
    for operation in OPERATIONS:
        for field, node in declared_fields(operation, document):
            if isinstance(field, EnumField):
                assert node.get("$ref") == f"#/components/schemas/{field.component}", operation
                assert not {"enum", "type"} & set(node), operation
                referred.add(type(field))
    assert referred == set(EnumField.__subclasses__())
    for enum in EnumField.__subclasses__():
        component = document["components"]["schemas"][enum.component]
        assert component["enum"] == list(enum.choices)
        spelled_out = [
            node for node in schemas_in(document) if node.get("enum") == component["enum"]
        ]
        assert spelled_out == [component]


def test_status_enum_has_the_contracts_values(document):
    assert document["components"]["schemas"]["PetStatus"]["enum"] == [
        "available",
        "pending",
        "sold",
    ]


@pytest.fixture
def document(client):
    response = client.get("/v1/openapi.json")
    assert response.status_code == 200
    return response.get_json()


def test_openapi_document_is_served_without_a_key_and_validates(client):
    response = client.get("/v1/openapi.json")
    assert response.status_code == 200
    assert response.content_type == "application/json"
    document = response.get_json()
    validate(document)
    assert document["openapi"] == "3.1.0"
    assert document["info"]["version"] == "1.0.0"


def test_openapi_command_prints_the_served_document(client, runner):
    result = runner.invoke(args=["openapi"])
    assert result.exit_code == 0
    assert json.loads(result.output) == client.get("/v1/openapi.json").get_json()


def test_openapi_document_lists_every_route_of_the_api(app, document):
    # Every route of a documented resource, and nothing else, is an operation of the document.
    routes = {(operation.method, operation.path) for operation in operations(app)}
    documented = {
        (method.upper(), path)
        for path, methods in document["paths"].items()
        for method in methods
        if method != "parameters"
    }
    assert routes == documented


@pytest.mark.parametrize("operation", OPERATIONS, ids=str)
def test_each_operation_has_the_id_and_tag_its_view_declares(document, operation):
    assert operation.operation_id
    assert operation.documented["operationId"] == operation.operation_id
    ids = [documented["operationId"] for documented in all_operations(document)]
    assert ids.count(operation.operation_id) == 1
    # Tagged with its resource, so the docs page groups it there.
    assert operation.documented["tags"] == [operation.resource]


def test_openapi_servers_come_from_settings(make_app):
    servers = [
        {"url": "https://pets.example.net/v1", "description": "Production"},
        {"url": "https://staging.pets.example.net/v1", "description": "Staging"},
    ]
    document = make_app(OPENAPI_SERVERS=servers).test_client().get("/v1/openapi.json").get_json()
    assert document["servers"] == servers


def test_default_servers_are_production_and_staging_under_v1(document):
    assert [server["description"] for server in document["servers"]] == ["Production", "Staging"]
    assert all(server["url"].endswith("/v1") for server in document["servers"])


def test_every_operation_needs_a_bearer_key(document):
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": document["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    assert document["security"] == [{"bearerAuth": []}]


@pytest.mark.parametrize("operation", PROTECTED, ids=str)
def test_each_operation_names_the_scope_it_needs(operation):
    # OpenAPI 3.1: a bearer scheme's requirement may list roles; here the key's scope. Reads
    # need `read`, everything else `write` (docs/api.rst, Authentication);
    # tests/test_key_scopes.py holds each operation to the scope named here.
    expected = "read" if operation.method in READ_METHODS else "write"
    assert operation.documented["security"] == [{"bearerAuth": [expected]}]
    responses = operation.documented["responses"]
    assert "WWW-Authenticate" in responses["401"]["headers"]
    assert "`forbidden`" in responses["403"]["description"]


@pytest.mark.parametrize("operation", OPERATIONS, ids=str)
def test_every_response_the_operation_gives_is_documented(operation):
    # Its view's answers and errors, and what the layer adds; tests/test_contract.py checks that
    # the service answers none other.
    responses = operation.documented["responses"]
    assert set(responses) == {str(status) for status in operation.statuses}
    for kind in operation.error_kinds:
        response = responses[str(kind.status)]
        assert f"`{kind.code}`" in response["description"]
        assert set(kind.headers) <= set(response.get("headers", {}))
    for status, response in responses.items():
        if status == "304":
            assert "content" not in response  # Not Modified has no body
            continue
        schema = response["content"]["application/json"]["schema"]
        if status >= "400":
            assert schema == {"$ref": "#/components/schemas/Error"}
    if operation.public:
        return
    assert "Allow" in responses["405"]["headers"]
    for status in ("429", "503"):
        assert "Retry-After" in responses[status]["headers"]
    for status in set(responses) - {"405"}:
        assert set(RATE_LIMIT_HEADERS) <= set(responses[status]["headers"])


@pytest.mark.parametrize(
    ("path", "method", "own"),
    [
        ("/pets", "get", {"200", "304", "400"}),
        ("/pets", "post", {"201", "400", "409", "413", "415", "422"}),
        ("/pets/{petId}", "get", {"200", "304", "404"}),
    ],
)
def test_each_pet_operation_documents_its_own_answers(document, path, method, own):
    # Besides the contract's and the layer's: conditional GETs, arguments, bodies, idempotency.
    assert own <= set(document["paths"][path][method]["responses"])


@pytest.mark.parametrize("operation", OPERATIONS, ids=str)
def test_an_operation_is_deprecated_when_its_view_says_so(operation):
    assert operation.documented.get("deprecated", False) is operation.deprecated
    for status, response in operation.documented["responses"].items():
        headers = set(response.get("headers", {}))
        if status == "405":  # answered by routing, before the view is chosen
            assert not headers & {"Deprecation", "Sunset", "Link"}
        elif operation.deprecated:
            assert {"Deprecation", "Sunset", "Link"} <= headers
        else:  # a Link of its own (a next page) is no successor
            assert not headers & {"Deprecation", "Sunset"}


def test_get_pet_is_deprecated_with_sunset_and_successor(document):
    operation = document["paths"]["/pets/{petId}"]["get"]
    assert operation["deprecated"] is True
    assert "2030-12-05" in operation["description"]
    assert "GET /v1/pets" in operation["description"]


def test_create_pet_documents_location(document):
    created = document["paths"]["/pets"]["post"]["responses"]["201"]
    assert created["headers"] == {
        name: {"$ref": f"#/components/headers/{name}"}
        for name in ("Location", "Idempotent-Replayed", *RATE_LIMIT_HEADERS)
    }
    assert created["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Pet"}


def test_list_pets_documents_its_query_limits(document):
    operation = document["paths"]["/pets"]["get"]
    parameters = {parameter["name"]: parameter for parameter in operation["parameters"]}
    assert parameters["limit"]["in"] == "query"
    assert parameters["limit"]["schema"] == {
        "type": "integer",
        "default": 20,
        "minimum": 1,
        "maximum": 100,
    }
    assert not parameters["limit"]["required"]


@pytest.mark.parametrize("list_filter", LIST_FILTERS, ids=lambda list_filter: list_filter.name)
def test_list_pets_documents_each_filter_as_the_animals_field(document, list_filter):
    operation = document["paths"]["/pets"]["get"]
    parameters = {parameter["name"]: parameter for parameter in operation["parameters"]}
    field = document["components"]["schemas"]["Pet"]["properties"][list_filter.name]
    assert parameters[list_filter.name]["in"] == "query"
    # The field's type, without what the body says of it.
    assert parameters[list_filter.name]["schema"] == {
        key: value for key, value in field.items() if key != "description"
    }
    assert not parameters[list_filter.name]["required"]


def test_list_pets_documents_cursor_next_link_and_etag(document):
    operation = document["paths"]["/pets"]["get"]
    parameters = {parameter["name"]: parameter for parameter in operation["parameters"]}
    assert parameters["cursor"]["in"] == "query"
    assert parameters["cursor"]["schema"]["pattern"] == f"^[A-Za-z0-9_-]{{1,{MAX_CURSOR_LENGTH}}}$"
    # The releases before documented 64: the pattern may widen, never narrow.
    assert MAX_CURSOR_LENGTH >= 64
    assert parameters["If-None-Match"]["in"] == "header"
    page = operation["responses"]["200"]["headers"]
    assert page["Link"] == {"$ref": "#/components/headers/NextLink"}
    assert page["ETag"] == {"$ref": "#/components/headers/ETag"}
    assert 'rel="next"' in document["components"]["headers"]["NextLink"]["description"]
    assert "content" not in operation["responses"]["304"]


@pytest.mark.parametrize(("status", "headers"), [("409", {"Retry-After"}), ("422", set())])
def test_create_pet_documents_idempotency_errors(document, status, headers):
    operation = document["paths"]["/pets"]["post"]
    parameters = {parameter["name"]: parameter for parameter in operation["parameters"]}
    assert parameters["Idempotency-Key"]["in"] == "header"
    assert not parameters["Idempotency-Key"]["required"]
    response = operation["responses"][status]
    assert set(response.get("headers", {})) == headers | set(RATE_LIMIT_HEADERS)
    assert response["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        '"abc"',
        '"a b"',
        '"a\\"b"',
        "a b",
        '"',
        '""',
        "",
        "ä",
        "a" * 255,
        "a" * 256,
        '"' + "a" * 255 + '"',
        '"' + "a" * 256 + '"',
        "a,b",
        '"a\\b"',
        '"a\\x"',
    ],
)
def test_idempotency_key_pattern_agrees_with_the_service(app, value):
    with app.test_request_context(headers={"Idempotency-Key": value}):
        try:
            accepted = idempotency_key() is not None
        except APIError:
            accepted = False
    assert bool(re.fullmatch(IDEMPOTENCY_KEY_PATTERN, value)) == accepted


def test_new_pet_schema_states_every_rule(document):
    new_pet = document["components"]["schemas"]["NewPet"]
    assert new_pet["required"] == ["categoryId", "name"]
    assert new_pet["additionalProperties"] is False
    assert set(new_pet["properties"]) == {
        field.data_key or name for name, field in NewPetSchema().fields.items()
    }
    name = new_pet["properties"]["name"]
    assert (name["minLength"], name["maxLength"], name["pattern"]) == (1, 255, NAME_PATTERN)
    category_id = new_pet["properties"]["categoryId"]
    assert (category_id["type"], category_id["format"]) == ("integer", "int64")
    assert (category_id["minimum"], category_id["maximum"]) == (INT64_MIN, INT64_MAX)
    assert "1.0" in category_id["description"]
    assert new_pet["properties"]["status"]["$ref"] == "#/components/schemas/PetStatus"


def test_pet_schema_always_has_id_name_and_category(document):
    pet = document["components"]["schemas"]["Pet"]
    assert pet["required"] == ["categoryId", "id", "name"]
    assert pet["properties"]["id"]["format"] == "int64"
    assert pet["properties"]["id"]["readOnly"] is True


def test_pet_id_is_a_positive_int64(document):
    # Declared once for the path, so every method of /pets/{petId} shares it.
    parameters = document["paths"]["/pets/{petId}"]["parameters"]
    (parameter,) = [parameter for parameter in parameters if parameter["in"] == "path"]
    assert parameter["in"] == "path"
    assert parameter["name"] == "petId"
    assert parameter["schema"] == {
        "type": "integer",
        "format": "int64",
        "minimum": 1,
        "maximum": INT64_MAX,
    }


def test_an_animals_id_is_a_positive_int64_as_its_path_takes_it(document):
    # The id an answer gives is the one getPet's path takes, which below 1 names no animal.
    parameters = document["paths"]["/pets/{petId}"]["parameters"]
    (parameter,) = [parameter for parameter in parameters if parameter["in"] == "path"]
    in_body = document["components"]["schemas"]["Pet"]["properties"]["id"]
    assert {key: in_body[key] for key in parameter["schema"]} == parameter["schema"]


def test_error_schema_matches_error_bodies(document, client):
    error = document["components"]["schemas"]["Error"]
    assert error["required"] == ["code", "message", "status"]
    body = client.post("/v1/pets", json={}, headers={"Authorization": "Bearer nope"}).get_json()
    assert set(body) <= set(error["properties"])


def names_to_compare():
    """Every character that could be a corner of the rule, alone and among letters."""
    corners = [
        chr(code)
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) in ("Cc", "Zs", "Zl", "Zp", "Cf") or chr(code).isspace()
    ]
    return [*corners, *(f"a{char}b" for char in corners), *(f" {char} " for char in corners)]


def test_name_pattern_agrees_with_the_service_rule():
    pattern = re.compile(NAME_PATTERN)
    for name in [*names_to_compare(), "Rex", "Ñandú 🐦", "  padded  ", "x" * 255]:
        try:
            validate_name(name)
            accepted = True
        except ValidationError:
            accepted = False
        assert bool(pattern.fullmatch(name)) == accepted, repr(name)


def test_document_is_built_once_per_app(app, client):
    first = client.get("/v1/openapi.json").get_data()
    assert app.extensions["openapi"]["document"] == first
    assert client.get("/v1/openapi.json").get_data() == first


def test_docs_page_is_served_without_a_key_with_a_strict_policy(client):
    with client.get("/v1/docs") as response:
        assert response.status_code == 200
        assert response.mimetype == "text/html"
        assert response.headers["Content-Security-Policy"] == DOCS_CSP
        page = response.get_data(as_text=True)
    # Everything the page loads is ours, relative to /v1/docs; no inline script.
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources
    assert all(source.startswith("docs/") or source == "openapi.json" for source in sources)
    assert "<script>" not in page


@pytest.mark.parametrize(
    ("filename", "mimetype"),
    [
        ("swagger-ui-bundle.js", "text/javascript"),
        ("swagger-ui.css", "text/css"),
        ("docs.js", "text/javascript"),
        ("docs.css", "text/css"),
    ],
)
def test_docs_files_are_served_from_installed_packages(client, filename, mimetype):
    with client.get(f"/v1/docs/{filename}") as response:
        assert response.status_code == 200
        assert response.mimetype == mimetype
        assert len(response.get_data()) > 0


@pytest.fixture
def development_server(app):
    """The threaded development server (`flask run`, quickstart) on the test's app: its port."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.port
    server.shutdown()


def answer_head(port, path, *headers):
    """The status and the header lines of the answer to GET `path`, as they came on the wire."""
    request = "\r\n".join([f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request.encode())
        # Read to the end: the development server closes once its answer is sent.
        received = b""
        while data := connection.recv(65536):
            received += data
    status_line, *lines = received.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    return int(status_line.split()[1]), lines


@pytest.mark.parametrize(
    "path", ["/v1/docs", "/v1/docs/docs.js", "/v1/docs/docs.css", "/v1/docs/swagger-ui.css"]
)
def test_docs_files_carry_one_date_on_the_development_server(development_server, path):
    # The server writes Date, as gunicorn does (which drops an app's): Werkzeug's send_file, which
    # serves these files, made one of its own, and the development server sent both.
    status, lines = answer_head(development_server, path)
    assert status == 200
    dates = [line for line in lines if line.lower().startswith("date:")]
    assert len(dates) == 1, lines
    # Unchanged since: 304, with one Date too.
    (tag,) = [line.partition(":")[2].strip() for line in lines if line.lower().startswith("etag:")]
    status, lines = answer_head(development_server, path, f"If-None-Match: {tag}")
    assert status == 304
    assert len([line for line in lines if line.lower().startswith("date:")]) == 1, lines


@pytest.mark.parametrize("filename", ["nope.js", "../openapi.py", "..%2Fopenapi.py"])
def test_docs_files_outside_the_folders_are_not_found(client, filename):
    response = client.get(f"/v1/docs/{filename}")
    assert response.status_code == 404
    assert response.get_json()["code"] == "not_found"


@pytest.mark.parametrize("category_id", [b"1.0", b"1e3", b"-188653848.0", b"2E0"])
def test_whole_floats_the_document_warns_of_are_refused(client, auth, count_pets, category_id):
    # JSON Schema's integer admits them; the service does not (categoryId's description says so,
    # and tests/test_contract.py keeps schemathesis from offering them as valid).
    response = client.post(
        "/v1/pets",
        data=b'{"name": "Rex", "categoryId": ' + category_id + b"}",
        headers=auth | {"Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.get_json()["errors"] == {"categoryId": ["Not a valid integer."]}
    assert count_pets() == 0


def test_docs_with_a_trailing_slash_goes_to_the_page_with_a_bare_redirect(client):
    response = client.get("/v1/docs/")
    assert response.status_code == 308
    assert response.headers["Location"] == "/v1/docs"
    assert response.data == b""
    assert "Content-Type" not in response.headers


def test_the_document_lists_the_tags_its_operations_have_and_no_other(document):
    listed = [tag["name"] for tag in document["tags"]]
    assert sorted(listed) == sorted({operation.resource for operation in OPERATIONS})
