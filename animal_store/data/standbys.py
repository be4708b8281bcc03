"""Reads on the standbys (DATABASE_READ_URL): listPets and getPet served by a streaming standby
whenever that is safe, by the primary otherwise; never a world older than the client's writes.

Safety is a position in the primary's WAL, never a time, and it needs no state per client:

- An animal never changes once created (answers.py), so one a standby has is the primary's. One
  it lacks may be a creation it has not replayed yet: the primary says whether it exists
  ("not_found"). So a client finds its own creation by id at once, whatever the lag.
- A page shows the rows its app knows settled (keyset.py), from a standby that has replayed the
  position that holds them all; the walk's last page, from one that has replayed where the
  primary's WAL stands now, so it holds every creation acknowledged before the walk began, the
  client's own included (store.page_on_standby has the argument).

A standby is checked on the very connection that will read, in a statement of its own before the
read: still in recovery, replayed up to the position the read needs, lagging at most
DATABASE_READ_MAX_LAG. The standbys' engine runs each statement in its own transaction
(AUTOCOMMIT), so the read's snapshot is taken after a replay that holds the position. (In the same
statement, or the same transaction under REPEATABLE READ, the position would be read after the
snapshot was taken: the wrong way round.) Anything else sends the read to the primary, its reason
counted (metrics.py):

- "walk": the standby has not replayed the position a page needs;
- "lag": it lags past DATABASE_READ_MAX_LAG, or cannot tell its lag;
- "promoted": it is a primary now (its connection is dropped);
- "down": it refused, failed or ran past its share of the request's deadline (STANDBY_SHARE):
  then for RETRY_INTERVAL this process sends every read to the primary without trying, so a
  standby that fails costs one request a worker, not each (one that hangs, the engine's deadline
  Backoff skips for a second too: deadlines.py);
- "not_found": the animal is not on the standby (yet).

A standby that does not stream the primary's timeline serves nothing ("lag", "timeline"), but for
one: after a failover, the standby left on the timeline before, until it follows the promoted one
(seconds, under Patroni), where it holds no WAL the promoted one lacked (left_behind).

A connection stays on one server for its life, whatever a host list or HAProxy balances, so the
checked server is the one read, and what a connection last saw replayed (REPLAYED) spares the
check while it holds the position and was checked within CHECK_EVERY: a lag or a promotion is
seen within that second.
"""

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from flask import Flask, current_app, g
from prometheus_client import Gauge
from sqlalchemy.exc import SQLAlchemyError

from animal_store.data.database_faults import first_line
from animal_store.data.deadlines import time_left, watch_engine
from animal_store.data.failover import primary_host, primary_timeline, primary_timeline_age
from animal_store.data.keyset import Position
from animal_store.data.without_primary import StandbyHosts, Unproven
from animal_store.extensions import settings
from animal_store.settings import read_database_uri

STATE = "animal_store_standbys"
# At most this share of what is left of a request's deadline goes to a standby: the primary has
# the rest, so a hung standby costs the request a slower answer, not a 503.
STANDBY_SHARE = 0.5
# Seconds a process sends every read to the primary after a standby failed.
RETRY_INTERVAL = 2.0
# Seconds a connection's last check stands for a read that needs no newer position.
CHECK_EVERY = 1.0
# Where a connection keeps the highest position its server was seen to have replayed, and when
# its last check passed: its pool entry's info, which SQLAlchemy empties whenever the entry
# connects again (perhaps to another server), so it lives exactly as long as the connection.
REPLAYED, CHECKED_AT = "animal_store_replayed", "animal_store_checked_at"
# What the standby says of itself: in recovery; its replay and receive positions; its lag;
# whether its WAL receiver runs, streams, and on which timeline (pg_stat_wal_receiver has a row
# while the receiver runs; its status and timeline are shown only to a role with
# pg_read_all_stats).
# The lag: 0 for a standby that streams and has replayed all it received (an idle primary sends
# nothing, and its last commit's time would read as lag), else the age of the last transaction it
# replayed: one that does not stream (cut off from the primary, which may be writing on) has
# replayed all it received too, and is as old as its last transaction.
CHECK = sa.text(
    "SELECT pg_is_in_recovery(), (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint, "
    "(pg_last_wal_receive_lsn() - '0/0'::pg_lsn)::bigint, "
    "CASE WHEN pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn() "
    "AND receiver.status = 'streaming' THEN 0 "
    "ELSE extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8 END, "
    "receiver.pid IS NOT NULL, receiver.status = 'streaming', receiver.received_tli "
    "FROM (SELECT) AS here LEFT JOIN pg_stat_wal_receiver AS receiver ON true"
)
REASONS = ("walk", "lag", "promoted", "timeline", "down", "not_found")
# Said once a process: a role that cannot see whether its standbys stream reads nothing there.
HIDDEN = (
    "The standbys do not show DATABASE_READ_URL's role whether they stream from the primary, "
    "so every read goes to the primary: GRANT pg_read_all_stats TO %s, on the primary"
)

