"""The one place error responses are built: every failure becomes {code, message, status}."""

import orjson
from flask import current_app, request
from gunicorn.http.errors import ParseException as GunicornParseError
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException, InternalServerError

from animal_store.extensions import db
from animal_store.schemas import ErrorSchema

# Stable codes for the HTTP errors Flask and Werkzeug raise on their own.
HTTP_ERROR_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    417: "expectation_failed",
    429: "too_many_requests",
    431: "request_header_fields_too_large",
    500: "internal_error",
    501: "not_implemented",
    503: "service_unavailable",
}

# What SQLite says when its file cannot be written (read-only, full, broken disk) or stays
# locked past the busy timeout: conditions of the machine, not bugs of ours.
SQLITE_OUTAGE_MESSAGES = ("unable to open", "disk i/o", "readonly", "full", "locked")

# Headers of the underlying exception that still mean something on our error response.
KEPT_HEADERS = ("Allow", "WWW-Authenticate", "Retry-After")


# The body goes through the schema the OpenAPI document shows, so the two cannot differ.
error_schema = ErrorSchema()


class APIError(Exception):
    """An error the API answers on purpose, with its own code and message."""

    def __init__(self, status, code, message, errors=None, headers=None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.errors = errors
        self.headers = headers or {}


def error_body(status, code, message, errors=None) -> dict:
    """The error object, put together here only: for the app's answers and for gunicorn's."""
    body = {"code": code, "message": message, "status": status}
    if errors:
        body["errors"] = errors
    return error_schema.dump(body)


def error_response(status, code, message, errors=None, headers=None):
    body = error_body(status, code, message, errors)
    return current_app.json.response(body), status, headers or {}


def handle_api_error(error: APIError):
    return error_response(error.status, error.code, error.message, error.errors, error.headers)


def handle_http_exception(error: HTTPException):
    if isinstance(error, InternalServerError):
        return handle_unexpected_error(error.original_exception or error)
    headers = {name: value for name, value in error.get_headers() if name in KEPT_HEADERS}
    code = HTTP_ERROR_CODES.get(error.code) or error.name.lower().replace(" ", "_")
    return error_response(error.code, code, http_error_message(error), headers=headers)


def http_error_message(error: HTTPException) -> str:
    if error.code == 404:
        return f"No resource at {request.path}."
    if error.code == 405:
        allowed = ", ".join(sorted(error.valid_methods or ()))
        return f"Method {request.method} is not allowed on {request.path}; use {allowed}."
    if error.code == 429:
        return f"Too many requests: the limit is {error.description}; see Retry-After."
    if error.code == 413:
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        return f"The request body is larger than the limit of {limit} bytes."
    return error.description or error.name


def handle_unexpected_error(error: Exception):
    if is_database_outage(error):
        return handle_database_outage(error)
    # The traceback goes to the log, never to the client; the next request gets a clean session.
    current_app.logger.error("Unhandled exception", exc_info=error)
    db.session.rollback()
    return error_response(500, "internal_error", "The server failed to handle the request.")


def is_database_outage(error: Exception) -> bool:
    """Tell a database that cannot be reached or written from a bug in our SQL."""
    if isinstance(error, sa_exc.DisconnectionError | sa_exc.TimeoutError):
        return True  # the pool gave up reconnecting, or every connection stayed busy
    if not isinstance(error, sa_exc.OperationalError | sa_exc.InterfaceError):
        return False
    if db.engine.dialect.name == "sqlite":
        # SQLite raises OperationalError for syntax errors and missing tables too: those are bugs.
        message = str(error.orig).lower()
        return any(fragment in message for fragment in SQLITE_OUTAGE_MESSAGES)
    return True


def handle_database_outage(error: Exception):
    # One line, not a traceback per request while the database is away; the driver's message
    # without the statement's parameters, which may hold what clients sent.
    cause = getattr(error, "orig", None) or error
    current_app.logger.warning("Database unavailable: %s: %s", type(cause).__name__, cause)
    try:
        # Whatever the request had written is undone, not half-committed.
        db.session.rollback()
    except sa_exc.SQLAlchemyError:
        db.session.close()
    return handle_api_error(database_unavailable())


def database_unavailable() -> APIError:
    """The one answer for a database that cannot be reached or written, /readyz's included."""
    return APIError(
        503,
        "service_unavailable",
        "The database is unavailable; retry later.",
        headers={"Retry-After": str(current_app.config["DATABASE_RETRY_AFTER"])},
    )


def handle_malformed_body(error: GunicornParseError):
    # gunicorn parses a chunked body only as the app reads it, so its complaint surfaces here.
    return error_response(400, "bad_request", f"The request body is malformed: {error}.")


def raw_error_response(status: int, reason: str) -> bytes:
    """Return a whole HTTP/1.1 error response, for gunicorn to send before any app runs.

    gunicorn answers requests it cannot parse (header or URL too long, bad chunked framing) on its
    own; config/gunicorn.conf.py sends this instead of its HTML page. Only the reason is used,
    never gunicorn's message, which may quote what the client sent (a header with a key).
    """
    code = HTTP_ERROR_CODES.get(status, "bad_request")
    body = orjson.dumps(error_body(status, code, f"{reason}."))
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def register_error_handlers(app):
    app.register_error_handler(GunicornParseError, handle_malformed_body)
    app.register_error_handler(APIError, handle_api_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    app.register_error_handler(Exception, handle_unexpected_error)
