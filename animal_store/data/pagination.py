"""Keyset pagination for listPets: opaque cursors and the RFC 8288 `Link: rel="next"` header.

A cursor holds the last id a page showed and the status filter of its walk. The next page is
`WHERE id > last_id ORDER BY id`, which an index seeks to directly (the primary key, or
ix_pets_status_id with a status), so a page deep in the list costs what the first one does. And
because ids only grow, a walk sees every animal that existed when it started exactly once, however
many are added meanwhile.
"""

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass
from urllib.parse import urlencode

from animal_store.current import REQUEST
from animal_store.data.models import PET_STATUSES
from animal_store.links import absolute_url

CURSOR_VERSION = "1"
CHECKSUM_SIZE = 8
# The payload is short; a long cursor can only be garbage, so it is refused before decoding.
MAX_CURSOR_LENGTH = 64
CURSOR_SYNTAX = rf"[A-Za-z0-9_-]{{1,{MAX_CURSOR_LENGTH}}}"
CURSOR_TEXT = re.compile(CURSOR_SYNTAX)
PAYLOAD = re.compile(rf"{CURSOR_VERSION}\.(0|[1-9][0-9]{{0,18}})\.({'|'.join(PET_STATUSES)}|)")


@dataclass(frozen=True)
class Position:
    """Where a walk stands: after `last_id`, among the animals with `status` (None: all)."""

    last_id: int
    status: str | None


def checksum(payload: bytes) -> bytes:
    # Catches truncated, garbled and hand-edited cursors. It is not a secret: a forged cursor
    # only names a position in a list the client may read anyway.
    return hashlib.blake2b(payload, digest_size=CHECKSUM_SIZE, person=b"animal-cursor").digest()


def encode_cursor(position: Position) -> str:
    payload = f"{CURSOR_VERSION}.{position.last_id}.{position.status or ''}".encode()
    return base64.urlsafe_b64encode(payload + checksum(payload)).rstrip(b"=").decode()


def decode_cursor(cursor: str) -> Position:
    """Return the position a cursor names; ValueError if it is not one this service made."""
    if not CURSOR_TEXT.fullmatch(cursor):
        raise ValueError("not a cursor")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    except ValueError:
        raise ValueError("not a cursor") from None
    payload, received = raw[:-CHECKSUM_SIZE], raw[-CHECKSUM_SIZE:]
    if len(raw) <= CHECKSUM_SIZE or not hmac.compare_digest(received, checksum(payload)):
        raise ValueError("not a cursor")
    match = PAYLOAD.fullmatch(payload.decode("ascii", errors="replace"))
    if match is None or int(match[1]) >= 2**63:
        raise ValueError("not a cursor")
    return Position(int(match[1]), match[2] or None)


def next_page_query(last_id: int, limit: int, status: str | None) -> str:
    """Return the query of the URL of the page after `last_id`: the same for every client."""
    query = {"limit": limit, "status": status, "cursor": encode_cursor(Position(last_id, status))}
    return urlencode({name: value for name, value in query.items() if value is not None})


def next_page_link(query: str) -> str:
    """Return the Link header value: the list's own absolute URL, on the deployment's own address
    (links.py), with the next page's query."""
    served = REQUEST._get_current_object()
    return f'<{absolute_url(served.root_path + served.path)}?{query}>; rel="next"'
