"""The /v1 API layer: what every operation shares, attached once, and the OpenAPI document.

A resource is a `Blueprint` (flask-smorest's, declarations.py) whose views declare their own
contract beside them: `arguments`, `response`, `alt_response` and `doc` from flask-smorest, plus
`errors(...)` (kinds of the error catalogue) and `deprecated(...)`. `register_api` (layer.py)
registers each resource under the /v1 layer, which gives all of its views, with no wiring of
their own:

- authentication with an API key, unless the view is marked `@public`; OPTIONS never needs one;
- CORS for the origins CORS_ORIGINS lists (Flask-CORS);
- rate limits (rate_limits.py) and `Cache-Control: no-store` on the same views;
- the deprecation headers of a view declared deprecated, on all of its answers;
- error answers as the error object (errors.py handles every error of the app);
- their place in the OpenAPI document, with the answers every operation shares (401, 405, 429,
  500, 503, the RateLimit-* headers) added to what each view declares.

One job a module: headers.py (the response headers the document describes), arguments.py (the
parser of what views take), declarations.py (what views declare, and the Blueprint that takes it),
policies.py (the per-request policies), document.py (the OpenAPI document's plugin and hook) and
layer.py (the layer put together).
"""

from animal_store.api.declarations import (
    Blueprint,
    declare,
    declare_errors,
    declare_parameter,
    declare_response,
    public,
    view_doc,
)
from animal_store.api.document import declared_query_parameters
from animal_store.api.headers import Header
from animal_store.api.layer import LAYER, register_api
from animal_store.api.policies import SCOPE_OF_METHOD, WRITE_SCOPE, Policies

__all__ = [
    "LAYER",
    "SCOPE_OF_METHOD",
    "WRITE_SCOPE",
    "Blueprint",
    "Header",
    "Policies",
    "declare",
    "declare_errors",
    "declare_parameter",
    "declare_response",
    "declared_query_parameters",
    "public",
    "register_api",
    "view_doc",
]
