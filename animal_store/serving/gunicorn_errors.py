"""gunicorn's own error answers as the API's error object: the one place we reach into gunicorn.

gunicorn answers the requests it cannot parse (a request line or headers over its limits, broken
framing) before any app runs, with an HTML page that `gunicorn.util.write_error` writes, and with
a status `Worker.handle_error` picks. gunicorn has no setting or hook for either, so `install()`
replaces `write_error` and wraps `handle_error`, after checking that both still have the shape
the replacements stand in for: a gunicorn that changes them stops the worker at boot, and
tests/test_gunicorn.py fails, instead of clients silently getting HTML or another status again.
Each answer carries an X-Request-ID, as every answer does (request_id.py), and gunicorn's warning
line for the refusal carries the same ID as `request_id`.
Only config/gunicorn.conf.py imports this module; the app never does.
"""

import inspect
import logging
import socket
from contextvars import ContextVar
from typing import Any

from gunicorn import util
from gunicorn.http.errors import InvalidHeader, UnsupportedTransferCoding
from gunicorn.workers import base

from animal_store.errors import raw_error_response
from animal_store.http.request_id import NEW_IDS, VALID_REQUEST_ID

# gunicorn.util.write_error's parameters, and the call of it in Worker.handle_error.
EXPECTED_PARAMETERS = ("sock", "status_int", "reason", "mesg")
EXPECTED_CALL = "util.write_error(client, status_int, reason, mesg)"
# Worker.handle_error's parameters, and how it tells an unsupported coding (501).
EXPECTED_HANDLER_PARAMETERS = ("self", "req", "client", "addr", "exc")
EXPECTED_501 = "isinstance(exc, UnsupportedTransferCoding)"

handle_error = base.Worker.handle_error
# The ID of the refusal being answered, chosen before gunicorn logs it, so that its warning line
# and the answer carry the same one. A context variable: gthread workers answer from threads.
REFUSAL_ID: ContextVar[str | None] = ContextVar("refusal_id", default=None)


def refusal_id(request: Any) -> str:
    """Return the client's X-Request-ID where gunicorn had parsed the headers and it is valid,
    as the app takes it (joined, if sent twice), else a new one."""
    sent = [value for name, value in getattr(request, "headers", ()) if name == "X-REQUEST-ID"]
    incoming = ",".join(sent)
    return incoming if VALID_REQUEST_ID.fullmatch(incoming) else NEW_IDS.new()


class RefusalIdFilter(logging.Filter):
    """Add the refusal's ID to gunicorn's lines about it, as the app's lines carry theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REFUSAL_ID.get()
        if request_id is not None:
            # config/gunicorn.conf.py's JsonFormatter writes `fields` into the line.
            record.fields = {**getattr(record, "fields", {}), "request_id": request_id}
        return True


REFUSAL_ID_FILTER = RefusalIdFilter()


def write_json_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    # The catalogue's message, never gunicorn's: that may quote what the client sent (a key).
    request_id = REFUSAL_ID.get() or NEW_IDS.new()
    util.write_nonblock(sock, raw_error_response(status_int, request_id))


def handle_error_as_nginx(
    worker: base.Worker, req: Any, client: socket.socket, addr: Any, exc: BaseException
) -> None:
    """gunicorn's handle_error, but for the status of a Transfer-Encoding it refuses.

    gunicorn answers an unknown coding with 501, but a coding it knows and does not decode
    (`gzip`, `identity`) or chunked not alone with 400. nginx answers all of them with 501, and so
    does every path (docs/errors.rst). In an HTTP/1.0 request, where no coding belongs, both say
    400; but gunicorn refuses a coding it does not know (501) before it looks at the version, and
    without the request at hand, so that one stays 501.
    """
    request = getattr(exc, "req", None)
    if (
        isinstance(exc, InvalidHeader)
        and exc.hdr == "TRANSFER-ENCODING"
        and request is not None
        and request.version >= (1, 1)
    ):
        exc = UnsupportedTransferCoding(exc.hdr)
    # Most refusals come before gunicorn has the request's headers (req is None): a new ID then.
    token = REFUSAL_ID.set(refusal_id(req or request))
    try:
        handle_error(worker, req, client, addr, exc)
    finally:
        REFUSAL_ID.reset(token)


def check_gunicorn() -> None:
    """Raise unless gunicorn still answers its parse errors through util.write_error, with the
    status Worker.handle_error picks."""
    if util.write_error is write_json_error:
        return
    parameters = tuple(inspect.signature(util.write_error).parameters)
    handler_parameters = tuple(inspect.signature(handle_error).parameters)
    source = inspect.getsource(base.Worker)
    if (
        parameters != EXPECTED_PARAMETERS
        or handler_parameters != EXPECTED_HANDLER_PARAMETERS
        or EXPECTED_CALL not in source
        or EXPECTED_501 not in source
    ):
        raise RuntimeError(
            "gunicorn no longer answers unparsable requests through "
            f"util.write_error{EXPECTED_PARAMETERS} from Worker.handle_error: update "
            "animal_store/serving/gunicorn_errors.py."
        )


def install() -> None:
    """Make gunicorn answer the requests it cannot parse with the error object."""
    check_gunicorn()
    logging.getLogger("gunicorn.error").addFilter(REFUSAL_ID_FILTER)
    util.write_error = write_json_error
    base.Worker.handle_error = handle_error_as_nginx  # type: ignore[method-assign,assignment]
