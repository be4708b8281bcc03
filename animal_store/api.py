"""The /v1 API layer: what every operation shares, attached once, and the OpenAPI document.

A resource is a `Blueprint` (flask-smorest's, below) whose views declare their own contract beside
them: `arguments`, `response`, `alt_response` and `doc` from flask-smorest, plus `errors(...)`
(kinds of the error catalogue) and `deprecated(...)`. `register_api` registers each resource under
the /v1 layer, which gives all of its views, with no wiring of their own:

- authentication with an API key, unless the view is marked `@public`; OPTIONS never needs one;
- CORS for the origins CORS_ORIGINS lists (Flask-CORS);
- rate limits (rate_limits.py) and `Cache-Control: no-store` on the same views;
- the deprecation headers of a view declared deprecated, on all of its answers;
- error answers as the error object (errors.py handles every error of the app);
- their place in the OpenAPI document, with the answers every operation shares (401, 405, 429,
  500, 503, the RateLimit-* headers) added to what each view declares.
"""

import threading
from copy import deepcopy
from dataclasses import asdict, dataclass
from email.utils import format_datetime

import flask
import flask_smorest
import flask_smorest.spec.plugins
import flask_smorest.utils
from cachetools import LRUCache
from flask import current_app, g, request
from flask_cors import CORS
from flask_smorest.spec.plugins import RE_URL
from webargs.flaskparser import FlaskParser

from animal_store import errors, rate_limits
from animal_store.auth import authenticate
from animal_store.auth_failures import init_auth_failures
from animal_store.body import BODY_ERRORS, json_object_body
from animal_store.schemas import EnumField, ErrorSchema, Int64

API_VERSION = "1.0.0"
# Where the API lives on every server; OPENAPI_SERVERS urls must end with it.
BASE_PATH = "/v1"
LAYER = "v1"


@dataclass(frozen=True)
class Header:
    """A response header as the document describes it: declared where the header is set."""

    name: str
    description: str
    schema: dict
    required: bool = False
    # Its name among the document's header components, when two headers share a name.
    component: str | None = None

    def spec(self) -> dict:
        return {
            key: value for key, value in asdict(self).items() if key not in ("name", "component")
        }


WWW_AUTHENTICATE = Header(
    "WWW-Authenticate",
    'RFC 6750: Bearer realm="animal-store", with error="invalid_token" when a key was sent '
    "but is wrong or revoked.",
    {"type": "string"},
    required=True,
)
ALLOW = Header("Allow", "The methods the path has.", {"type": "string"}, required=True)
RETRY_AFTER = Header(
    "Retry-After",
    "Seconds to wait before retrying.",
    {"type": "integer", "minimum": 0},
    required=True,
)
RATE_LIMIT_HEADERS = (
    Header(
        "RateLimit-Limit",
        "Requests this API key may make per window (all operations together). Absent when "
        "rate limiting is off.",
        {"type": "integer", "minimum": 0},
    ),
    Header(
        "RateLimit-Remaining",
        "Requests left in the current window.",
        {"type": "integer", "minimum": 0},
    ),
    Header(
        "RateLimit-Reset",
        "Seconds until the current window ends and the count starts again.",
        {"type": "integer", "minimum": 0},
    ),
)
DEPRECATION_HEADERS = (
    Header(
        "Deprecation",
        "RFC 9745: this operation is deprecated, since this moment (@ Unix seconds).",
        {"type": "string", "pattern": "^@[0-9]+$"},
        required=True,
    ),
    Header(
        "Sunset",
        "RFC 8594: this operation is removed at this moment (an HTTP date).",
        {"type": "string"},
        required=True,
    ),
    Header(
        "Link",
        'RFC 8288: what replaces this operation, as rel="successor-version".',
        {"type": "string"},
        required=True,
    ),
)
# The headers the catalogue's kinds name (errors.ErrorKind.headers).
ERROR_HEADERS = {header.name: header for header in (WWW_AUTHENTICATE, ALLOW, RETRY_AFTER)}

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
)
# Answered by routing, before any view is chosen: the operation's own headers are not added.
ROUTING_ERRORS = {405}
# The scope an API key needs for an operation, by its method: reads need `read`, the rest
# `write` (auth.SCOPES).
SCOPE_OF_METHOD = {"GET": "read", "HEAD": "read"}
WRITE_SCOPE = "write"


