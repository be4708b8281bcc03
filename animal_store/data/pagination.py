"""Keyset pagination for listPets: opaque cursors and the RFC 8288 `Link: rel="next"` header.

A cursor holds the last id a page showed and the filters of its walk (filters.py). The next page is
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
from animal_store.data.filters import LIST_FILTER_NAMES, LIST_FILTERS, Walk
from animal_store.links import absolute_url

# The payload is "1.<last id>" and then ".<value>" for each filter, in LIST_FILTERS' order, empty
# where the walk is not filtered by it; the filters after the last one given are left out. So a
# cursor of a walk without a filter added since is the one the release before made, and the
# two take each other's cursors during a rollout; a filter only ever appended, the version stays.
CURSOR_VERSION = "1"
CHECKSUM_SIZE = 8
LAST_ID = re.compile(r"0|[1-9][0-9]{0,18}")
LONGEST_PAYLOAD = len(f"{CURSOR_VERSION}.{2**63 - 1}") + sum(
    1 + max(map(len, list_filter.choices)) for list_filter in LIST_FILTERS
)
# A longer cursor can only be garbage, so it is refused before decoding. The cap follows from the
# filters (base64 of the longest payload and its checksum), never below the 64 the releases before
# documented, so the served pattern only ever widens.
MAX_CURSOR_LENGTH = max(64, -(-(LONGEST_PAYLOAD + CHECKSUM_SIZE) * 4 // 3))
CURSOR_SYNTAX = rf"[A-Za-z0-9_-]{{1,{MAX_CURSOR_LENGTH}}}"
CURSOR_TEXT = re.compile(CURSOR_SYNTAX)


@dataclass(frozen=True)
class Position:
    """Where a walk stands: after `last_id`, among the animals its filters keep."""

    last_id: int
    walk: Walk


def checksum(payload: bytes) -> bytes:
    # Catches truncated, garbled and hand-edited cursors. It is not a secret: a forged cursor
    # only names a position in a list the client may read anyway.
    return hashlib.blake2b(payload, digest_size=CHECKSUM_SIZE, person=b"animal-cursor").digest()


def encode_cursor(position: Position) -> str:
    values = [value or "" for value in position.walk]
    # The first filter is always written: the first release's cursors always had it.
    while len(values) > 1 and not values[-1]:
        values.pop()
    payload = ".".join([CURSOR_VERSION, str(position.last_id), *values]).encode()
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
    version, last_id, *values = payload.decode("ascii", errors="replace").split(".")
    if (
        version != CURSOR_VERSION
        or not LAST_ID.fullmatch(last_id)
        or int(last_id) >= 2**63
        or not 1 <= len(values) <= len(LIST_FILTERS)
        # Only as encode_cursor writes it: no unfiltered value after the first.
        or (len(values) > 1 and not values[-1])
        or any(
            value and value not in list_filter.choices
            for value, list_filter in zip(values, LIST_FILTERS, strict=False)
        )
    ):
        raise ValueError("not a cursor")
    walk = [value or None for value in values] + [None] * (len(LIST_FILTERS) - len(values))
    return Position(int(last_id), tuple(walk))


def next_page_query(last_id: int, limit: int, walk: Walk) -> str:
    """Return the query of the URL of the page after `last_id`: the same for every client."""
    filters = zip(LIST_FILTER_NAMES, walk, strict=True)
    query = {"limit": limit, **dict(filters), "cursor": encode_cursor(Position(last_id, walk))}
    return urlencode({name: value for name, value in query.items() if value is not None})


def next_page_link(query: str) -> str:
    """Return the Link header value: the list's own absolute URL, on the deployment's own address
    (links.py), with the next page's query."""
    served = REQUEST._get_current_object()
    return f'<{absolute_url(served.root_path + served.path)}?{query}>; rel="next"'
