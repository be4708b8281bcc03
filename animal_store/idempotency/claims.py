"""The claims on Idempotency-Keys: who runs a request, who replays its answer, and when to forget.

A claim is the first statement of the creation's own transaction (idempotent() begins it, the
view's creation_transaction() block commits it), so it counts exactly while its holder can still
finish: a process killed, a connection dropped, a database failed over or restored all end the
transaction or lose it, and with it the claim, which was never committed and never replicated. A
failed view rolls it back with everything else. Nothing is left for a retry to wait out.

A retry while the holder's transaction is open finds its uncommitted unique entry. On PostgreSQL
its INSERT waits for that transaction: at most CLAIM_WAIT_MS (lock_timeout, for that statement
only), then it is answered 409 with Retry-After. When the holder commits first, the INSERT fails
on the unique constraint and the retry replays the answer; when the holder's transaction ends
otherwise, the INSERT goes through and the retry creates. On SQLite every writer waits for the
one ahead of it (the busy timeout): the retry waits for the holder's transaction, then replays
or creates in the same way.

The lease (IDEMPOTENCY_LEASE) is left only for records committed without an answer by the
releases before this one, whose claims had a transaction of their own.
"""

import random
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import sqlalchemy as sa
from flask import Response, current_app
from sqlalchemy import Connection, CursorResult
from sqlalchemy.exc import IntegrityError, OperationalError

from animal_store import errors
from animal_store.data.models import IdempotencyRecord
from animal_store.extensions import db, settings

# How soon a retry should come back while the first request is still running.
RETRY_AFTER = {"Retry-After": "1"}
# How long a retry's claim waits on PostgreSQL for the transaction of a request that holds the
# key before it is answered 409: a creation's transaction takes milliseconds.
CLAIM_WAIT_MS = 100
# How often PostgreSQL checks, while a statement runs (a lock wait included), that the client of
# a transaction holding a claim is still connected: a process killed while its creation waits
# on a lock loses its claim within this, not when the lock is released (PostgreSQL 14 and later).
CLIENT_CHECK_MS = 1000
# PostgreSQL's SQLSTATE for a lock wait cut by lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"

RECORDS = cast("sa.Table", IdempotencyRecord.__table__)
INSERT_CLAIM = sa.insert(RECORDS).returning(RECORDS.c.id)
RECORD_BY_KEY = sa.select(
    RECORDS.c.id,
    RECORDS.c.fingerprint,
    RECORDS.c.claim,
    RECORDS.c.claimed_at,
    RECORDS.c.expires_at,
    RECORDS.c.response_status,
    RECORDS.c.response_body,
    RECORDS.c.response_location,
).where(
    RECORDS.c.api_key_id == sa.bindparam("api_key_id"),
    RECORDS.c.target_hash == sa.bindparam("target_hash"),
    RECORDS.c.key == sa.bindparam("key"),
)
# Transaction-local (set_config's third argument): nothing outlives the transaction, so a
# connection that PgBouncer hands to another client next carries none of it.
BOUNDED_WAIT = sa.text("SELECT set_config('lock_timeout', :wait, true)")
WATCHED_CLIENT = sa.text(
    "SELECT set_config('lock_timeout', :wait, true),"
    " set_config('client_connection_check_interval', :check, true),"
    " set_config('idle_in_transaction_session_timeout', :idle, true)"
)
# Back to the session's value for the rest of the transaction: the holder's own writes may wait
# on locks as long as any other statement may.
UNBOUNDED_WAIT = sa.text("SET LOCAL lock_timeout TO DEFAULT")


@dataclass(frozen=True)
class Claim:
    """Our hold on a record, taken in the transaction on `connection`."""

    connection: Connection
    record_id: int


