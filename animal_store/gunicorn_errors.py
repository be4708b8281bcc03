"""gunicorn's own error answers as the API's error object: the one place we reach into gunicorn.

gunicorn answers the requests it cannot parse (a request line or headers over its limits, broken
framing) before any app runs, with an HTML page that `gunicorn.util.write_error` writes. gunicorn
has no setting or hook for that answer, so `install()` replaces that one function, after checking
that it still has the shape the replacement stands in for: a gunicorn that changes it stops the
worker at boot, and tests/test_gunicorn.py fails, instead of clients silently getting HTML again.
Only config/gunicorn.conf.py imports this module; the app never does.
"""

import inspect
import socket

from gunicorn import util
from gunicorn.workers import base

from animal_store.errors import raw_error_response

# gunicorn.util.write_error's parameters, and the call of it in Worker.handle_error.
EXPECTED_PARAMETERS = ("sock", "status_int", "reason", "mesg")
EXPECTED_CALL = "util.write_error(client, status_int, reason, mesg)"


def write_json_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    # The catalogue's message, never gunicorn's: that may quote what the client sent (a key).
    util.write_nonblock(sock, raw_error_response(status_int))


def check_gunicorn() -> None:
    """Raise unless gunicorn still answers its parse errors through util.write_error."""
    if util.write_error is write_json_error:
        return
    parameters = tuple(inspect.signature(util.write_error).parameters)
    if parameters != EXPECTED_PARAMETERS or EXPECTED_CALL not in inspect.getsource(base.Worker):
        raise RuntimeError(
            "gunicorn no longer answers unparsable requests through "
            f"util.write_error{EXPECTED_PARAMETERS}: update animal_store/gunicorn_errors.py."
        )


def install() -> None:
    """Make gunicorn answer the requests it cannot parse with the error object."""
    check_gunicorn()
    util.write_error = write_json_error
