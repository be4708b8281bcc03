"""The claims on Idempotency-Keys: who runs a request, who replays its answer, and when to forget.

Each function runs its own short transaction on the session: a claim must be committed before
the view runs, so that racing requests see it, and released after a failed view, whose own
transaction (on a connection of its own, store.py) has rolled back by then.
"""

import random
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from flask import Response, current_app
from sqlalchemy import CursorResult
from sqlalchemy.exc import IntegrityError

from animal_store import errors
from animal_store.extensions import db, settings
from animal_store.models import IdempotencyRecord

# How soon a retry should come back while the first request is still running.
RETRY_AFTER = {"Retry-After": "1"}


@dataclass(frozen=True)
class Claim:
    """Our hold on a record: plain values, so they outlive the rollback of a failed view."""

    record_id: int
    token: str


def claim(api_key_id: int, target: bytes, key: str, fingerprint: bytes) -> Claim | Response:
    """Return our claim on the key of this API key and request target (method and path), or the
    answer for a request that finds it taken."""
    now = datetime.now(UTC)
    config = settings(current_app)
    # A few rounds at most: each one only repeats after another request released, expired or
    # took over the key between our two statements.
    for _ in range(5):
        token = secrets.token_hex(16)
        record = IdempotencyRecord(
            api_key_id=api_key_id,
            target_hash=target,
            key=key,
            fingerprint=fingerprint,
            claim=token,
            claimed_at=now,
            expires_at=now + timedelta(seconds=config.IDEMPOTENCY_TTL),
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
                IdempotencyRecord.api_key_id == api_key_id,
                IdempotencyRecord.target_hash == target,
                IdempotencyRecord.key == key,
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
        if now - existing.claimed_at < timedelta(seconds=config.IDEMPOTENCY_LEASE):
            raise errors.IDEMPOTENCY_KEY_IN_USE(headers=RETRY_AFTER)
        # Abandoned by a worker that died mid-request: nothing of it was committed.
        token = secrets.token_hex(16)
        if take_over(held, claim=token, claimed_at=now):
            return Claim(held.record_id, token)
    raise errors.IDEMPOTENCY_KEY_RACING(headers=RETRY_AFTER)


def take_over(held: Claim, delete: bool = False, **changes: Any) -> bool:
    """Delete or update the record if nobody else changed its claim first; True if we did."""
    mine = (IdempotencyRecord.id == held.record_id) & (IdempotencyRecord.claim == held.token)
    if delete:
        statement = db.delete(IdempotencyRecord).where(mine)
    else:
        statement = db.update(IdempotencyRecord).where(mine).values(**changes)
    statement = statement.execution_options(synchronize_session=False)
    # A DML statement's result: a CursorResult, which has a rowcount.
    done = cast("CursorResult[Any]", db.session.execute(statement)).rowcount == 1
    db.session.commit()
    return done


def release(held: Claim) -> None:
    db.session.rollback()
    take_over(held, delete=True)


def replay(record: IdempotencyRecord) -> Response:
    headers = {"Idempotent-Replayed": "true"}
    if record.response_location is not None:
        headers["Location"] = record.response_location
    return current_app.response_class(
        record.response_body, record.response_status, headers, mimetype="application/json"
    )


def purge_expired() -> int:
    """Delete the records whose time is up and return how many there were."""
    deleted: int = cast(
        "CursorResult[Any]",
        db.session.execute(
            db.delete(IdempotencyRecord).where(IdempotencyRecord.expires_at <= datetime.now(UTC))
        ),
    ).rowcount
    db.session.commit()
    return deleted


def maybe_purge_expired() -> None:
    # Now and then, on the requests that add records, so the table stays small without a cron
    # job; `flask idempotency purge` does the same on demand.
    if random.random() < settings(current_app).IDEMPOTENCY_PURGE_CHANCE:
        purge_expired()
