"""The error catalogue, and the one place error responses are built as {code, message, status}.

Every error the service (or gunicorn and nginx in front of it) can answer is an ErrorKind below:
its HTTP status, its stable code, its message and when it happens. From this list come the app's
error responses, the error responses of the OpenAPI document, the error table of docs/errors.rst,
gunicorn's answers to requests it cannot parse and nginx's error bodies (`flask nginx-errors`).
"""

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

import orjson
from flask import Flask, Response, current_app, g, request
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import (
    ClientDisconnected,
    HTTPException,
    InternalServerError,
    MethodNotAllowed,
)

from animal_store.data.database_faults import (
    READ_ONLY,
    READ_ONLY_SQL_TRANSACTION,
    UNAVAILABLE,
    first_line,
    is_database_outage,
    is_disk_full,
    is_login_refusal,
    log_fault,
    log_outage,
    login_refused,
    remember_full_disk,
)
from animal_store.extensions import db, settings
from animal_store.schemas import ErrorSchema
from animal_store.settings_schema import Settings

# An error's answer, as Flask takes it from a handler: the body, the status and the headers.
ErrorAnswer = tuple[Response, int, Mapping[str, str]]


@dataclass(frozen=True)
class ErrorKind:
    """One entry of the catalogue; calling it with the message's values makes the APIError."""

    status: int
    code: str
    # A str.format template; its fields are filled in where the error is raised.
    message: str
    # For the OpenAPI document and docs/errors.rst: when a client meets it.
    when: str
    # Response headers it always carries (documented; set where it is raised).
    headers: tuple[str, ...] = ()

    def __call__(
        self,
        errors: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        **values: object,
    ) -> "APIError":
        return APIError(self, self.message.format(**values), errors, headers)


