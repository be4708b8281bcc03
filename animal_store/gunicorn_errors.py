"""gunicorn's own error answers as the API's error object: the one place we reach into gunicorn.

gunicorn answers the requests it cannot parse (a request line or headers over its limits, broken
framing) before any app runs, with an HTML page that `gunicorn.util.write_error` writes, and with
a status `Worker.handle_error` picks. gunicorn has no setting or hook for either, so `install()`
replaces `write_error` and wraps `handle_error`, after checking that both still have the shape
the replacements stand in for: a gunicorn that changes them stops the worker at boot, and
tests/test_gunicorn.py fails, instead of clients silently getting HTML or another status again.
Only config/gunicorn.conf.py imports this module; the app never does.
"""

import inspect
import socket
from typing import Any

from gunicorn import util
from gunicorn.http.errors import InvalidHeader, UnsupportedTransferCoding
from gunicorn.workers import base

from animal_store.errors import raw_error_response

# gunicorn.util.write_error's parameters, and the call of it in Worker.handle_error.
EXPECTED_PARAMETERS = ("sock", "status_int", "reason", "mesg")
EXPECTED_CALL = "util.write_error(client, status_int, reason, mesg)"
# Worker.handle_error's parameters, and how it tells an unsupported coding (501).
EXPECTED_HANDLER_PARAMETERS = ("self", "req", "client", "addr", "exc")
EXPECTED_501 = "isinstance(exc, UnsupportedTransferCoding)"

handle_error = base.Worker.handle_error


def write_json_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    # The catalogue's message, never gunicorn's: that may quote what the client sent (a key).
    util.write_nonblock(sock, raw_error_response(status_int))


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
    handle_error(worker, req, client, addr, exc)


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
            "animal_store/gunicorn_errors.py."
        )


def install() -> None:
    """Make gunicorn answer the requests it cannot parse with the error object."""
    check_gunicorn()
    util.write_error = write_json_error
    base.Worker.handle_error = handle_error_as_nginx  # type: ignore[method-assign,assignment]
