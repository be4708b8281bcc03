"""Request IDs: one per request, from a valid incoming X-Request-ID or made here, sent back."""

import itertools
import os
import re

from flask import Response, g, has_request_context, request

HEADER = "X-Request-ID"
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
    if "request_id" not in g:
        incoming = request.headers.get(HEADER, "")
        g.request_id = incoming if VALID_REQUEST_ID.fullmatch(incoming) else NEW_IDS.new()
    request_id: str = g.request_id
    return request_id


def add_request_id_header(response: Response) -> None:
    # Chosen on first use (a log line, or this header), the same for the whole request.
    response.headers[HEADER] = current_request_id()
