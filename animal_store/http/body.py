"""Request bodies: JSON objects only, read whole and strictly, or the error that says why not."""

import re
from collections.abc import Iterable
from typing import Any

import orjson
from flask import current_app, request
from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge

from animal_store import errors
from animal_store.current import REQUEST
from animal_store.extensions import settings

# What reading a body can answer, besides the validation of its fields.
BODY_ERRORS = (
    errors.UNSUPPORTED_MEDIA_TYPE,
    errors.EMPTY_BODY,
    errors.INVALID_JSON,
    errors.NOT_AN_OBJECT,
    errors.DUPLICATE_MEMBER,
    errors.TRUNCATED_BODY,
    errors.MALFORMED_BODY,
    errors.REQUEST_TIMEOUT,
    errors.PAYLOAD_TOO_LARGE,
)

# JSON's whitespace (RFC 8259): a body of nothing else is empty, not a JSON error at its end.
JSON_WHITESPACE = b" \t\r\n"
# The one transfer coding and the one expectation the service takes (docs/errors.rst).
CHUNKED = "chunked"
CONTINUE = "100-continue"
# A JSON string, escapes and all (RFC 8259, section 7), and the tokens that nest or name: in a
# text already parsed, every '"' outside a string opens one, so these read it exactly.
STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
STRINGS = re.compile(STRING)
NAMING_TOKENS = re.compile(STRING + rb"|[{}\[\]:]")
# What orjson reads a JSON object and array as; a tuple, as isinstance checks one fastest.
CONTAINERS = (dict, list)


def refuse_unsupported_framing() -> None:
    """Refuse, before any view, a body sent in a way the service does not take: 501 for a
    `Transfer-Encoding` other than chunked alone (RFC 9112, section 6.1), 400 for one in an
    HTTP/1.0 request, which has no transfer codings, and 417 for an `Expect` other than
    100-continue (RFC 9110, section 10.1.1).

    nginx and gunicorn refuse these before the app (config/nginx.conf, serving/worker.py); this
    step gives the same answers where they do not: on the development server, which lets every
    coding and expectation by, and for the `gzip, chunked` gunicorn lets by with the body still
    compressed.
    """
    environ = REQUEST._get_current_object().environ
    coding = environ.get("HTTP_TRANSFER_ENCODING")
    if coding is not None:
        if environ["SERVER_PROTOCOL"] == "HTTP/1.0":
            raise errors.BAD_REQUEST()
        if coding.strip(" \t").lower() != CHUNKED:
            raise errors.NOT_IMPLEMENTED()
    expectation = environ.get("HTTP_EXPECT")
    if expectation is not None and expectation.strip(" \t").lower() != CONTINUE:
        raise errors.EXPECTATION_FAILED()


def json_object_body() -> dict[str, Any]:
    """Return the request body parsed as a JSON object, or raise the error that says why not."""
    if request.mimetype != "application/json":
        raise errors.UNSUPPORTED_MEDIA_TYPE()
    data = whole_body()
    if not data.strip(JSON_WHITESPACE):
        raise errors.EMPTY_BODY()
    body = parse_json(data)
    if not isinstance(body, dict):
        raise errors.NOT_AN_OBJECT()
    return body


def parse_json(data: bytes) -> Any:
    """Return `data` parsed as strict JSON with no name twice in an object (I-JSON, RFC 7493), or
    raise the error that says why not."""
    try:
        # orjson rather than Flask's get_json: it refuses what JSON does not allow (NaN,
        # Infinity, lone surrogates) and is several times faster.
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        # Where, and what JSON asks for: the parser's own words are about its grammar.
        raise errors.INVALID_JSON(line=error.lineno, column=error.colno) from None
    # orjson keeps the last of two members of one name; whatever reads the first (a proxy, a
    # filter in front of the service) would judge another body than the one stored.
    name = repeated_name(data, parsed)
    if name is not None:
        raise errors.DUPLICATE_MEMBER(name=name)
    return parsed


def repeated_name(data: bytes, parsed: Any) -> str | None:
    """Return a member name that an object of the JSON text `data` has twice, or None.

    `parsed` is `data` as orjson read it, where a repeated name left one key. Every member has
    one ':' outside strings, so the objects' keys number as many as those colons exactly when no
    name is repeated. Counting every colon proves it for most bodies at the cost of a count in C
    and a walk of the containers; a body with a colon in a string needs its strings cut out
    first, and only a body with a repeated name is read token by token, to name it.
    """
    keys = key_count(parsed)
    if data.count(b":") == keys or STRINGS.sub(b"", data).count(b":") == keys:
        return None
    return first_repeated_name(data)


def key_count(value: Any) -> int:
    # A loop, not recursion: orjson nests 1024 deep, past Python's default recursion limit.
    count, containers = 0, [value] if isinstance(value, CONTAINERS) else []
    while containers:
        container = containers.pop()
        items: Iterable[Any] = container
        if isinstance(container, dict):
            count += len(container)
            items = container.values()
        for item in items:
            if isinstance(item, CONTAINERS):
                containers.append(item)
    return count


def first_repeated_name(data: bytes) -> str | None:
    # One set of names per open object or array (an array's stays empty), as a stack: the
    # standard library's parser, which could name it too, recurses past its limit at orjson's
    # depth.
    names: list[set[str]] = []
    last_string = b""
    for token in NAMING_TOKENS.findall(data):
        if token in (b"{", b"["):
            names.append(set())
        elif token in (b"}", b"]"):
            names.pop()
        elif token == b":":
            name: str = orjson.loads(last_string)
            if name in names[-1]:
                return name
            names[-1].add(name)
        else:
            last_string = token
    return None


def whole_body() -> bytes:
    """Return the body, refusing one that ended early, stopped coming, or that a chunked upload cut
    at the limit."""
    try:
        data = request.get_data(cache=True)
    except (TimeoutError, ClientDisconnected) as error:
        # The worker's read of the client waited REQUEST_BODY_TIMEOUT (serving/worker.py): raised
        # as it is from a chunked body, and as the cause of a ClientDisconnected from one of a
        # known length, which Werkzeug reads through its LimitedStream.
        if not isinstance(error, TimeoutError) and not isinstance(error.__context__, TimeoutError):
            raise
        timeout = settings(current_app).REQUEST_BODY_TIMEOUT
        raise errors.REQUEST_TIMEOUT(seconds=f"{timeout:g}") from None
    # Behind gunicorn (wsgi.input_terminated) Werkzeug reads to the end of the stream and does not
    # compare with Content-Length: a client that stopped early would have a cut body parsed.
    if request.content_length is not None and len(data) < request.content_length:
        raise errors.TRUNCATED_BODY(received=len(data), expected=request.content_length)
    # Werkzeug stops a chunked body (no Content-Length) at the limit without complaint; a body
    # that fills the limit is refused rather than parsed cut short.
    if request.content_length is None and len(data) >= settings(current_app).MAX_CONTENT_LENGTH:
        raise RequestEntityTooLarge()
    return data
