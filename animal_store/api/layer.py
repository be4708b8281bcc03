"""The /v1 layer put together: the resources registered under it, its policies hooked on, and
the document built."""

from collections.abc import Callable, Iterable

import flask
from flask import Response
from flask_cors import CORS

from animal_store.access import rate_limits
from animal_store.access.auth_failures import init_auth_failures
from animal_store.api.declarations import Blueprint
from animal_store.api.document import document_layer, make_api
from animal_store.api.policies import Policies
from animal_store.contract import BASE_PATH

# Where the API lives on every server; OPENAPI_SERVERS urls must end with it.
LAYER = "v1"


def register_api(
    app: flask.Flask,
    resources: Iterable[flask.Blueprint],
    before: Iterable[Callable[[], Response | None]] = (),
) -> Policies:
    """Serve the resources under /v1 with everything the layer gives, and build the document;
    return the layer's policies. The `before` steps run first on each of the layer's requests."""
    api = make_api(app, BASE_PATH)
    policies = Policies(rate_limits.init_rate_limits(app), LAYER)
    init_auth_failures(app, policies.limiter)
    layer = Blueprint(LAYER, __name__, url_prefix=BASE_PATH)
    steps = (*before, policies.admit)

    def before_request() -> Response | None:
        # One hook for the layer's steps, not one each: Flask's dispatch of a hook costs more
        # than a step that returns at once.
        for step in steps:
            answer = step()
            if answer is not None:
                return answer
        return None

    layer.before_request(before_request)
    layer.after_request(policies.add_headers)
    layer._prepare_doc_cbks.append(document_layer)
    for resource in resources:
        layer.register_blueprint(resource)
    api.register_blueprint(layer)
    policies.collect(app)
    if app.config["CORS_ORIGINS"]:
        # The answers' CORS headers, for the origins listed; with none (the default), there is
        # nothing to add, and no hook runs on every request to find that out.
        CORS(app, resources={f"{BASE_PATH}/*": {}}, methods=layer_methods(app))
    return policies


def layer_methods(app: flask.Flask) -> list[str]:
    """The methods the layer's routes allow, all of them together: what a page may use.

    Derived, so a new operation is reachable from browsers as soon as it is registered; a
    preflight for a method its path lacks is allowed, and the request then gets 405 with Allow.
    """
    methods: set[str] = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint.startswith(f"{LAYER}."):
            methods |= rule.methods or set()
    return sorted(methods)