def claim(
    connection: Connection, api_key_id: int, target: bytes, key: str, fingerprint: bytes
) -> Claim | Response:
    """Claim the key of this API key and request target (method and path) as the first statement
    of the transaction on `connection`, and return the claim; or return the answer for a request
    that finds it taken (the transaction then holds nothing)."""
    now = datetime.now(UTC)
    config = settings(current_app)
    values = {"api_key_id": api_key_id, "target_hash": target, "key": key}
    # A few rounds at most: each one only repeats after another request ended, expired or took
    # over the key between our two statements.
    for _ in range(5):
        try:
            with bounded_wait(connection, first=True):
                record_id: int = connection.execute(
                    INSERT_CLAIM,
                    {
                        **values,
                        "fingerprint": fingerprint,
                        "claim": secrets.token_hex(16),
                        "claimed_at": now,
                        "expires_at": now + timedelta(seconds=config.IDEMPOTENCY_TTL),
                    },
                ).scalar_one()
            return Claim(connection, record_id)
        except IntegrityError as error:
            if not errors.is_unique_violation(error):
                raise
            connection.rollback()  # PostgreSQL's transaction is aborted; SQLite's holds nothing
        existing = connection.execute(RECORD_BY_KEY, values).mappings().one_or_none()
        if existing is None:
            continue  # deleted since, its time up
        if existing["expires_at"] <= now:
            take_over(connection, existing["id"], existing["claim"], None)
            continue
        if existing["fingerprint"] != fingerprint:
            raise errors.IDEMPOTENCY_KEY_REUSED()
        if existing["response_status"] is not None:
            return replay(existing)
        # Committed without an answer: a claim of a release before this one, whose holder may
        # still run (an instance not yet upgraded) or may have died. Only its age tells.
        if now - existing["claimed_at"] < timedelta(seconds=config.IDEMPOTENCY_LEASE):
            raise errors.IDEMPOTENCY_KEY_IN_USE(headers=RETRY_AFTER)
        taken = {"claim": secrets.token_hex(16), "claimed_at": now}
        if take_over(connection, existing["id"], existing["claim"], taken):
            return Claim(connection, existing["id"])
        connection.rollback()
    raise errors.IDEMPOTENCY_KEY_RACING(headers=RETRY_AFTER)


@contextmanager
def bounded_wait(connection: Connection, first: bool = False) -> Iterator[None]:
    """On PostgreSQL, wait at most CLAIM_WAIT_MS for a lock in the block, and answer 409 when a
    claim's holder keeps it longer. The `first` statement of a creation's transaction also has
    the server watch its client, so that a dead client's claim ends soon."""
    if connection.dialect.name != "postgresql":
        yield  # SQLite: the busy timeout is every writer's wait
        return
    wait = f"{CLAIM_WAIT_MS}ms"
    if first and (connection.dialect.server_version_info or ()) >= (14,):
        idle = f"{int(settings(current_app).DATABASE_DEADLINE * 1000)}ms"
        # A holder idle in its transaction past its request's deadline has lost its client (a
        # vanished machine, a partition, which no socket tells): end it.
        connection.execute(
            WATCHED_CLIENT, {"wait": wait, "check": f"{CLIENT_CHECK_MS}ms", "idle": idle}
        )
    else:
        connection.execute(BOUNDED_WAIT, {"wait": wait})
    try:
        yield
    except OperationalError as error:
        if getattr(error.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        connection.rollback()
        raise errors.IDEMPOTENCY_KEY_IN_USE(headers=RETRY_AFTER) from None
    connection.execute(UNBOUNDED_WAIT)


def take_over(
    connection: Connection, record_id: int, token: str, changes: dict[str, Any] | None
) -> bool:
    """Delete the record (`changes` None) or update it, in the transaction on `connection`, if
    nobody changed its claim first; True if we did."""
    mine = (RECORDS.c.id == record_id) & (RECORDS.c.claim == token)
    statement = (
        sa.delete(RECORDS).where(mine)
        if changes is None
        else sa.update(RECORDS).where(mine).values(**changes)
    )
    with bounded_wait(connection):
        done: bool = cast("CursorResult[Any]", connection.execute(statement)).rowcount == 1
    return done


def replay(record: sa.RowMapping) -> Response:
    headers = {"Idempotent-Replayed": "true"}
    if record["response_location"] is not None:
        headers["Location"] = record["response_location"]
    return current_app.response_class(
        record["response_body"], record["response_status"], headers, mimetype="application/json"
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