LAG = Gauge(
    "animal_store_standby_lag_seconds",
    "The replay lag of the standby a worker last checked, as it saw it (-1: unknown).",
    multiprocess_mode="livemax",
)
LOG = logging.getLogger("animal_store.data.standbys")

Rows = TypeVar("Rows")


class SentBack(Exception):  # noqa: N818 - not an error: a decision
    """The read goes to the primary, for `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PrimaryFailedError(Exception):
    """A failure of the primary met during a read on a standby: it is the primary's, as if the
    read had been made there (raised again as it came)."""

    def __init__(self, error: SQLAlchemyError) -> None:
        super().__init__(str(error))
        self.error = error


class Standbys:
    """The standbys' engine and what this process knows of them."""

    def __init__(self, app: Flask, url: str) -> None:
        config = settings(app)
        self.max_lag = config.DATABASE_READ_MAX_LAG
        # The primary's pool size, deadlines and timeouts; no transactions (the module's docs).
        self.engine = sa.create_engine(
            url, **{**app.config["SQLALCHEMY_ENGINE_OPTIONS"], "isolation_level": "AUTOCOMMIT"}
        )
        watch_engine(self.engine, "standby_deadline")
        self.paused_until = 0.0
        self.hidden_said = False
        # The WAL each host was last seen to have on disk (received), by its host and port, on
        # the timeline it streamed then: a standby left behind by a promotion serves by it
        # (left_behind). Written by the checks and by the reads without the primary.
        self.received: dict[str, Position] = {}
        # Each standby on its own, for the reads the primary cannot answer.
        self.without_primary = StandbyHosts(app, url, self.received)

    def read(
        self, at_least: Position | None, behind: str, read: Callable[[sa.Connection], Rows]
    ) -> Rows | None:
        """Return what `read` reads on a standby that has replayed `at_least` (else the reason
        is `behind`; None: it follows the primary's timeline, whatever it has replayed), or
        None when it must be read on the primary (the reason noted)."""
        now = time.monotonic()
        if now < self.paused_until:
            sent_back("down")
            return None
        left = time_left()
        if left is not None:
            g.standby_deadline = now + left * STANDBY_SHARE
        try:
            with self.engine.connect() as connection:
                self.require(connection, at_least, behind)
                rows = read(connection)
        except SentBack as refusal:
            sent_back(refusal.reason)
            return None
        except PrimaryFailedError as failed:
            raise failed.error from None
        except SQLAlchemyError as error:
            # Once a pause at most: the next try comes after it.
            LOG.warning(
                "A standby failed; reads go to the primary for %g s: %s",
                RETRY_INTERVAL,
                first_line(getattr(error, "orig", None) or error),
            )
            self.paused_until = time.monotonic() + RETRY_INTERVAL
            sent_back("down")
            return None
        finally:
            g.pop("standby_deadline", None)
        g.database_read = "standby"
        return rows

    def require(self, connection: sa.Connection, at_least: Position | None, behind: str) -> None:
        """Raise SentBack unless the connection's server is a standby within the lag bound,
        streaming on the primary's timeline, that has replayed `at_least` (None: the timeline
        the worker last saw the primary on, failover.py); ask it only when what it last said
        does not answer."""
        if at_least is None:
            timeline = primary_timeline()
            if timeline is None:
                raise SentBack("timeline")  # not asked yet: none is known to follow it
            at_least = Position(timeline, 0)
        info = connection.info
        now = time.monotonic()
        seen: Position | None = info.get(REPLAYED)
        if (
            seen is not None
            and seen.timeline == at_least.timeline
            and seen.lsn >= at_least.lsn
            and now - info.get(CHECKED_AT, -CHECK_EVERY) < CHECK_EVERY
        ):
            return
        info.pop(CHECKED_AT, None)
        recovering, replayed, received, lag, receiving, streaming, timeline = connection.execute(
            CHECK
        ).one()
        if not recovering:
            connection.invalidate()
            raise SentBack("promoted")
        if receiving and streaming is None:
            self.say_hidden(connection)
            raise SentBack("lag")
        LAG.set(-1 if lag is None else lag)
        host = host_of(connection)
        if streaming and host is not None:
            self.received[host] = Position(timeline, received)
        if not (streaming and timeline == at_least.timeline) and self.left_behind(
            host, received, at_least.timeline
        ):
            timeline = at_least.timeline  # what it has, the primary's timeline has too
        elif not streaming or lag is None or lag > self.max_lag:
            raise SentBack("lag")
        # A server's replay only moves forward, on the timeline it streams.
        info[REPLAYED] = Position(timeline, replayed)
        info[CHECKED_AT] = now
        # One that streams another timeline than the primary's: the old one, before it follows
        # a new primary, or forever, where it replayed WAL the new one never had.
        if timeline != at_least.timeline:
            raise SentBack("timeline")
        if replayed < at_least.lsn:
            raise SentBack(behind)

    def left_behind(self, host: str | None, received: int | None, timeline: int) -> bool:
        """Whether a standby that does not stream the primary's `timeline` has only WAL that the
        timeline has too, within DATABASE_READ_MAX_LAG of when this worker first saw the primary
        on it: the standby that stays, in the seconds a failover takes it to follow the promoted
        one (issue 56).

        A standby that is promoted replays all it received before its timeline begins, so the
        new timeline holds every position of the one before up to what the promoted host was
        last seen to have received on it. A standby seen streaming that timeline before, which
        has received no further, holds the new primary's WAL up to where it replayed: its
        animals are the primary's, and a page's position on the new timeline is held if it has
        replayed that far. One that received further (WAL the promoted one never had) is not.
        """
        if host is None or received is None or primary_timeline_age() > self.max_lag:
            return False
        promoted, its_own = self.received.get(primary_host() or ""), self.received.get(host)
        return (
            promoted is not None
            and its_own is not None
            and promoted.timeline == its_own.timeline == timeline - 1
            and received <= promoted.lsn
        )

    def say_hidden(self, connection: sa.Connection) -> None:
        if not self.hidden_said:
            self.hidden_said = True
            LOG.error(HIDDEN, connection.engine.url.username)

    def close(self) -> None:
        self.engine.dispose()
        self.without_primary.close()


