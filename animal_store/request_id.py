"""Request IDs: one per request, from a valid incoming X-Request-ID or made here, sent back."""

import re
import uuid

from flask import g, has_request_context, request

HEADER = "X-Request-ID"
# Wide enough for UUIDs, nginx's $request_id and most tracing IDs; narrow enough that an ID
# can go into a log line or a response header as it is.
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def current_request_id() -> str | None:
    """Return this request's ID, choosing it on first use; None outside a request."""
    if not has_request_context():
        return None
    if "request_id" not in g:
        incoming = request.headers.get(HEADER, "")
        g.request_id = incoming if VALID_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
    return g.request_id


def add_request_id_header(response) -> None:
    # Chosen on first use (a log line, or this header), the same for the whole request.
    response.headers[HEADER] = current_request_id()
