"""Request IDs: one per request, from a valid incoming X-Request-ID or made here, sent back."""

import itertools
import os
import re

from flask import Response, has_request_context

from animal_store.current import REQUEST, G

HEADER = "X-Request-ID"
ENVIRON_KEY = "HTTP_X_REQUEST_ID"
# Wide enough for UUIDs, nginx's $request_id and most tracing IDs; narrow enough that an ID
# can go into a log line or a response header as it is.
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


class RequestIds:
    """New request IDs: 32 hex digits, 64 random bits drawn once per process and then a counter.

    Unique as a UUID4 would be for what an ID is for, finding a request's lines, at a counter's
    cost rather than the system's random source per request. Not secrets: they are sent back.
    """

    def __init__(self) -> None:
        self.start()
        # A forked worker draws its own bits, so no two processes share a prefix.
        os.register_at_fork(after_in_child=self.start)

    def start(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count()

    def new(self) -> str:
        return f"{self.prefix}{next(self.counter) & 0xFFFFFFFFFFFFFFFF:016x}"


NEW_IDS = RequestIds()


def current_request_id() -> str | None:
    """Return this request's ID, choosing it on first use; None outside a request."""
    if not has_request_context():
        return None
    context = G._get_current_object()
    request_id: str | None = context.get("request_id")
    if request_id is None:
        # The header as the WSGI environ holds it: no look-up through the request's headers.
        incoming = REQUEST._get_current_object().environ.get(ENVIRON_KEY, "")
        request_id = incoming if VALID_REQUEST_ID.fullmatch(incoming) else NEW_IDS.new()
        context.request_id = request_id
    return request_id


def add_request_id_header(response: Response) -> None:
    # Chosen on first use (a log line, or this header), the same for the whole request. Added:
    # no answer has one before this step, and a set would search the headers for it first.
    response.headers.add(HEADER, current_request_id())
