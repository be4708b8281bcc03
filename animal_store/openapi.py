"""The OpenAPI document, built from the routes and schemas that serve requests, and its docs page.

apispec's MarshmallowPlugin reads the same marshmallow schemas the views load and dump with, and
the paths and methods come from the app's URL map, so the document cannot drift from the service.
What a route cannot tell (operation ids, which responses and headers it can give) is the data in
OPERATIONS below. The document is built once per app, on first use, and then served as bytes.
"""

import inspect
from email.utils import format_datetime
from pathlib import Path

import click
import flask_swagger_ui
import orjson
from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint, current_app, send_from_directory
from flask.cli import with_appcontext

from animal_store.schemas import (
    INT64_MAX,
    ErrorSchema,
    Int64,
    ListQuerySchema,
    NewPetSchema,
    PetSchema,
)

API_VERSION = "1.0.0"
# Where the API lives on every server; OPENAPI_SERVERS urls must end with it.
BASE_PATH = "/v1"

DOCS_DIR = Path(__file__).parent / "docs"
# Swagger UI's built files, shipped inside the flask-swagger-ui package (only its files are used).
SWAGGER_UI_DIR = Path(flask_swagger_ui.__file__).parent / "dist"
# Only the docs page's own files and Swagger UI may load: nothing from another host, no inline
# script. Swagger UI sets inline styles and uses data: images.
DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)

# Response headers, by component name (the header's own name unless HEADER_NAMES says
# otherwise); operations list the ones each response carries.
HEADERS = {
    "Location": {
        "description": "The absolute URL of the new animal.",
        "required": True,
        "schema": {"type": "string", "format": "uri"},
    },
    "Deprecation": {
        "description": "RFC 9745: getPet is deprecated, since this moment (@ Unix seconds).",
        "required": True,
        "schema": {"type": "string", "pattern": "^@[0-9]+$"},
    },
    "Sunset": {
        "description": "RFC 8594: getPet is removed at this moment (an HTTP date).",
        "required": True,
        "schema": {"type": "string"},
    },
    "Link": {
        "description": 'RFC 8288: what replaces getPet, as rel="successor-version".',
        "required": True,
        "schema": {"type": "string"},
    },
    "WWW-Authenticate": {
        "description": 'RFC 6750: Bearer realm="animal-store", with error="invalid_token" when '
        "a key was sent but is wrong or revoked.",
        "required": True,
        "schema": {"type": "string"},
    },
    "Allow": {
        "description": "The methods the path has.",
        "required": True,
        "schema": {"type": "string"},
    },
    "NextLink": {
        "description": 'RFC 8288: `<absolute URL>; rel="next"`, the next page with the same '
        "`limit` and `status`; absent on the last page. Follow it, do not build the cursor.",
        "schema": {"type": "string"},
    },
    "ETag": {
        "description": "A strong tag of this answer; send it back in `If-None-Match` to get "
        "304 while the answer is unchanged.",
        "required": True,
        "schema": {"type": "string"},
    },
    "Idempotent-Replayed": {
        "description": "`true` when this is the stored answer to an earlier request with the "
        "same `Idempotency-Key`; nothing was created this time.",
        "schema": {"type": "string", "enum": ["true"]},
    },
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "required": True,
        "schema": {"type": "integer", "minimum": 0},
    },
    "RateLimit-Limit": {
        "description": "Requests this API key may make per window (all pets operations "
        "together). Absent when rate limiting is off.",
        "schema": {"type": "integer", "minimum": 0},
    },
    "RateLimit-Remaining": {
        "description": "Requests left in the current window.",
        "schema": {"type": "integer", "minimum": 0},
    },
    "RateLimit-Reset": {
        "description": "Seconds until the current window ends and the count starts again.",
        "schema": {"type": "integer", "minimum": 0},
    },
}
HEADER_NAMES = {"NextLink": "Link"}
# Carried by every answer of a rate-limited operation, errors included, while limiting is on.
RATE_LIMIT_HEADERS = ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset")

# Request headers an operation may take: name -> (JSON schema, description, required).
IF_NONE_MATCH = {
    "If-None-Match": (
        {"type": "string"},
        "ETags of answers the client holds (RFC 9110); a match gets 304 with no body.",
        False,
    )
}
# The header's grammar, as idempotency.py parses it: bare, or a quoted string with \" and \\.
IDEMPOTENCY_KEY_PATTERN = (
    r'^(?:[\x21\x23-\x5b\x5d-\x7e]{1,255}|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\]){1,255}")$'
)
IDEMPOTENCY_KEY = {
    "Idempotency-Key": (
        {"type": "string", "pattern": IDEMPOTENCY_KEY_PATTERN},
        "draft-ietf-httpapi-idempotency-key-header: 1 to 255 printable ASCII characters, as a "
        'quoted string (`"abc"`) or bare (`abc`, no spaces, quotes or backslashes). A retry '
        "with the same key and body gets the first answer again; kept 24 hours per API key.",
        False,
    )
}

