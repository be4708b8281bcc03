"""The Idempotency-Key request header: its grammar, parsed here and stated in the document."""

import re

from flask import request

from animal_store import errors

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
# A Structured Fields string (RFC 8941) as the draft specifies: printable ASCII in quotes, with
# \" and \\ the only escapes. Bare, the same characters without spaces, quotes or backslashes.
BARE_CHARACTER = r"[\x21\x23-\x5b\x5d-\x7e]"
QUOTED_CHARACTER = r'(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])'
BARE_KEY = re.compile(f"{BARE_CHARACTER}+")
QUOTED_KEY = re.compile(f'"({QUOTED_CHARACTER}*)"')
# The same grammar for the document, with the length the service allows.
KEY_PATTERN = (
    f'^(?:{BARE_CHARACTER}{{1,{MAX_KEY_LENGTH}}}|"{QUOTED_CHARACTER}{{1,{MAX_KEY_LENGTH}}}")$'
)
KEY_PARAMETER = {
    "in": "header",
    "name": HEADER,
    "required": False,
    "schema": {"type": "string", "pattern": KEY_PATTERN},
    "description": "draft-ietf-httpapi-idempotency-key-header: 1 to 255 printable ASCII "
    'characters, as a quoted string (`"abc"`) or bare (`abc`, no spaces, quotes or '
    "backslashes). A retry with the same key and body gets the first answer again; kept 24 "
    "hours per API key.",
}


def idempotency_key() -> str | None:
    """Return the request's Idempotency-Key, None without one, or raise if it is malformed."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    value = value.strip(" \t")
    if quoted := QUOTED_KEY.fullmatch(value):
        key = re.sub(r"\\(.)", r"\1", quoted[1])
    elif BARE_KEY.fullmatch(value):
        key = value
    else:
        key = ""
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise errors.VALIDATION_ERROR(
            errors={
                HEADER: ["Must be 1 to 255 printable ASCII characters, bare or as a quoted string."]
            },
            where="header",
            fields=HEADER,
        )
    return key
