"""Idempotent creation: a POST retried with the same Idempotency-Key creates at most one animal.

Follows draft-ietf-httpapi-idempotency-key-header. Keys live in the database, scoped to the API
key, so every gunicorn worker and every instance on the same database sees the same keys:

1. Claim: INSERT a row for (API key, Idempotency-Key). The unique constraint lets exactly one of
   several racing requests in; the others find its row and are answered from it.
2. Run the view, and store its answer in the same transaction as the animal it created, so a
   crash leaves either both or neither.
3. On any error the claim is released (the row deleted), so a corrected retry with the same key
   works: only successful creations are remembered.

A claim whose request has not finished within IDEMPOTENCY_LEASE seconds belongs to a worker
that died (gunicorn kills a request after 30 s); the next request with the key takes it over.
"""

import hashlib
import random
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import wraps

import click
import orjson
from flask import current_app, g, make_response, request
from flask.cli import AppGroup
from sqlalchemy.exc import IntegrityError

from animal_store import errors
from animal_store.api import Header
from animal_store.extensions import db
from animal_store.models import IdempotencyRecord

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
IDEMPOTENT_REPLAYED = Header(
    "Idempotent-Replayed",
    "`true` when this is the stored answer to an earlier request with the same "
    "`Idempotency-Key`; nothing was created this time.",
    {"type": "string", "enum": ["true"]},
)
# How soon a retry should come back while the first request is still running.
RETRY_AFTER = {"Retry-After": "1"}


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


def request_fingerprint() -> bytes:
    # Compared as parsed JSON, so key order, spacing and escapes do not count. A body that is not
    # JSON is refused by the view anyway (and the claim released), its bytes are enough here.
    body = request.get_data()
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        canonical = body
    return hashlib.sha256(canonical).digest()


@dataclass(frozen=True)
class Claim:
    """Our hold on a record: plain values, so they outlive the rollback of a failed view."""

    record_id: int
    token: str


def idempotent(view):
    """Run a creating view at most once per Idempotency-Key, and commit its work.

    The view adds and flushes what it creates; this commits it, together with the stored answer
    when the request has a key. Without the header the view runs and commits as usual.
    """

    @wraps(view)
    def once(*args, **kwargs):
        key = idempotency_key()
        if key is None:
            response = make_response(view(*args, **kwargs))
            db.session.commit()
            return response
        maybe_purge_expired()
        claimed = claim(g.api_key_id, key, request_fingerprint())
        if not isinstance(claimed, Claim):
            return claimed
        try:
            response = make_response(view(*args, **kwargs))
            complete(claimed, response)
        except BaseException:
            release(claimed)
            raise
        return response

    return once


def claim(api_key_id: int, key: str, fingerprint: bytes):
    """Return our claim on the key, or the answer for a request that finds it taken."""
    now = datetime.now(UTC)
    settings = current_app.config
    # A few rounds at most: each one only repeats after another request released, expired or
    # took over the key between our two statements.
    for _ in range(5):
        token = secrets.token_hex(16)
        record = IdempotencyRecord(
            api_key_id=api_key_id,
            key=key,
            fingerprint=fingerprint,
            claim=token,
            claimed_at=now,
            expires_at=now + timedelta(seconds=settings["IDEMPOTENCY_TTL"]),
        )
        db.session.add(record)
        try:
            db.session.flush()
            held = Claim(record.id, token)
            db.session.commit()
            return held
        except IntegrityError:
            db.session.rollback()
        existing = db.session.scalar(
            db.select(IdempotencyRecord).where(
                IdempotencyRecord.api_key_id == api_key_id, IdempotencyRecord.key == key
            )
        )
        if existing is None:
            continue
        held = Claim(existing.id, existing.claim)
        if existing.expires_at <= now:
            take_over(held, delete=True)
            continue
        if existing.fingerprint != fingerprint:
            raise errors.IDEMPOTENCY_KEY_REUSED()
        if existing.response_status is not None:
            return replay(existing)
        if now - existing.claimed_at < timedelta(seconds=settings["IDEMPOTENCY_LEASE"]):
            raise errors.IDEMPOTENCY_KEY_IN_USE(headers=RETRY_AFTER)
        # Abandoned by a worker that died mid-request: nothing of it was committed.
        token = secrets.token_hex(16)
        if take_over(held, claim=token, claimed_at=now):
            return Claim(held.record_id, token)
    raise errors.IDEMPOTENCY_KEY_RACING(headers=RETRY_AFTER)


def take_over(held: Claim, delete=False, **changes) -> bool:
    """Delete or update the record if nobody else changed its claim first; True if we did."""
    mine = (IdempotencyRecord.id == held.record_id) & (IdempotencyRecord.claim == held.token)
    if delete:
        statement = db.delete(IdempotencyRecord).where(mine)
    else:
        statement = db.update(IdempotencyRecord).where(mine).values(**changes)
    statement = statement.execution_options(synchronize_session=False)
    done = db.session.execute(statement).rowcount == 1
    db.session.commit()
    return done


def complete(held: Claim, response) -> None:
    # In the view's transaction: the animal and the answer that replays it commit together. The
    # claim check makes a request that lost its claim (it outlived the lease) create nothing.
    stored = db.session.execute(
        db.update(IdempotencyRecord)
        .where(IdempotencyRecord.id == held.record_id, IdempotencyRecord.claim == held.token)
        .values(
            response_status=response.status_code,
            response_body=response.get_data(),
            response_location=response.headers.get("Location"),
        )
        .execution_options(synchronize_session=False)
    )
    if stored.rowcount != 1:
        raise errors.IDEMPOTENCY_CLAIM_LOST(headers=RETRY_AFTER)
    db.session.commit()


def release(held: Claim) -> None:
    db.session.rollback()
    take_over(held, delete=True)


def replay(record: IdempotencyRecord):
    headers = {"Idempotent-Replayed": "true"}
    if record.response_location is not None:
        headers["Location"] = record.response_location
    return current_app.response_class(
        record.response_body, record.response_status, headers, mimetype="application/json"
    )


def purge_expired() -> int:
    """Delete the records whose time is up and return how many there were."""
    deleted = db.session.execute(
        db.delete(IdempotencyRecord).where(IdempotencyRecord.expires_at <= datetime.now(UTC))
    ).rowcount
    db.session.commit()
    return deleted


def maybe_purge_expired() -> None:
    # Now and then, on the requests that add records, so the table stays small without a cron
    # job; `flask idempotency purge` does the same on demand.
    if random.random() < current_app.config["IDEMPOTENCY_PURGE_CHANCE"]:
        purge_expired()


idempotency_cli = AppGroup("idempotency", help="Look after the stored Idempotency-Keys.")


@idempotency_cli.command("purge")
def purge_command():
    """Delete the Idempotency-Keys older than IDEMPOTENCY_TTL."""
    click.echo(f"Purged {purge_expired()} expired idempotency keys.")