# Every error an operation can give, with the error codes behind it and the headers it carries.
ERROR_RESPONSES = {
    400: (
        "A query parameter (a garbled cursor, or one from a walk with another `status`), "
        "the `Idempotency-Key` header or the body is invalid: `validation_error`, `invalid_json`; "
        "the body ended before its `Content-Length` or its chunked framing is broken: "
        "`bad_request`.",
        (),
    ),
    401: ("No API key, or one that is wrong or revoked: `unauthorized`.", ("WWW-Authenticate",)),
    404: ("No animal has this id: `not_found`.", ()),
    405: ("The path does not have this method: `method_not_allowed`.", ("Allow",)),
    409: (
        "A request with this `Idempotency-Key` is still running: `idempotency_key_in_use`.",
        ("Retry-After",),
    ),
    413: ("The body is over the server's limit (64 KiB by default): `payload_too_large`.", ()),
    415: ("The body is not sent as `application/json`: `unsupported_media_type`.", ()),
    422: (
        "This `Idempotency-Key` was used with another body: `idempotency_key_reused`.",
        (),
    ),
    429: (
        "This API key made too many requests in the current window: `too_many_requests`. "
        "Retry after `Retry-After` seconds.",
        ("Retry-After",),
    ),
    500: ("A bug in the service, logged on the server: `internal_error`.", ()),
    503: (
        "The database cannot be reached or written just now: `service_unavailable`. Nothing "
        "was changed; retry after `Retry-After` seconds.",
        ("Retry-After",),
    ),
}
# Answered by routing, before any view is chosen: the operation's own headers are not added.
ROUTING_ERRORS = {405}

# One entry per view (endpoint). To document a new parameter, header or response, add data here:
#   query: the marshmallow schema the view loads request.args with
#   path_parameters: URL variable -> (name in the document, JSON schema, description)
#   request_headers: header name -> (JSON schema, description, required)
#   body: the marshmallow schema the view loads the JSON body with
#   responses: status -> (description, marshmallow schema or None, response header names)
#   links: status -> OpenAPI links from that response to other operations
#   errors: the statuses of ERROR_RESPONSES the operation can answer
#   headers_on_every_response: header names that every response carries, errors included
OPERATIONS = {
    "pets.list_pets": {
        "operationId": "listPets",
        "summary": "List animals",
        "query": ListQuerySchema,
        "request_headers": IF_NONE_MATCH,
        "responses": {
            200: (
                "A page of animals, as a JSON array.",
                PetSchema(many=True),
                ("ETag", "NextLink"),
            ),
            304: ("Unchanged since the `If-None-Match` tag: no body.", None, ("ETag",)),
        },
        "errors": (400, 401, 405, 429, 500, 503),
        "headers_on_every_response": RATE_LIMIT_HEADERS,
    },
    "pets.create_pet": {
        "operationId": "createPet",
        "summary": "Add an animal",
        "body": NewPetSchema,
        "request_headers": IDEMPOTENCY_KEY,
        "responses": {
            201: ("The new animal, with its id.", PetSchema, ("Location", "Idempotent-Replayed"))
        },
        "links": {
            201: {
                "GetPetById": {
                    "operationId": "getPet",
                    "parameters": {"petId": "$response.body#/id"},
                    "description": "The new animal, by the id in the body.",
                }
            }
        },
        "errors": (400, 401, 405, 409, 413, 415, 422, 429, 500, 503),
        "headers_on_every_response": RATE_LIMIT_HEADERS,
    },
    "pets.get_pet": {
        "operationId": "getPet",
        "summary": "Get an animal (deprecated)",
        "deprecated": True,
        "path_parameters": {
            "pet_id": (
                "petId",
                {"type": "integer", "format": "int64", "minimum": 1, "maximum": INT64_MAX},
                "The animal's id. Anything else (text, zero, negative, too large) is 404.",
            )
        },
        "request_headers": IF_NONE_MATCH,
        "responses": {
            200: ("The animal.", PetSchema, ("ETag",)),
            304: ("Unchanged since the `If-None-Match` tag: no body.", None, ("ETag",)),
        },
        "errors": (401, 404, 405, 429, 500, 503),
        "headers_on_every_response": ("Deprecation", "Sunset", "Link", *RATE_LIMIT_HEADERS),
    },
}

bp = Blueprint("openapi", __name__)


@bp.get("/openapi.json")
def openapi_json():
    """Serve the OpenAPI document; it needs no API key."""
    return current_app.response_class(openapi_document(), mimetype="application/json")


@bp.get("/docs")
def docs():
    """Serve the interactive docs page: Swagger UI on the document, nothing from another host."""
    response = send_from_directory(DOCS_DIR, "docs.html")
    response.headers["Content-Security-Policy"] = DOCS_CSP
    return response