class APIError(Exception):
    """An error the API answers on purpose: a kind of the catalogue with its message filled in."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        errors: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.errors = errors
        self.headers = headers or {}


# The catalogue, in the order of docs/errors.rst.
VALIDATION_ERROR = ErrorKind(
    400,
    "validation_error",
    "Invalid {where}: {fields}.",
    "A query parameter, a header or a field of the body is invalid; `errors` names each one.",
)
INVALID_JSON = ErrorKind(
    400,
    "invalid_json",
    "The body is not valid JSON at line {line}, column {column}: send one JSON object, in "
    "UTF-8, its names and strings in double quotes, with no trailing comma.",
    "The body does not parse as JSON.",
)
EMPTY_BODY = ErrorKind(
    400, "invalid_json", "The body is empty: send one JSON object.", "The body is empty."
)
NOT_AN_OBJECT = ErrorKind(
    400, "invalid_json", "The body must be a JSON object.", "The body is JSON but not an object."
)
DUPLICATE_MEMBER = ErrorKind(
    400,
    "invalid_json",
    "The body names member '{name}' twice in one object: send each member of an object once.",
    "An object of the body, at any depth, has two members of one name (I-JSON, RFC 7493).",
)
TRUNCATED_BODY = ErrorKind(
    400,
    "bad_request",
    "The body ended after {received} of its {expected} bytes.",
    "The body ended before its `Content-Length`.",
)
MALFORMED_BODY = ErrorKind(
    400,
    "bad_request",
    "The request body's chunked framing is broken: send each chunk as its size in hexadecimal, "
    "CRLF, its bytes and CRLF, and end the body with a chunk of size 0.",
    "The body's chunked framing is broken, or the body ended before its last chunk.",
)
BAD_REQUEST = ErrorKind(
    400,
    "bad_request",
    "The request is malformed.",
    "The request cannot be parsed at all (answered by gunicorn or nginx).",
)
UNAUTHORIZED = ErrorKind(
    401,
    "unauthorized",
    "Send an API key as 'Authorization: Bearer <key>'.",
    "No API key was sent.",
    ("WWW-Authenticate",),
)
INVALID_KEY = ErrorKind(
    401,
    "unauthorized",
    "The API key is not valid, has expired or has been revoked.",
    "The API key is wrong, expired or revoked.",
    ("WWW-Authenticate",),
)
FORBIDDEN = ErrorKind(
    403, "forbidden", "The request is forbidden.", "Refused by the server before the app runs."
)
MISSING_SCOPE = ErrorKind(
    403,
    "forbidden",
    "This API key may not {method} {path}: it lacks the '{scope}' scope.",
    "The API key lacks the scope the operation needs (`read` or `write`).",
)
NOT_FOUND = ErrorKind(404, "not_found", "No resource at {path}.", "No route has this path.")
PET_NOT_FOUND = ErrorKind(404, "not_found", "No animal with id {pet_id}.", "No animal has this id.")
METHOD_NOT_ALLOWED = ErrorKind(
    405,
    "method_not_allowed",
    "Method {method} is not allowed on {path}; use {allowed}.",
    "The path does not have this method.",
    ("Allow",),
)
TRACE_NOT_ALLOWED = ErrorKind(
    405,
    "method_not_allowed",
    "Method TRACE is not allowed on any path.",
    "A `TRACE` request: nginx refuses it on every path before any route is chosen (answered "
    "by nginx, without `Allow`, which would be each path's own).",
)
REQUEST_TIMEOUT = ErrorKind(
    408,
    "request_timeout",
    "The body did not arrive whole within {seconds} seconds of the headers. Send the whole body "
    "without pausing; nothing was changed.",
    "The client's body did not arrive whole within `REQUEST_BODY_TIMEOUT` seconds of its headers "
    "(gunicorn reached directly: nginx reads the whole body before it passes the request on).",
)
HEAD_TIMEOUT = ErrorKind(
    408,
    "request_timeout",
    "The request line and headers did not arrive whole within {seconds} seconds. Send the whole "
    "request without pausing.",
    "The client's request line and headers did not arrive whole within `REQUEST_HEADER_TIMEOUT` "
    "seconds of the connection (gunicorn reached directly; nginx's own deadline is "
    "`client_header_timeout`). A connection that sent nothing is closed without an answer.",
)
IDEMPOTENCY_KEY_IN_USE = ErrorKind(
    409,
    "idempotency_key_in_use",
    "A request with this Idempotency-Key is still being processed; retry shortly.",
    "A request with this `Idempotency-Key` is still running.",
    ("Retry-After",),
)
IDEMPOTENCY_KEY_RACING = ErrorKind(
    409,
    "idempotency_key_in_use",
    "Requests with this Idempotency-Key are racing; retry shortly.",
    "Requests with this `Idempotency-Key` keep taking it from each other.",
    ("Retry-After",),
)
ALREADY_EXISTS = ErrorKind(
    409,
    "already_exists",
    "A value that must be unique is already taken; nothing was changed.",
    "A field that must be unique (such as a name) has a value another item already has.",
)
PAYLOAD_TOO_LARGE = ErrorKind(
    413,
    "payload_too_large",
    "The request body is larger than the limit of {limit} bytes.",
    "The body is over the server's limit (`MAX_CONTENT_LENGTH`, 64 KiB by default).",
)
URI_TOO_LONG = ErrorKind(
    414, "uri_too_long", "The request URI is too long.", "The request line is over the limit."
)
UNSUPPORTED_MEDIA_TYPE = ErrorKind(
    415,
    "unsupported_media_type",
    "Send the body as JSON with 'Content-Type: application/json'.",
    "The body is not sent as `application/json`.",
)
EXPECTATION_FAILED = ErrorKind(
    417,
    "expectation_failed",
    "The expectation cannot be met.",
    "An `Expect` header other than `100-continue`.",
)
IDEMPOTENCY_KEY_REUSED = ErrorKind(
    422,
    "idempotency_key_reused",
    "This Idempotency-Key was used with a different request body; use a new key.",
    "This `Idempotency-Key` was used with another body.",
)
TOO_MANY_REQUESTS = ErrorKind(
    429,
    "too_many_requests",
    "Too many requests: the limit is {limit}; see Retry-After.",
    "This API key made too many requests in the current window.",
    ("Retry-After",),
)
TOO_MANY_AUTH_FAILURES = ErrorKind(
    429,
    "too_many_requests",
    "Too many requests without a valid API key from this address: the limit is {limit}; "
    "see Retry-After.",
    "The client's address sent too many requests without a valid API key in the current "
    "window; a key the server knows valid is still served.",
    ("Retry-After",),
)
TOO_MANY_CONNECTIONS = ErrorKind(
    429,
    "too_many_requests",
    "Too many requests at once from this address; see Retry-After.",
    "The client's address has too many requests in progress at once (answered by nginx).",
    ("Retry-After",),
)
HEADERS_TOO_LARGE = ErrorKind(
    431,
    "request_header_fields_too_large",
    "The request headers are too large.",
    "A header, or all of them together, is over the limit.",
)
INTERNAL_ERROR = ErrorKind(
    500,
    "internal_error",
    "The server failed to handle the request.",
    "A bug in the service, logged on the server.",
)
NOT_IMPLEMENTED = ErrorKind(
    501,
    "not_implemented",
    "The request uses a transfer coding the server does not support.",
    "A `Transfer-Encoding` other than chunked.",
)
BAD_GATEWAY = ErrorKind(
    502,
    "bad_gateway",
    "The service is not reachable; try again later.",
    "nginx reaches no instance of the service.",
    ("Retry-After",),
)
DATABASE_UNAVAILABLE = ErrorKind(
    503,
    "service_unavailable",
    "The database is unavailable; retry later.",
    "The database cannot be reached or written just now; nothing was changed.",
    ("Retry-After",),
)
DATABASE_READ_ONLY = ErrorKind(
    503,
    "service_unavailable",
    "The database takes no writes just now; retry later.",
    "The database takes only reads (a standby, during a failover); nothing was changed.",
    ("Retry-After",),
)
DATABASE_LOGIN_REFUSED = ErrorKind(
    503,
    "service_unavailable",
    "The database refuses the service's login; retry later.",
    "The database refuses the service's role or password, a configuration error the log names "
    "at ERROR; nothing was changed.",
    ("Retry-After",),
)
DATABASE_FULL = ErrorKind(
    503,
    "service_unavailable",
    "The database has no space left for writes; retry later.",
    "The database's disk is full: reads are still served, writes wait for space to be freed; "
    "nothing was changed.",
    ("Retry-After",),
)
OVERLOADED = ErrorKind(
    503,
    "service_unavailable",
    "The service is overloaded: the request waited too long for a worker; retry later.",
    "The request waited longer than `REQUEST_QUEUE_TIMEOUT` for a worker, in a surge of "
    "requests, and was answered unserved by the worker that took it; nothing was changed.",
    ("Retry-After",),
)
SERVICE_UNAVAILABLE = ErrorKind(
    503,
    "service_unavailable",
    "The service is unavailable; try again later.",
    "nginx has no instance that can take the request.",
    ("Retry-After",),
)
GATEWAY_TIMEOUT = ErrorKind(
    504,
    "gateway_timeout",
    "The service did not answer in time.",
    "The service did not answer nginx in time.",
)
HTTP_VERSION_NOT_SUPPORTED = ErrorKind(
    505,
    "http_version_not_supported",
    "The HTTP version of the request is not supported; use HTTP/1.1 or HTTP/2.",
    "A request line with an HTTP version other than 1.0 or 1.1 (answered by nginx).",
)

CATALOGUE = tuple(kind for kind in globals().values() if isinstance(kind, ErrorKind))

# The kind behind each HTTP error that Werkzeug, Flask or gunicorn raise on their own.
KIND_OF_STATUS = {
    400: BAD_REQUEST,
    401: UNAUTHORIZED,
    403: FORBIDDEN,
    404: NOT_FOUND,
    405: METHOD_NOT_ALLOWED,
    408: REQUEST_TIMEOUT,
    413: PAYLOAD_TOO_LARGE,
    414: URI_TOO_LONG,
    415: UNSUPPORTED_MEDIA_TYPE,
    417: EXPECTATION_FAILED,
    429: TOO_MANY_REQUESTS,
    431: HEADERS_TOO_LARGE,
    500: INTERNAL_ERROR,
    501: NOT_IMPLEMENTED,
    502: BAD_GATEWAY,
    503: SERVICE_UNAVAILABLE,
    504: GATEWAY_TIMEOUT,
    505: HTTP_VERSION_NOT_SUPPORTED,
}

# How the drivers name a unique constraint's refusal: PostgreSQL's SQLSTATE, SQLite's extended
# result codes (Python's sqlite3 says them by name).
UNIQUE_VIOLATION = "23505"
SQLITE_UNIQUE_ERRORS = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")
# What each outage is called in the metric of refusals (metrics.py), in the log's
# `databaseFault` and in /readyz.
OUTAGE_REASONS = {
    DATABASE_UNAVAILABLE: UNAVAILABLE,
    DATABASE_READ_ONLY: READ_ONLY,
    DATABASE_LOGIN_REFUSED: "login_refused",
    DATABASE_FULL: "storage_full",
}

# Headers of the underlying exception that still mean something on our error response.
KEPT_HEADERS = ("Allow", "WWW-Authenticate", "Retry-After")


# The body goes through the schema the OpenAPI document shows, so the two cannot differ.
error_schema = ErrorSchema()


def error_body(
    kind: ErrorKind, message: str | None = None, errors: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The error object, put together here only: for the app's answers, gunicorn's and nginx's."""
    body: dict[str, Any] = {
        "code": kind.code,
        "message": message or kind.message,
        "status": kind.status,
    }
    if errors:
        body["errors"] = errors
    dumped: dict[str, Any] = error_schema.dump(body)
    return dumped


