"""The OpenAPI document: flask-smorest's Api and plugin set up for /v1, and the hook that adds to
each operation what the layer gives it."""

from collections.abc import Iterable, Mapping
from dataclasses import replace
from email.utils import format_datetime
from typing import Any, cast

import flask_smorest
import flask_smorest.spec.plugins
from apispec import APISpec
from apispec.ext.marshmallow.openapi import OpenAPIConverter
from flask import Flask
from flask_smorest.spec.plugins import RE_URL
from marshmallow import fields
from werkzeug.routing import Rule

from animal_store import errors
from animal_store.api.declarations import OperationDoc
from animal_store.api.headers import DEPRECATION_HEADERS, ERROR_HEADERS, RATE_LIMIT_HEADERS, Header
from animal_store.api.policies import SCOPE_OF_METHOD, WRITE_SCOPE
from animal_store.contract import BASE_PATH
from animal_store.schemas import EnumField, ErrorSchema, Int64
from animal_store.settings_schema import Deprecation

API_VERSION = "1.0.0"

# Every operation of the layer can give these, besides the errors its view declares.
LAYER_ERRORS = (
    errors.UNAUTHORIZED,
    errors.INVALID_KEY,
    errors.MISSING_SCOPE,
    errors.METHOD_NOT_ALLOWED,
    errors.TOO_MANY_REQUESTS,
    errors.TOO_MANY_AUTH_FAILURES,
    errors.INTERNAL_ERROR,
    errors.DATABASE_UNAVAILABLE,
    errors.DATABASE_READ_ONLY,
    errors.DATABASE_LOGIN_REFUSED,
    errors.DATABASE_FULL,
)
# Answered by routing, before any view is chosen: the operation's own headers are not added.
ROUTING_ERRORS = {405}


class FlaskPlugin(flask_smorest.spec.plugins.FlaskPlugin):
    """Paths relative to the servers' base path (/v1), and path variables named as on the wire.

    A path variable is snake_case in Python (`pet_id`) and camelCase in the document (`petId`),
    as the body's fields are (`category_id`, `categoryId`).
    """

    def __init__(self, base_path: str) -> None:
        super().__init__()
        self.base_path = base_path

    def flaskpath2openapi(self, path: str) -> str:
        return RE_URL.sub(
            lambda match: f"{{{camel_case(match[1])}}}", path.removeprefix(self.base_path)
        )

    def rule_to_params(self, rule: Rule) -> list[dict[str, Any]]:
        return [
            {**param, "name": camel_case(param["name"])} for param in super().rule_to_params(rule)
        ]