class ArgumentsParser(FlaskParser):
    """webargs' parser with the API's answers: 400 validation_error, and the JSON body rules."""

    DEFAULT_VALIDATION_STATUS = 400
    LOCATION_NAMES = {"query": "query parameter", "json": "request body", "headers": "header"}
    # Query strings whose arguments a worker remembers, least recently used dropped first.
    KNOWN_QUERIES = 1024

    def __init__(self):
        super().__init__()
        self.queries = LRUCache(self.KNOWN_QUERIES)
        # The development server serves each request on a thread of its own.
        self.lock = threading.Lock()

    def parse(self, argmap, req=None, *, location=None, **kwargs):
        """Parse as webargs does; a query's arguments, a function of its text alone, only the
        first time a worker sees that text (a walk's pages and a client's polls repeat theirs)."""
        if location != "query":
            return super().parse(argmap, req, location=location, **kwargs)
        key = (id(argmap), (req or request).query_string)  # a schema lives as long as its view
        with self.lock:
            parsed = self.queries.get(key)
        if parsed is None:  # not remembered, or refused: a 400 is never remembered
            parsed = super().parse(argmap, req, location=location, **kwargs)
            with self.lock:
                self.queries[key] = parsed
        return dict(parsed)  # the view's own copy

    def load_querystring(self, req, schema):
        # The query as Werkzeug parsed it, whose get() is a parameter's first value: what a
        # schema of single-valued fields reads, without webargs' per-request proxy around it.
        return req.args

    def load_json(self, req, schema):
        return json_object_body()

    def handle_error(self, error, req, schema, *, error_status_code, error_headers):
        # webargs files the messages under the location they come from.
        ((location, messages),) = error.messages.items()
        raise errors.VALIDATION_ERROR(
            errors=messages,
            where=self.LOCATION_NAMES[location],
            fields=", ".join(sorted(messages)),
        )


class Blueprint(flask_smorest.Blueprint):
    """A flask-smorest Blueprint that also declares errors and deprecation, and nests resources."""

    ARGUMENTS_PARSER = ArgumentsParser()

    @staticmethod
    def errors(*kinds: errors.ErrorKind):
        """Declare the kinds of the catalogue this view answers, besides the layer's own."""

        def decorator(view):
            return declare_errors(view, *kinds)

        return decorator

    def arguments(self, schema, *, location="json", **kwargs):
        """flask-smorest's arguments, declaring the errors that loading them can answer."""
        load = super().arguments(schema, location=location, **kwargs)
        kinds = (errors.VALIDATION_ERROR, *(BODY_ERRORS if location == "json" else ()))
        return lambda view: declare_errors(load(view), *kinds)

    @staticmethod
    def doc(**kwargs):
        """flask-smorest's doc, as a declaration only: no wrapper around the view per request."""

        def decorator(view):
            manual = view_doc(view).get("manual_doc", {})
            return declare(
                view, "manual_doc", flask_smorest.utils.deepupdate(deepcopy(manual), kwargs)
            )

        return decorator

    @staticmethod
    def deprecated(setting: str):
        """Declare the view deprecated; app.config[setting] has its since, sunset and successor."""

        def decorator(view):
            return declare(view, "deprecation", setting)

        return decorator

    def register_blueprint(self, blueprint, **options):
        """Nest a resource; its operations are tagged with its name in the document."""
        for endpoint_doc in getattr(blueprint, "_docs", {}).values():
            for method_doc in endpoint_doc.values():
                if isinstance(method_doc, dict) and method_doc.get("tags") is None:
                    method_doc["tags"] = [options.get("name", blueprint.name)]
        if not isinstance(blueprint, flask_smorest.Blueprint):
            # A plain Flask blueprint (the document and docs page): served, not documented.
            return flask.Blueprint.register_blueprint(self, blueprint, **options)
        return super().register_blueprint(blueprint, **options)