def error_response(
    kind: ErrorKind,
    message: str | None = None,
    errors: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> ErrorAnswer:
    body = error_body(kind, message, errors)
    # Flask's JSON provider answers with its app's response class: Flask's own Response here.
    response = cast(Response, current_app.json.response(body))
    return response, kind.status, headers or {}


def handle_api_error(error: APIError) -> ErrorAnswer:
    return error_response(error.kind, error.message, error.errors, error.headers)


def handle_http_exception(error: HTTPException) -> ErrorAnswer:
    if isinstance(error, InternalServerError):
        return handle_unexpected_error(error.original_exception or error)
    headers = {name: value for name, value in error.get_headers() if name in KEPT_HEADERS}
    if isinstance(error, MethodNotAllowed):
        # Werkzeug lists them in the routing's order, which varies: the header and the message
        # say them alike.
        headers["Allow"] = allowed_methods(error)
    # Flask hands a handler only exceptions with a status: it answers a proxy's itself.
    status = cast(int, error.code)
    kind = KIND_OF_STATUS.get(status)
    if kind is None:
        kind = ErrorKind(status, error.name.lower().replace(" ", "_"), error.name, "")
    return error_response(kind, http_error_message(kind, error), headers=headers)


def http_error_message(kind: ErrorKind, error: HTTPException) -> str:
    if kind is NOT_FOUND:
        return kind.message.format(path=request.path)
    if kind is METHOD_NOT_ALLOWED:
        return kind.message.format(
            method=request.method, path=request.path, allowed=allowed_methods(error)
        )
    if kind is TOO_MANY_REQUESTS:
        return kind.message.format(limit=error.description)
    if kind is PAYLOAD_TOO_LARGE:
        return kind.message.format(limit=settings(current_app).MAX_CONTENT_LENGTH)
    # Not the exception's description: Werkzeug's words ("The browser (or proxy) sent a request
    # that this server could not understand."), not the catalogue's.
    return kind.message


def allowed_methods(error: HTTPException) -> str:
    # Werkzeug's MethodNotAllowed lists them; another exception with its status lists none.
    return ", ".join(sorted(getattr(error, "valid_methods", None) or ()))


def handle_unexpected_error(error: BaseException) -> ErrorAnswer:
    if is_database_outage(error):
        return handle_database_outage(error)
    # The traceback goes to the log, never to the client; the next request gets a clean session.
    current_app.logger.error("Unhandled exception", exc_info=error)
    db.session.rollback()
    return error_response(INTERNAL_ERROR)


def handle_integrity_error(error: sa_exc.IntegrityError) -> ErrorAnswer:
    """Answer a unique constraint's refusal as 409 already_exists; any other integrity error is a
    bug of ours (a missing value, a broken reference) and a 500."""
    if not is_unique_violation(error):
        return handle_unexpected_error(error)
    # Whatever the request had written is undone; the stored rows stay as they were.
    db.session.rollback()
    return error_response(ALREADY_EXISTS)


def is_unique_violation(error: sa_exc.IntegrityError) -> bool:
    # A primary key is a unique index too: PostgreSQL says both with the one SQLSTATE.
    sqlstate = getattr(error.orig, "sqlstate", None)
    if sqlstate is not None:
        return bool(sqlstate == UNIQUE_VIOLATION)
    return getattr(error.orig, "sqlite_errorname", None) in SQLITE_UNIQUE_ERRORS


def outage_kind(error: BaseException) -> ErrorKind:
    """Tell what keeps the database from serving: a login it refuses, a full disk, a server that
    takes only reads, or one that cannot be reached (the rest)."""
    cause = getattr(error, "orig", None)
    sqlstate = getattr(cause, "sqlstate", None) or ""
    if sqlstate == READ_ONLY_SQL_TRANSACTION:
        return DATABASE_READ_ONLY
    if is_login_refusal(error):
        return DATABASE_LOGIN_REFUSED
    if is_disk_full(error):
        return DATABASE_FULL
    return DATABASE_UNAVAILABLE


def handle_database_outage(error: BaseException) -> ErrorAnswer:
    kind = outage_kind(error)
    report_outage(kind, getattr(error, "orig", None) or error)
    try:
        # Whatever the request had written is undone, not half-committed.
        db.session.rollback()
    except sa_exc.SQLAlchemyError:
        db.session.close()
    return handle_api_error(database_refusal(kind))


def report_outage(kind: ErrorKind, cause: BaseException) -> None:
    """Count the refusal (metrics.py) and log it, once a minute at most with the count of the
    requests refused meanwhile (database_faults.py): a refused login or a full disk at ERROR, as
    faults that need an operator; an outage, which passes, at WARNING, and once when it is over.
    The driver's message, never the statement's parameters, which may hold what clients sent; nor
    the password, which no driver repeats."""
    reason = OUTAGE_REASONS[kind]
    g.database_refusal = reason
    if kind is DATABASE_LOGIN_REFUSED:
        log_fault(reason, "%s", login_refused(db.engine.url, cause))
    elif kind is DATABASE_FULL:
        remember_full_disk()
        log_fault(
            reason,
            "The database has no space left for writes: %s: %s. Writes are refused until space "
            "is freed; reads are served",
            type(cause).__name__,
            first_line(cause),
        )
    else:
        log_outage(reason, "Database unavailable: %s: %s", type(cause).__name__, cause)


def database_refusal(kind: ErrorKind = DATABASE_UNAVAILABLE) -> APIError:
    """The one answer for a database that cannot serve, /readyz's included: `kind` is one of
    OUTAGE_REASONS' (outage_kind())."""
    return kind(headers={"Retry-After": str(settings(current_app).DATABASE_RETRY_AFTER)})


def raw_error_response(error: "int | APIError", request_id: str) -> bytes:
    """Return a whole HTTP/1.1 error response, for a server to send before any app runs: the
    catalogue's kind of a status, or an error with its message filled in.

    gunicorn answers requests it cannot parse (header or URL too long, bad chunked framing) on its
    own (the worker class, animal_store/serving/worker.py); the message is the catalogue's, never
    the server's, which may quote what the client sent (a header with a key). `request_id` is the
    answer's X-Request-ID, as every answer has one.
    """
    if isinstance(error, APIError):
        kind, message = error.kind, error.message
    else:
        kind, message = KIND_OF_STATUS.get(error, BAD_REQUEST), None
    body = orjson.dumps(error_body(kind, message))
    head = (
        f"HTTP/1.1 {kind.status} {HTTPStatus(kind.status).phrase}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        f"X-Request-ID: {request_id}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def handle_malformed_body(error: Exception) -> ErrorAnswer:
    # gunicorn parses a chunked body only as the app reads it, so its complaint surfaces here.
    # Its words are not said: they quote what the client sent, and the other servers say others.
    return handle_api_error(MALFORMED_BODY())


def handle_client_disconnected(error: ClientDisconnected) -> ErrorAnswer:
    """Answer a body that Werkzeug's reading found ended early or broken as the catalogue does.

    The development server gives the app a body as it comes: one shorter than its Content-Length,
    or whose chunked framing is broken or cut, is found only as it is read, and Werkzeug raises
    ClientDisconnected for all of them (gunicorn too, for a chunked body cut short). The answer is
    the one gunicorn gives for the same bytes (body.whole_body, handle_malformed_body).
    """
    expected = request.content_length
    if expected is None:  # chunked: a body sent with neither header is empty, never cut
        return handle_api_error(MALFORMED_BODY())
    # Werkzeug's stream, limited to the Content-Length, counts what it has read.
    return handle_api_error(TRUNCATED_BODY(received=request.stream.tell(), expected=expected))


def register_error_handlers(app: Flask) -> None:
    # Optional, so the app imports (and serves under any WSGI server) without gunicorn.
    with suppress(ImportError):
        from gunicorn.http.errors import ParseException

        app.register_error_handler(ParseException, handle_malformed_body)
    app.register_error_handler(ClientDisconnected, handle_client_disconnected)
    app.register_error_handler(APIError, handle_api_error)
    # Raised out of any view that writes: no view catches it itself.
    app.register_error_handler(sa_exc.IntegrityError, handle_integrity_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    app.register_error_handler(Exception, handle_unexpected_error)


# What nginx answers itself (config/nginx.conf, error_page), by the status it answers with.
NGINX_ANSWERS = (400, 405, 413, 414, 417, 429, 431, 500, 501, 502, 503, 504, 505)
# nginx's own kind where it is not the app's kind of the status: its 405 is TRACE's (every other
# method reaches the app), its 429 limit_conn's.
NGINX_KINDS = {**KIND_OF_STATUS, 405: TRACE_NOT_ALLOWED, 429: TOO_MANY_CONNECTIONS}
# Retry-After of nginx's answers that carry one: limit_conn's 429 frees as soon as one of the
# address's requests ends; the others are outages, retried as the app's 503 asks.
NGINX_RETRY_AFTER = {429: 1}


def nginx_error_locations(config: "Settings") -> str:
    """Return config/nginx.conf's error bodies, the catalogue's, as its `location` blocks."""
    blocks = []
    for status in NGINX_ANSWERS:
        kind = NGINX_KINDS[status]
        message = kind.message.format(limit=config.MAX_CONTENT_LENGTH)
        body = orjson.dumps(error_body(kind, message)).decode()
        lines = [f"        location = /errors/{status}.json {{"]
        if kind.headers:
            # An add_header here replaces the outer ones, so X-Request-ID, nosniff and HSTS (its
            # map in config/nginx.conf: over TLS only) are repeated.
            lines.append("            add_header X-Request-ID $animal_store_request_id always;")
            lines.append("            add_header X-Content-Type-Options nosniff always;")
            lines.append(
                "            add_header Strict-Transport-Security $animal_store_hsts always;"
            )
            retry_after = NGINX_RETRY_AFTER.get(status, config.DATABASE_RETRY_AFTER)
            lines.append(f"            add_header Retry-After {retry_after} always;")
        lines += [f"            return {status} '{body}';", "        }"]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def rst_error_table() -> str:
    """Return the catalogue as the reStructuredText table of docs/errors.rst."""
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for row in (("HTTP", "code", "message", "when"), *map(rst_row, CATALOGUE)):
        lines += [f"   * - {row[0]}", *(f"     - {cell}" for cell in row[1:])]
    return "\n".join(lines)


def rst_row(kind: ErrorKind) -> tuple[str, ...]:
    # The descriptions are Markdown for the OpenAPI document: `x` is ``x`` in reStructuredText.
    when = kind.when.replace("`", "``")
    return (str(kind.status), f"``{kind.code}``", kind.message.replace("*", r"\*"), when)
