"""What an app declares, read from the app itself: its routes (the URL map), its operations (the
views of its flask-smorest resources, with what each view declares beside it) and where each
one is in the document it serves.

Tests parametrize over these instead of listing operations, paths, Allow values, scopes or
statuses, so an operation added to the app is tested by them with no edit here or there. What
the contract itself fixes is written out in tests/test_contract.py, once.
"""

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import flask_smorest
from marshmallow import Schema

from animal_store import create_app

DOCUMENT_PATH = "/v1/openapi.json"
# What the API layer adds to the statuses of every operation that needs a key, besides what its
# view declares (docs/api.rst, The served OpenAPI document): a change to the layer changes this.
LAYER_STATUSES = frozenset({401, 403, 405, 429, 500, 503})
# Methods a client may send; a path answers 405 to those its routes do not have.
HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
VARIABLE = re.compile(r"<[^>]*>")


def sample_url(rule: str) -> str:
    """A URL the rule matches, with 1 for each of its variables."""
    return VARIABLE.sub("1", rule)


def path_shape(path: str) -> str:
    """A path with its variables blanked, Werkzeug's (<pet_id>) and OpenAPI's ({petId}) alike."""
    return re.sub(r"\{[^}]*\}", "{}", VARIABLE.sub("{}", path))


@dataclass(frozen=True, eq=False)
class Operation:
    """A route of a documented resource, with what its view declares and what the document says
    of it (None when the document leaves it out)."""

    method: str
    rule: str
    endpoint: str
    declared: dict
    path: str | None
    documented: dict | None

    def __str__(self) -> str:
        return f"{self.method} {self.rule}"

    @property
    def url(self) -> str:
        return sample_url(self.rule)

    @property
    def operation_id(self) -> str | None:
        return self.declared.get("manual_doc", {}).get("operationId")

    @property
    def resource(self) -> str:
        """The name of the resource (blueprint) the view belongs to."""
        return self.endpoint.split(".")[-2]

    @property
    def public(self) -> bool:
        return self.declared.get("public", False)

    @property
    def deprecated(self) -> bool:
        return "deprecation" in self.declared

    @property
    def error_kinds(self) -> list:
        return self.declared.get("errors", [])

    @property
    def statuses(self) -> set[int]:
        """Every status the operation can answer: its view's answers and errors, and the layer's."""
        answers = set(self.declared.get("response", {}).get("responses", {}))
        errors = {kind.status for kind in self.error_kinds}
        return answers | errors | (set() if self.public else set(LAYER_STATUSES))

    @property
    def scope(self) -> str | None:
        """The scope the document says a key needs for the operation; None when it needs no key."""
        if not self.documented["security"]:
            return None
        (requirement,) = self.documented["security"]  # one scheme, bearerAuth
        ((scope,),) = requirement.values()
        return scope


def document(app) -> dict:
    response = app.test_client().get(DOCUMENT_PATH)
    assert response.status_code == 200, response.status
    return response.get_json()


def base_path(served: dict) -> str:
    """The path every server of the document lists its operations under (/v1)."""
    (path,) = {urlsplit(server["url"]).path for server in served["servers"]}
    return path


def operations(app) -> list[Operation]:
    """Every route of the app's documented resources (flask-smorest blueprints), one per method."""
    served = document(app)
    base = base_path(served)
    documented = {
        (method.upper(), path_shape(path)): (path, operation)
        for path, methods in served["paths"].items()
        for method, operation in methods.items()
        if method != "parameters"
    }
    found = []
    for rule in app.url_map.iter_rules():
        blueprint = app.blueprints.get(rule.endpoint.rpartition(".")[0])
        if not isinstance(blueprint, flask_smorest.Blueprint):
            continue
        # flask-smorest's declarations of the view, and the API layer's beside them (public,
        # errors, deprecation): what the layer builds the document and its policies from.
        declared = getattr(app.view_functions[rule.endpoint], "_apidoc", {})
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            path, operation = documented.get(
                (method, path_shape(rule.rule.removeprefix(base))), (None, None)
            )
            found.append(Operation(method, rule.rule, rule.endpoint, declared, path, operation))
    return found


def allowed_methods(app) -> dict[str, set[str]]:
    """The methods each path of the app has, by its rule: what its routes declare together."""
    methods: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        methods.setdefault(rule.rule, set()).update(rule.methods)
    return methods


def declared_fields(operation: Operation, served: dict):
    """Yield (field, its schema in the document) for each field of each marshmallow schema the
    operation's view declares it loads (query, body) or dumps (answers)."""
    documented = operation.documented
    for parameter in operation.declared.get("arguments", {}).get("parameters", []):
        schema = parameter.get("schema")
        if not isinstance(schema, Schema):
            continue
        if parameter["in"] == "query":
            nodes = {p["name"]: p["schema"] for p in documented["parameters"] if p["in"] == "query"}
        else:
            body = documented["requestBody"]["content"]["application/json"]["schema"]
            nodes = resolve(served, body)["properties"]
        for name, field in schema.load_fields.items():
            yield field, nodes[field.data_key or name]
    for status, answers in operation.declared.get("response", {}).get("responses", {}).items():
        for answer in answers:
            schema = answer.get("schema")
            if not isinstance(schema, Schema):
                continue
            body = documented["responses"][str(status)]["content"]["application/json"]["schema"]
            if schema.many:
                body = body["items"]
            nodes = resolve(served, body)["properties"]
            for name, field in schema.dump_fields.items():
                yield field, nodes[field.data_key or name]


def resolve(served: dict, schema: dict) -> dict:
    if "$ref" not in schema:
        return schema
    return served["components"]["schemas"][schema["$ref"].rpartition("/")[2]]


# Built once, at collection, to parametrize tests: routes and declarations are the same for every
# app the factory makes, whatever its database and settings.
APP = create_app({"TESTING": True, "DATABASE_URL": "sqlite://"})
OPERATIONS = operations(APP)
PROTECTED = [operation for operation in OPERATIONS if not operation.public]
PATHS = allowed_methods(APP)
BASE_PATH = base_path(document(APP))
LAYER_PATHS = {rule: methods for rule, methods in PATHS.items() if rule.startswith(f"{BASE_PATH}/")}
# Each method a path does not have: what a client may send it and get 405.
REFUSED = [
    (rule, method)
    for rule, methods in PATHS.items()
    for method in HTTP_METHODS
    if method not in methods
]
