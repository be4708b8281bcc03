"""The one place error responses are built: every failure becomes {code, message, status}."""

from flask import current_app, request
from werkzeug.exceptions import HTTPException, InternalServerError

from animal_store.extensions import db
from animal_store.schemas import ErrorSchema

# Stable codes for the HTTP errors Flask and Werkzeug raise on their own.
HTTP_ERROR_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    431: "request_header_fields_too_large",
    500: "internal_error",
}

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


def error_response(status, code, message, errors=None, headers=None):
    body = {"code": code, "message": message, "status": status}
    if errors:
        body["errors"] = errors
    return current_app.json.response(error_schema.dump(body)), status, headers or {}


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
    if error.code == 413:
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        return f"The request body is larger than the limit of {limit} bytes."
    return error.description or error.name


def handle_unexpected_error(error: Exception):
    # The traceback goes to the log, never to the client; the next request gets a clean session.
    current_app.logger.error("Unhandled exception", exc_info=error)
    db.session.rollback()
    return error_response(500, "internal_error", "The server failed to handle the request.")


def register_error_handlers(app):
    app.register_error_handler(APIError, handle_api_error)
    app.register_error_handler(HTTPException, handle_http_exception)
    app.register_error_handler(Exception, handle_unexpected_error)
