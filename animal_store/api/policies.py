"""The layer's per-request policies: OPTIONS, the key and its scope, the rate limit, and the
headers every answer of the layer gets."""

from email.utils import format_datetime

from flask import Flask, Response, current_app

from animal_store.access import rate_limits
from animal_store.access.auth import authenticate
from animal_store.api.declarations import view_doc
from animal_store.current import REQUEST, G
from animal_store.settings_schema import Deprecation

# The scope an API key needs for an operation, by its method: reads need `read`, the rest
# `write` (auth.SCOPES).
SCOPE_OF_METHOD = {"GET": "read", "HEAD": "read"}
WRITE_SCOPE = "write"


class Policies:
    """The layer's per-request policies, from what its views declared, read once at start-up.

    Sets and dicts by endpoint, filled in once the views are registered (collect()): a request
    then costs one look-up, not a walk through its view's declarations.
    """

    def __init__(self, limiter: rate_limits.RateLimiter, layer: str):
        self.limiter = limiter
        # The layer's blueprint name: its views' endpoints start with it.
        self.layer = layer
        self.protected: frozenset[str] = frozenset()
        self.vary_origin = False
        # Keyed as request.endpoint is typed (None before routing), so a request looks its
        # endpoint up as it is.
        self.deprecated: dict[str | None, tuple[tuple[str, str], ...]] = {}

    def collect(self, app: Flask) -> None:
        views = {
            endpoint: view_doc(view)
            for endpoint, view in app.view_functions.items()
            if endpoint.startswith(f"{self.layer}.")
        }
        self.protected = frozenset(e for e, doc in views.items() if not doc.get("public"))
        # Answers to listed origins carry CORS headers and others' do not: caches must know.
        self.vary_origin = bool(app.config["CORS_ORIGINS"])
        self.deprecated = {
            endpoint: tuple(deprecation_headers(app.config[doc["deprecation"]]).items())
            for endpoint, doc in views.items()
            if "deprecation" in doc
        }

    def requires_key(self) -> bool:
        """Tell whether this request is for a view of the layer that only key holders may use."""
        served = REQUEST._get_current_object()
        return served.endpoint in self.protected and served.method != "OPTIONS"

    def admit(self) -> Response | None:
        """Answer OPTIONS, which never needs a key; check the key of a request that does, then
        count the request against the key's rate limit.

        Checked first, then counted: a request without a valid key counts against no key's
        budget, only against its address's failures (auth_failures.py). A hook of the layer's
        blueprint: it runs for the layer's views only.
        """
        served = REQUEST._get_current_object()
        if served.method == "OPTIONS":
            # A browser's CORS preflight never carries a key: 204 with Allow, and Flask-CORS adds
            # its headers for a listed origin.
            response = current_app.make_default_options_response()
            response.status_code = 204
            del response.headers["Content-Type"]  # no content, no type
            return response
        if served.endpoint in self.protected:
            key = authenticate(SCOPE_OF_METHOD.get(served.method, WRITE_SCOPE))
            G._get_current_object().rate_limit_window = rate_limits.count_request(
                self.limiter, key.budget, key.rate_limit
            )
        return None

    def add_headers(self, response: Response) -> Response:
        """Give every answer of a counted request the RateLimit-* headers, and of a deprecated
        view the deprecation headers, errors included (RFC 9745, RFC 8594); say that answers vary
        by Origin while CORS origins are listed."""
        served, context = REQUEST._get_current_object(), G._get_current_object()
        headers = response.headers
        # Added one by one, not set: no answer has them yet (a 429 has no window), a set would
        # search the headers for each, and extend's checks of what it is given cost more than
        # the adds. The successor's Link goes beside any Link of the view's own (a next page).
        window: rate_limits.Window | None = context.get("rate_limit_window")
        if window is not None:
            for name, value in window.headers().items():
                headers.add(name, value)
        for name, value in self.deprecated.get(served.endpoint, ()):
            headers.add(name, value)
        if self.vary_origin:
            response.vary.add("Origin")
        return response


def deprecation_headers(deprecation: "Deprecation") -> dict[str, str]:
    return {
        "Deprecation": f"@{int(deprecation['since'].timestamp())}",
        "Sunset": format_datetime(deprecation["sunset"], usegmt=True),
        "Link": f'<{deprecation["successor"]}>; rel="successor-version"',
    }
