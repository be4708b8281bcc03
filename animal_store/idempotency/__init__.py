"""Idempotent creation: a POST retried with the same Idempotency-Key creates at most one animal.

Follows draft-ietf-httpapi-idempotency-key-header. Keys live in the database, so every gunicorn
worker and every instance on the same database sees the same keys. A key is scoped to the request
it was first used with, as the draft has it: its API key, its method and its path. The same key
on another path, or from another API key, is another key: it never replays this one's answer.

The header's grammar is in header.py, the claims on keys in claims.py.

1. Claim: INSERT a row for (API key, method and path, Idempotency-Key) as the first statement of
   the creation's transaction. The unique constraint lets exactly one of several racing requests
   in; the others wait for its transaction a moment, then are answered from its row (or 409).
2. Run the view, which writes in that same transaction (creation_transaction()) and stores its
   answer there (remember()), so the claim, the animal and the answer commit together, once.
3. On any error the transaction rolls back, the claim with it, so a corrected retry with the same
   key works: only successful creations are remembered.

A claim thus lasts exactly as long as its holder's transaction: a worker or an instance killed, a
connection lost or a failover leaves nothing behind, and the retry creates at once (claims.py).
"""

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import orjson
import sqlalchemy as sa
from flask import Response, g, request
from sqlalchemy import Connection

from animal_store import errors
from animal_store.api import Header, declare_errors, declare_parameter
from animal_store.extensions import db
from animal_store.http.body import parse_json
from animal_store.idempotency.claims import RECORDS, Claim, claim, maybe_purge_expired
from animal_store.idempotency.header import KEY_PARAMETER, idempotency_key

STORE_ANSWER = (
    sa.update(RECORDS)
    .where(RECORDS.c.id == sa.bindparam("record_id"))
    .values(
        response_status=sa.bindparam("response_status"),
        response_body=sa.bindparam("response_body"),
        response_location=sa.bindparam("response_location"),
    )
)

IDEMPOTENT_REPLAYED = Header(
    "Idempotent-Replayed",
    "`true` when this is the stored answer to an earlier request with the same "
    "`Idempotency-Key`; nothing was created this time.",
    {"type": "string", "enum": ["true"]},
)


def request_target() -> bytes:
    """Return what scopes a key besides its API key: the request's method and path, hashed.

    The path as routed (request.path), without the query: a key belongs to `/v1/pets/7/photos`,
    not to every animal's photos. Hashed, so the unique index's entries have one small size
    whatever the path's length.
    """
    return target_hash(request.method, request.path)


def target_hash(method: str, path: str) -> bytes:
    # Migration 0007 gives the records stored before it the hash of POST /v1/pets this way.
    return hashlib.sha256(f"{method} {path}".encode()).digest()


def request_fingerprint() -> bytes:
    # Compared as parsed JSON, so key order, spacing and escapes do not count. Parsed as the view
    # parses it: a body it refuses (not JSON, a name twice in an object) is refused by the view
    # anyway (and the claim released), and its bytes, which no parsed body's match, are enough
    # here. Read leniently, a name twice would match the body of its last value.
    body = request.get_data()
    try:
        canonical = orjson.dumps(parse_json(body), option=orjson.OPT_SORT_KEYS)
    except errors.APIError:
        canonical = body
    return hashlib.sha256(canonical).digest()


def idempotent(view: Callable[..., Response]) -> Callable[..., Response]:
    """Run a creating view at most once per Idempotency-Key; replay its answer to retries.

    With the header, the request claims the key as the first statement of a transaction, which
    the view continues and commits in its creation_transaction() block: the claim, the animal
    and the answer commit together or not at all. A request that finds the key taken gets the
    stored answer, or 409 while the first still runs, and the view does not run. Without the
    header the view just runs, and its block is a transaction of its own.
    """

    @wraps(view)
    def once(*args: Any, **kwargs: Any) -> Response:
        key = idempotency_key()
        if key is None:
            return view(*args, **kwargs)
        maybe_purge_expired()
        # Closed at the end, whatever happened: a transaction the view did not commit (it
        # failed, or never wrote) rolls back, the claim with it.
        with db.engine.connect() as connection:
            claimed = claim(connection, g.api_key.id, request_target(), key, request_fingerprint())
            if not isinstance(claimed, Claim):
                return claimed
            g.idempotency_claim = claimed
            return view(*args, **kwargs)

    declare_parameter(once, KEY_PARAMETER)
    return declare_errors(
        once,
        errors.VALIDATION_ERROR,
        errors.IDEMPOTENCY_KEY_IN_USE,
        errors.IDEMPOTENCY_KEY_RACING,
        errors.IDEMPOTENCY_KEY_REUSED,
    )


@contextmanager
def creation_transaction() -> Iterator[Connection]:
    """Give a creating view its transaction, committed when the block ends and rolled back if it
    raises: the one that holds the request's Idempotency-Key, or one of its own without a key."""
    held: Claim | None = g.get("idempotency_claim")
    if held is None:
        with db.engine.begin() as connection:
            yield connection
        return
    yield held.connection
    held.connection.commit()


def remember(connection: Connection, response: Response) -> None:
    """Store the answer for retries in the view's transaction, on its connection, when the
    request holds a key."""
    held: Claim | None = g.get("idempotency_claim")
    if held is None:
        return
    # Ours alone until we commit: a claim in an open transaction cannot be taken over.
    connection.execute(
        STORE_ANSWER,
        {
            "record_id": held.record_id,
            "response_status": response.status_code,
            "response_body": response.get_data(),
            "response_location": response.headers.get("Location"),
        },
    )
