"""Idempotent creation: a POST retried with the same Idempotency-Key creates at most one animal.

Follows draft-ietf-httpapi-idempotency-key-header. Keys live in the database, so every gunicorn
worker and every instance on the same database sees the same keys. A key is scoped to the request
it was first used with, as the draft has it: its API key, its method and its path. The same key
on another path, or from another API key, is another key: it never replays this one's answer.

The header's grammar is in header.py, the claims on keys in claims.py.

1. Claim: INSERT a row for (API key, method and path, Idempotency-Key). The unique constraint lets
   exactly one of several racing requests in; the others find its row and are answered from it.
2. Run the view, which stores its answer (remember()) in the same transaction as the animal it
   creates, so a crash leaves either both or neither.
3. On any error the claim is released (the row deleted), so a corrected retry with the same key
   works: only successful creations are remembered.

A claim whose request has not finished within IDEMPOTENCY_LEASE seconds belongs to a worker
that died (gunicorn kills a request after 30 s); the next request with the key takes it over.
"""

import hashlib
from collections.abc import Callable
from functools import wraps
from typing import Any

import orjson
from flask import Response, g, request
from sqlalchemy import Connection

from animal_store import errors
from animal_store.api import Header, declare_errors, declare_parameter
from animal_store.extensions import db
from animal_store.idempotency.claims import RETRY_AFTER, Claim, claim, maybe_purge_expired, release
from animal_store.idempotency.header import KEY_PARAMETER, idempotency_key
from animal_store.models import IdempotencyRecord

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
    # Compared as parsed JSON, so key order, spacing and escapes do not count. A body that is not
    # JSON is refused by the view anyway (and the claim released), its bytes are enough here.
    body = request.get_data()
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        canonical = body
    return hashlib.sha256(canonical).digest()


def idempotent(view: Callable[..., Response]) -> Callable[..., Response]:
    """Run a creating view at most once per Idempotency-Key; replay its answer to retries.

    With the header, the request first claims the key in a transaction of its own; one that finds
    the key taken gets the stored answer, or 409 while the first still runs, and the view does not
    run. The view stores its answer with remember() in its own transaction, so that the animal
    and the answer commit together; if the view fails, the claim is released. Without the header
    the view just runs.
    """

    @wraps(view)
    def once(*args: Any, **kwargs: Any) -> Response:
        key = idempotency_key()
        if key is None:
            return view(*args, **kwargs)
        maybe_purge_expired()
        claimed = claim(g.api_key.id, request_target(), key, request_fingerprint())
        if not isinstance(claimed, Claim):
            return claimed
        g.idempotency_claim = claimed
        try:
            return view(*args, **kwargs)
        except BaseException:
            release(claimed)
            raise

    declare_parameter(once, KEY_PARAMETER)
    return declare_errors(
        once,
        errors.VALIDATION_ERROR,
        errors.IDEMPOTENCY_KEY_IN_USE,
        errors.IDEMPOTENCY_KEY_RACING,
        errors.IDEMPOTENCY_CLAIM_LOST,
        errors.IDEMPOTENCY_KEY_REUSED,
    )


def remember(connection: Connection, response: Response) -> None:
    """Store the answer for retries in the view's transaction, on its connection, when the
    request holds a key."""
    held = g.get("idempotency_claim")
    if held is None:
        return
    # The claim check makes a request that lost its claim (it outlived the lease) create nothing.
    stored = connection.execute(
        db.update(IdempotencyRecord)
        .where(IdempotencyRecord.id == held.record_id, IdempotencyRecord.claim == held.token)
        .values(
            response_status=response.status_code,
            response_body=response.get_data(),
            response_location=response.headers.get("Location"),
        )
    )
    if stored.rowcount != 1:
        raise errors.IDEMPOTENCY_CLAIM_LOST(headers=RETRY_AFTER)
