"""Response headers as the OpenAPI document describes them, and those the layer itself sets."""

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Header:
    """A response header as the document describes it: declared where the header is set."""

    name: str
    description: str
    # An OpenAPI fragment, as the document's other parts from flask-smorest and apispec are:
    # dict[str, Any] throughout the layer, apispec having no types for them.
    schema: dict[str, Any]
    required: bool = False
    # Its name among the document's header components, when two headers share a name.
    component: str | None = None

    def spec(self) -> dict[str, Any]:
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