def camel_case(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


class Api(flask_smorest.Api):
    """flask-smorest's Api with our error answers, and no error responses of its own."""

    DEFAULT_ERROR_RESPONSE_NAME = None
    ERROR_SCHEMA = ErrorSchema

    def _register_error_handlers(self) -> None:
        errors.register_error_handlers(self._app)

    def _register_pagination_header(self) -> None:
        # Our pages are walked with Link headers (pagination.py), not flask-smorest's pagination:
        # its header would bring a schema of its own into the document.
        pass


def make_api(app: Flask, base_path: str) -> Api:
    """Make the app's flask-smorest Api, whose document describes the paths under base_path."""
    api = Api(
        app,
        spec_kwargs={
            "title": "Animal Store",
            "version": API_VERSION,
            "openapi_version": "3.1.0",
            "info": {
                "description": "Manage the animals a store offers. Every operation needs an API "
                "key (`Authorization: Bearer <key>`); every error is one JSON object, `Error`."
            },
            "servers": app.config["OPENAPI_SERVERS"],
            "security": [{"bearerAuth": []}],
            "flask_plugin": FlaskPlugin(base_path),
        },
    )
    api.register_field(Int64, "integer", "int64")
    # Its type is in its component: the field itself is only the reference (enum_reference).
    api.register_field(EnumField, None, None)
    # Made when the Api was given its app, just above.
    cast(OpenAPIConverter, api.ma_plugin.converter).add_attribute_function(enum_reference)
    api.spec.components.security_scheme(
        "bearerAuth",
        {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key made with `flask keys create NAME`.",
        },
    )
    for enum in EnumField.__subclasses__():
        api.spec.components.schema(enum.component, enum.component_schema())
    return api


def enum_reference(
    self: OpenAPIConverter, field: fields.Field[Any], **kwargs: Any
) -> dict[str, Any]:
    # An enum field is its one schema component, so generated clients have one type for it.
    if isinstance(field, EnumField):
        return {"$ref": f"#/components/schemas/{field.component}"}
    return {}


def document_layer(
    doc: dict[str, Any],
    doc_info: OperationDoc,
    *,
    app: Flask,
    spec: APISpec,
    method: str,
    **kwargs: Any,
) -> dict[str, Any]:
    """Add to an operation what the layer gives it, and the errors and headers it declared."""
    public_view = doc_info.get("public", False)
    if public_view:
        doc["security"] = []
    else:
        # OpenAPI 3.1 lets a bearer scheme list the roles an operation needs: here its scope.
        doc["security"] = [{"bearerAuth": [SCOPE_OF_METHOD.get(method.upper(), WRITE_SCOPE)]}]
    shared = [] if public_view else list(RATE_LIMIT_HEADERS)
    if setting := doc_info.get("deprecation"):
        shared = [*DEPRECATION_HEADERS, *shared]
        doc["deprecated"] = True
        docstring = doc_info["docstring"]
        notes = (docstring.get("description"), deprecation_note(app.config[setting]))
        docstring["description"] = "\n\n".join(note for note in notes if note)
    responses = doc.setdefault("responses", {})
    for status, response in responses.items():
        if int(status) < 400:
            headers = response.setdefault("headers", {})
            headers.update({header.name: header for header in shared})
            response["headers"] = header_references(spec, headers, doc_info)
    kinds = dict.fromkeys([*doc_info.get("errors", []), *(() if public_view else LAYER_ERRORS)])
    for status in sorted({kind.status for kind in kinds}):
        of_status = [kind for kind in kinds if kind.status == status]
        headers = {name: ERROR_HEADERS[name] for kind in of_status for name in kind.headers}
        # A header only some kinds of this status send (Retry-After of an Idempotency-Key in
        # use, beside a 409 for a duplicate) is not required of every answer with it.
        headers = {
            name: header
            if all(name in kind.headers for kind in of_status)
            else replace(header, required=False, component=f"Optional{header.name}")
            for name, header in headers.items()
        }
        if status not in ROUTING_ERRORS:
            headers.update({header.name: header for header in shared})
        response = {
            "description": error_description(of_status),
            "content": {"application/json": {"schema": "Error"}},
        }
        if headers:
            response["headers"] = header_references(spec, headers, doc_info)
        responses[status] = response
    return doc


def error_description(kinds: Iterable[errors.ErrorKind]) -> str:
    codes: dict[str, list[str]] = {}
    for kind in kinds:
        codes.setdefault(kind.code, []).append(kind.when.rstrip("."))
    return " ".join(f"`{code}`: {'; '.join(whens)}." for code, whens in codes.items())


def header_references(
    spec: APISpec, headers: Mapping[str, Header | dict[str, Any]], doc_info: OperationDoc
) -> dict[str, str | dict[str, Any]]:
    """Register each Header as a component (once) and refer to it by its component name.

    Headers with the same name and the same description share one component. One whose
    description differs from the component already registered under its name gets one of its
    own, named for its resource (`CategoriesLocation`) or else its operation
    (`CreateCategoryLocation`): the first one registered never describes another's header.
    """
    references: dict[str, str | dict[str, Any]] = {}
    for name, header in headers.items():
        if not isinstance(header, Header):
            references[name] = header
            continue
        references[name] = header_component(spec, header, doc_info)
    return references


def header_component(spec: APISpec, header: Header, doc_info: OperationDoc) -> str:
    described = header.spec()
    base = header.component or header.name
    operation_id = doc_info.get("manual_doc", {}).get("operationId")
    candidates = [base]
    if "resource" in doc_info:
        candidates.append(pascal_case(doc_info["resource"]) + base)
    if operation_id:
        candidates.append(pascal_case(operation_id) + base)
    for component in candidates:
        registered = spec.components.headers.get(component)
        if registered is None:
            spec.components.header(component, described)
            return component
        if registered == described:
            return component
    raise ValueError(
        f"The {header.name} header of {operation_id} needs a component name "
        f"of its own: {', '.join(candidates)} describe other headers (Header(component=...))."
    )


def pascal_case(name: str) -> str:
    return "".join(word[:1].upper() + word[1:] for word in name.replace("-", "_").split("_"))


def deprecation_note(deprecation: "Deprecation") -> str:
    return (
        f"Deprecated since {deprecation['since']:%Y-%m-%d}; removed on "
        f"{deprecation['sunset']:%Y-%m-%d} (`Sunset: "
        f"{format_datetime(deprecation['sunset'], usegmt=True)}`). "
        f"Use `GET {deprecation['successor']}` (listPets) with the `status` filter instead."
    )


def declared_query_parameters(app: Flask) -> dict[str, frozenset[str]]:
    """Return, by endpoint, the names of the query parameters its operations declare, read from
    the document the app serves: the one list of what the service defines (the request log
    writes these values alone; tests/test_deploy.py holds nginx's log format to it)."""
    api: Api = app.extensions["flask-smorest"]["apis"][""]["ext_obj"]
    paths = api.spec.to_dict()["paths"]
    to_path = FlaskPlugin(BASE_PATH).flaskpath2openapi
    declared: dict[str, frozenset[str]] = {}
    for rule in app.url_map.iter_rules():
        operations = paths.get(to_path(rule.rule), {})
        names = {
            parameter["name"]
            for method in rule.methods or ()
            for parameter in operations.get(method.lower(), {}).get("parameters", [])
            if parameter["in"] == "query"
        }
        declared[rule.endpoint] = declared.get(rule.endpoint, frozenset()) | names
    return declared