@bp.get("/docs/<path:filename>")
def docs_file(filename):
    """Serve the docs page's script and style, and Swagger UI's files."""
    directory = DOCS_DIR if (DOCS_DIR / filename).is_file() else SWAGGER_UI_DIR
    return send_from_directory(directory, filename)


def openapi_document() -> bytes:
    """Return the app's OpenAPI document as JSON, built on first use."""
    cache = current_app.extensions.setdefault("openapi", {})
    if "document" not in cache:
        document = build_spec(current_app).to_dict()
        # "openapi" first, as people and tools expect to read it.
        cache["document"] = orjson.dumps({"openapi": document.pop("openapi"), **document})
    return cache["document"]


def build_spec(app) -> APISpec:
    marshmallow_plugin = MarshmallowPlugin()
    spec = APISpec(
        title="Animal Store",
        version=API_VERSION,
        openapi_version="3.1.0",
        plugins=[marshmallow_plugin],
        info={
            "description": "Manage the animals a store offers. Every operation needs an API key "
            "(`Authorization: Bearer <key>`); every error is one JSON object, `Error`."
        },
        servers=app.config["OPENAPI_SERVERS"],
        security=[{"bearerAuth": []}],
    )
    marshmallow_plugin.map_to_openapi_type(Int64, "integer", "int64")
    spec.components.security_scheme(
        "bearerAuth",
        {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key made with `flask keys create NAME`.",
        },
    )
    spec.components.schema("Error", schema=ErrorSchema)
    for name, header in HEADERS.items():
        spec.components.header(name, header)
    for rule in app.url_map.iter_rules():
        if rule.endpoint in OPERATIONS:
            add_operation(spec, app, rule)
    return spec


def add_operation(spec, app, rule) -> None:
    table = OPERATIONS[rule.endpoint]
    path = rule.rule.removeprefix(BASE_PATH)
    parameters = []
    for variable, (name, schema, description) in table.get("path_parameters", {}).items():
        path = path.replace(f"<{variable}>", f"{{{name}}}")
        parameters.append(
            {"in": "path", "name": name, "required": True, "schema": schema}
            | {"description": description}
        )
    if "query" in table:
        parameters.append({"in": "query", "schema": table["query"]})
    for name, (schema, description, required) in table.get("request_headers", {}).items():
        parameters.append(
            {"in": "header", "name": name, "required": required, "schema": schema}
            | {"description": description}
        )
    operation = {
        "operationId": table["operationId"],
        "summary": table["summary"],
        "description": operation_description(app, rule.endpoint),
        "tags": ["pets"],
        "responses": operation_responses(table),
    }
    if parameters:
        operation["parameters"] = parameters
    if table.get("deprecated"):
        operation["deprecated"] = True
    if "body" in table:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": table["body"]}},
        }
    for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
        spec.path(path=path, operations={method.lower(): operation})


def operation_description(app, endpoint) -> str:
    description = inspect.getdoc(app.view_functions[endpoint]) or ""
    if OPERATIONS[endpoint].get("deprecated"):
        deprecation = app.config["GET_PET_DEPRECATION"]
        description += (
            f"\n\nDeprecated since {deprecation['since']:%Y-%m-%d}; removed on "
            f"{deprecation['sunset']:%Y-%m-%d} (`Sunset: "
            f"{format_datetime(deprecation['sunset'], usegmt=True)}`). "
            f"Use `GET {deprecation['successor']}` (listPets) with the `status` filter instead."
        )
    return description


def operation_responses(table) -> dict:
    every_response = tuple(table.get("headers_on_every_response", ()))
    responses = {}
    for status, (description, schema, headers) in table["responses"].items():
        responses[str(status)] = response_object(description, schema, headers + every_response)
        if status in table.get("links", {}):
            responses[str(status)]["links"] = table["links"][status]
    for status in table["errors"]:
        description, headers = ERROR_RESPONSES[status]
        if status not in ROUTING_ERRORS:
            headers += every_response
        responses[str(status)] = response_object(description, ErrorSchema, headers)
    return responses


def response_object(description, schema, headers) -> dict:
    response = {"description": description}
    if headers:
        response["headers"] = {HEADER_NAMES.get(name, name): name for name in headers}
    if schema is not None:
        response["content"] = {"application/json": {"schema": schema}}
    return response


def check_servers(servers) -> None:
    for server in servers:
        if not server["url"].endswith(BASE_PATH):
            raise RuntimeError(f"OPENAPI_SERVERS: {server['url']!r} must end with {BASE_PATH}.")


@click.command("openapi")
@with_appcontext
def print_openapi():
    """Print the OpenAPI document (JSON), for generating clients."""
    click.echo(orjson.dumps(orjson.loads(openapi_document()), option=orjson.OPT_INDENT_2))


def register_openapi(app):
    check_servers(app.config["OPENAPI_SERVERS"])
    app.register_blueprint(bp, url_prefix=BASE_PATH)
    app.cli.add_command(print_openapi)