def host_of(connection: sa.Connection) -> str | None:
    """The host and port a connection reached, as libpq names it (failover.py's names)."""
    info = getattr(connection.connection.dbapi_connection, "info", None)  # psycopg's
    return None if info is None else f"{info.host}:{info.port}"


def sent_back(reason: str) -> None:
    # For the metrics (metrics.py): the read is the primary's, for this reason.
    g.database_read = reason


def read_on_primary() -> None:
    """Note, for the metrics (metrics.py), that the primary served a read, unless the reason a
    standby did not is noted already."""
    g.setdefault("database_read", "primary")


def read_without_primary() -> None:
    """Note, for the metrics, that a standby holding every acknowledged commit served a read the
    primary could not (without_primary.py)."""
    g.database_read = "without_primary"


def serve_without_primary(seconds: float) -> bool:
    """Whether the standbys alone serve the reads now, as a read the primary cannot answer is
    served (without_primary.py), shown within `seconds`: False without standbys."""
    reads = standbys()
    if reads is None:
        return False
    # A deadline of its own, as a probe's: the primary's ran out before this is asked.
    g.database_deadline, g.database_probe = time.monotonic() + seconds, True
    try:
        reads.without_primary.read(lambda _connection: None)
    except Unproven:
        return False
    return True


def init_standbys(app: Flask) -> None:
    """Make the standbys' engine when DATABASE_READ_URL names them (settings.py refused it
    without a PostgreSQL primary)."""
    url = read_database_uri(app)
    if url is not None:
        app.extensions[STATE] = Standbys(app, url)


def standbys() -> Standbys | None:
    """The app's standbys, None without DATABASE_READ_URL."""
    found: Standbys | None = current_app.extensions.get(STATE)
    return found


def on_primary(ask: Callable[[], Any]) -> Any:
    """Run `ask` on the primary from within a read on a standby: its failure is the primary's."""
    try:
        return ask()
    except SQLAlchemyError as error:
        raise PrimaryFailedError(error) from error