class FlaskPlugin(flask_smorest.spec.plugins.FlaskPlugin):
    """Paths relative to the servers' /v1, and path variables named as on the wire.

    A path variable is snake_case in Python (`pet_id`) and camelCase in the document (`petId`),
    as the body's fields are (`category_id`, `categoryId`).
    """

    @staticmethod
    def flaskpath2openapi(path):
        return RE_URL.sub(lambda match: f"{{{camel_case(match[1])}}}", path.removeprefix(BASE_PATH))

    def rule_to_params(self, rule):
        return [
            {**param, "name": camel_case(param["name"])} for param in super().rule_to_params(rule)
        ]


def camel_case(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def view_doc(view) -> dict:
    """Return what has been declared of a view: flask-smorest's entries and ours."""
    return getattr(view, "_apidoc", {})


def declare(view, key, value):
    """Add a declaration to a view, beside flask-smorest's, and return the view.

    No wrapper, so a declaration costs nothing per request. A copy, as flask-smorest makes: a
    wrapper shares its wrapped function's declarations until it declares something of its own.
    """
    view._apidoc = {**deepcopy(view_doc(view)), key: value}
    return view


def declare_errors(view, *kinds: errors.ErrorKind):
    return declare(view, "errors", [*view_doc(view).get("errors", []), *kinds])


def declare_parameter(view, parameter: dict):
    """Declare a request parameter the view reads itself (a header), beside its arguments."""
    arguments = deepcopy(view_doc(view).get("arguments", {}))
    arguments.setdefault("parameters", []).append(parameter)
    return declare(view, "arguments", arguments)


def declare_response(view, status: int, response: dict):
    """Declare (part of) an answer of the view: merged with what others declare for the status."""
    answers = deepcopy(view_doc(view).get("response", {}))
    answers.setdefault("responses", {}).setdefault(status, []).append(
        {"content_type": None, **response}
    )
    return declare(view, "response", answers)


def public(view):
    """Mark a view of the layer as open to requests without an API key."""
    return declare(view, "public", True)


class Policies:
    """The layer's per-request policies, from what its views declared, read once at start-up.

    Sets and dicts by endpoint, filled in once the views are registered (collect()): a request
    then costs one look-up, not a walk through its view's declarations.
    """

    def __init__(self, limiter: rate_limits.RateLimiter):
        self.limiter = limiter
        self.protected = frozenset()
        self.vary_origin = False
        self.deprecated = {}

    def collect(self, app) -> None:
        views = {
            endpoint: view_doc(view)
            for endpoint, view in app.view_functions.items()
            if endpoint.startswith(f"{LAYER}.")
        }
        self.protected = frozenset(e for e, doc in views.items() if not doc.get("public"))
        # Answers to listed origins carry CORS headers and others' do not: caches must know.
        self.vary_origin = bool(app.config["CORS_ORIGINS"])
        self.deprecated = {
            endpoint: deprecation_headers(app.config[doc["deprecation"]])
            for endpoint, doc in views.items()
            if "deprecation" in doc
        }

    def requires_key(self) -> bool:
        """Tell whether this request is for a view of the layer that only key holders may use."""
        return request.endpoint in self.protected and request.method != "OPTIONS"

    def admit(self):
        """Answer OPTIONS, which never needs a key; check the key of a request that does, then
        count the request against the key's rate limit.

        Checked first, then counted: a request without a valid key counts against no key's
        budget, only against its address's failures (auth_failures.py). A hook of the layer's
        blueprint: it runs for the layer's views only.
        """
        if request.method == "OPTIONS":
            # A browser's CORS preflight never carries a key: 204 with Allow, and Flask-CORS adds
            # its headers for a listed origin.
            response = current_app.make_default_options_response()
            response.status_code = 204
            del response.headers["Content-Type"]  # no content, no type
            return response
        if request.endpoint in self.protected:
            key = authenticate(SCOPE_OF_METHOD.get(request.method, WRITE_SCOPE))
            g.rate_limit_window = rate_limits.count_request(
                self.limiter, key.budget, key.rate_limit
            )
        return None

    def add_headers(self, response):
        """Give every answer of a counted request the RateLimit-* headers, and of a deprecated
        view the deprecation headers, errors included (RFC 9745, RFC 8594); say that answers vary
        by Origin while CORS origins are listed."""
        window = g.get("rate_limit_window")
        if window is not None:
            # Added, not set: no answer of a counted request has them yet (a 429 has no window),
            # and a set searches the headers for each one first.
            response.headers.extend(window.headers())
        headers = self.deprecated.get(request.endpoint)
        if headers is not None:
            # Added too: the successor's Link goes beside any Link of the view's own (a next
            # page), never in its place.
            response.headers.extend(headers)
        if self.vary_origin:
            response.vary.add("Origin")
        return response


def deprecation_headers(deprecation) -> dict:
    return {
        "Deprecation": f"@{int(deprecation['since'].timestamp())}",
        "Sunset": format_datetime(deprecation["sunset"], usegmt=True),
        "Link": f'<{deprecation["successor"]}>; rel="successor-version"',
    }


class Api(flask_smorest.Api):
    """flask-smorest's Api with our error answers, and no error responses of its own."""

    DEFAULT_ERROR_RESPONSE_NAME = None
    ERROR_SCHEMA = ErrorSchema

    def _register_error_handlers(self):
        errors.register_error_handlers(self._app)

    def _register_pagination_header(self):
        # Our pages are walked with Link headers (pagination.py), not flask-smorest's pagination:
        # its header would bring a schema of its own into the document.
        pass


def register_api(app, resources) -> Policies:
    """Serve the resources under /v1 with everything the layer gives, and build the document;
    return the layer's policies."""
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
            "flask_plugin": FlaskPlugin(),
        },
    )
    api.register_field(Int64, "integer", "int64")
    # Its type is in its component: the field itself is only the reference (enum_reference).
    api.register_field(EnumField, None, None)
    api.ma_plugin.converter.add_attribute_function(enum_reference)
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

    policies = Policies(rate_limits.init_rate_limits(app))
    init_auth_failures(app, policies.limiter)
    layer = Blueprint(LAYER, __name__, url_prefix=BASE_PATH)
    layer.before_request(policies.admit)
    layer.after_request(policies.add_headers)
    layer._prepare_doc_cbks.append(document_layer)
    for resource in resources:
        layer.register_blueprint(resource)
    api.register_blueprint(layer)
    policies.collect(app)
    if app.config["CORS_ORIGINS"]:
        # The answers' CORS headers, for the origins listed; with none (the default), there is
        # nothing to add, and no hook runs on every request to find that out.
        CORS(app, resources={f"{BASE_PATH}/*": {}})
    return policies


