"""Health probes for load balancers and orchestrators, outside /v1 and without authentication."""

from flask import Blueprint, current_app, g
from sqlalchemy.exc import SQLAlchemyError

from animal_store.access import rate_limits
from animal_store.data.database_faults import log_outage
from animal_store.data.deadlines import shorten_deadline
from animal_store.data.readiness import OK, READ_ONLY, READS_ONLY, write_state
from animal_store.data.standbys import serve_without_primary
from animal_store.errors import (
    DATABASE_READ_ONLY,
    OUTAGE_REASONS,
    database_refusal,
    outage_kind,
    report_outage,
)
from animal_store.extensions import settings

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> tuple[dict[str, str], int]:
    """Answer as long as the process can serve a request; the database is not consulted."""
    return {"status": "ok"}, 200


@bp.get("/readyz")
def readyz() -> tuple[dict[str, str], int]:
    """Answer 200 when the database answers and takes writes, else 503 within a bounded time,
    its message saying why: the database is unavailable, takes no writes, or refuses the
    service's login.

    And what becomes of writes, as the database answers this probe now (data/readiness.py), the
    same from every worker: "ok"; "disk full" (no space left for writes) or "waiting for a
    synchronous standby" (a commit waits for a standby that is not there), the status then
    "degraded". Neither makes the instance unready: it still serves reads, and every instance
    shares the disk or the PostgreSQL server, so a load balancer that took them all out would
    stop the reads too.

    With standbys (DATABASE_READ_URL), a primary that does not answer while the standbys serve
    the reads without it (data/without_primary.py) is 200 too, "degraded", the database
    "reads only: no primary": the instance serves every read and no creation, as every other
    instance does then.

    The answer also says how rate limits are counted: "shared" (the configured limit holds),
    "per process" (each worker counts apart), "storage unreachable" (each worker counts apart
    until Redis answers again: the status is then "degraded") or "off". None of them makes the
    instance unready: it serves either way, and Redis costs the answer its socket timeout (0.1 s)
    at most.
    """
    seconds = settings(current_app).READYZ_TIMEOUT
    try:
        # Its own deadline, enforced from the client as every request's is: a stalled server would
        # never enforce a statement_timeout. Running past it holds no other request back.
        shorten_deadline(seconds)
        database = write_state(seconds)
    except SQLAlchemyError as error:
        if serve_without_primary(seconds):
            # Reads are served, creations are not: not ready for all, nor to be taken out.
            counting = rate_limits.counting(current_app)
            return {"status": "degraded", "database": READS_ONLY, "rateLimits": counting}, 200
        # Logged and counted as a request's refusal is: a refused login at ERROR, naming it.
        kind = outage_kind(error)
        report_outage(kind, getattr(error, "orig", None) or error)
        raise database_refusal(kind) from None
    if database == READ_ONLY:
        reason = g.database_refusal = OUTAGE_REASONS[DATABASE_READ_ONLY]
        # As the requests' refusals: once a minute, not at every probe of the load balancer.
        log_outage(reason, "Readiness check failed: the database takes no writes")
        raise database_refusal(DATABASE_READ_ONLY)
    counting = rate_limits.counting(current_app)
    status = "ok" if database == OK and counting != rate_limits.UNREACHABLE else "degraded"
    return {"status": status, "database": database, "rateLimits": counting}, 200
