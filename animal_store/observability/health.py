"""Health probes for load balancers and orchestrators, outside /v1 and without authentication."""

from flask import Blueprint, current_app, g
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from animal_store.access import rate_limits
from animal_store.data.database_faults import disk_full, log_outage
from animal_store.data.deadlines import shorten_deadline
from animal_store.errors import (
    DATABASE_READ_ONLY,
    OUTAGE_REASONS,
    database_refusal,
    outage_kind,
    report_outage,
)
from animal_store.extensions import db, settings

bp = Blueprint("health", __name__)
# "on" in a hot standby's transactions, and in a database's with default_transaction_read_only.
READ_ONLY = text("SELECT current_setting('transaction_read_only')")


@bp.get("/healthz")
def healthz() -> tuple[dict[str, str], int]:
    """Answer as long as the process can serve a request; the database is not consulted."""
    return {"status": "ok"}, 200


@bp.get("/readyz")
def readyz() -> tuple[dict[str, str], int]:
    """Answer 200 when the database answers and takes writes, else 503 within a bounded time,
    its message saying why: the database is unavailable, takes no writes, or refuses the
    service's login.

    The answer also says how rate limits are counted: "shared" (the configured limit holds),
    "per process" (each worker counts apart), "storage unreachable" (each worker counts apart
    until Redis answers again: the status is then "degraded") or "off". None of them makes the
    instance unready: it serves either way, and Redis costs the answer its socket timeout (0.1 s)
    at most.

    And what the database does: "ok", or "disk full" when this worker's last write found no space
    left (the status is then "degraded"). A full disk does not make the instance unready either:
    it still serves reads, and every instance shares the disk (or the PostgreSQL server), so a
    load balancer that took them all out would stop the reads too.
    """
    try:
        takes_writes = check_database()
    except SQLAlchemyError as error:
        db.session.rollback()
        # Logged and counted as a request's refusal is: a refused login at ERROR, naming it.
        kind = outage_kind(error)
        report_outage(kind, getattr(error, "orig", None) or error)
        raise database_refusal(kind) from None
    if not takes_writes:
        reason = g.database_refusal = OUTAGE_REASONS[DATABASE_READ_ONLY]
        # As the requests' refusals: once a minute, not at every probe of the load balancer.
        log_outage(reason, "Readiness check failed: the database takes no writes")
        raise database_refusal(DATABASE_READ_ONLY)
    counting = rate_limits.counting(current_app)
    database = "disk full" if disk_full() else "ok"
    status = "ok" if database == "ok" and counting != rate_limits.UNREACHABLE else "degraded"
    return {"status": status, "database": database, "rateLimits": counting}, 200


def check_database() -> bool:
    """Ask the database whether it takes writes: a standby, or a primary set read-only, does not
    (SQLite always does)."""
    # Its own deadline, enforced from the client as every request's is: a stalled server would
    # never enforce a statement_timeout. Running past it holds no other request back.
    shorten_deadline(settings(current_app).READYZ_TIMEOUT)
    if db.engine.dialect.name == "postgresql":
        takes_writes: bool = db.session.scalar(READ_ONLY) == "off"
    else:
        db.session.execute(text("SELECT 1"))
        takes_writes = True
    db.session.rollback()
    return takes_writes