def enum_reference(self, field, **kwargs) -> dict:
    # An enum field is its one schema component, so generated clients have one type for it.
    if isinstance(field, EnumField):
        return {"$ref": f"#/components/schemas/{field.component}"}
    return {}


def document_layer(doc, doc_info, *, app, spec, method, **kwargs) -> dict:
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
            response["headers"] = header_references(spec, headers)
    kinds = dict.fromkeys([*doc_info.get("errors", []), *(() if public_view else LAYER_ERRORS)])
    for status in sorted({kind.status for kind in kinds}):
        of_status = [kind for kind in kinds if kind.status == status]
        headers = {name: ERROR_HEADERS[name] for kind in of_status for name in kind.headers}
        if status not in ROUTING_ERRORS:
            headers.update({header.name: header for header in shared})
        response = {
            "description": error_description(of_status),
            "content": {"application/json": {"schema": "Error"}},
        }
        if headers:
            response["headers"] = header_references(spec, headers)
        responses[status] = response
    return doc


def error_description(kinds) -> str:
    codes = {}
    for kind in kinds:
        codes.setdefault(kind.code, []).append(kind.when.rstrip("."))
    return " ".join(f"`{code}`: {'; '.join(whens)}." for code, whens in codes.items())


def header_references(spec, headers: dict) -> dict:
    """Register each Header as a component (once) and refer to it by its component name."""
    references = {}
    for name, header in headers.items():
        if not isinstance(header, Header):
            references[name] = header
            continue
        component = header.component or header.name
        if component not in spec.components.headers:
            spec.components.header(component, header.spec())
        references[name] = component
    return references


def deprecation_note(deprecation) -> str:
    return (
        f"Deprecated since {deprecation['since']:%Y-%m-%d}; removed on "
        f"{deprecation['sunset']:%Y-%m-%d} (`Sunset: "
        f"{format_datetime(deprecation['sunset'], usegmt=True)}`). "
        f"Use `GET {deprecation['successor']}` (listPets) with the `status` filter instead."
    )
