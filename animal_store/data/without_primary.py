"""Reads while the primary cannot answer (its machine lost, cut off, hung, until a new one serves):
served by the standbys alone, each promise of the standby reads (standbys.py) kept, or the JSON 503.

The argument. Under synchronous replication (docs/deploy.rst, High availability: Patroni's
synchronous mode, strict) a commit is acknowledged only once a synchronous standby has it on disk,
and every standby the primary may make synchronous is named in DATABASE_READ_URL. So at any moment
the highest WAL position any of them has received is at or past every commit acknowledged before
that moment, whether the primary is dead or alive behind a partition, and whichever standby was
synchronous: a standby that has replayed that far (EVERY_ACKNOWLEDGED) shows every animal, key
and revocation acknowledged until then. Read there:

- a key is checked as the primary would check it: a revocation acknowledged before the look-up
  is seen, and the key cache's second (KEY_CACHE_SECONDS) is the only delay, as in steady state;
- an animal it lacks was not acknowledged before the read: 404, never a false one;
- a page shows, in id order, every animal acknowledged before the read: a walk whose pages are
  read so shows every animal acknowledged before it began, each once (a row is shown when
  visible there; one committing later with a lower id was acknowledged after the walk began).

It needs an answer from every standby that may have been synchronous: every host of
DATABASE_READ_URL but the one this worker last reached the primary on (failover.py), each in
recovery, each saying what it received. Without one of them (two machines lost), a standby may
lack what only the missing one has: a read that needs the proof (a not-found, a page) is the JSON
503, while what the standby has is still served. A host list of one standby needs that standby
alone: it was the synchronous one, if any was.

What it cannot know: a commit the primary made and sent to one standby but never acknowledged (it
was lost before a synchronous standby had it) may show during the loss and be gone after the
promotion, whose standby never had it; its creator was never answered 201. And asynchronous
replication acknowledges commits no standby has: it loses them in a failover anyway.
"""

import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TypeVar

import sqlalchemy as sa
from flask import Flask, g
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from animal_store.data.deadlines import time_left, watch_engine
from animal_store.data.failover import primary_host, primary_synchronous, primary_timeline
from animal_store.data.keyset import Position

# What each standby says: whether it is one still, and the WAL positions it has received (written
# to disk, from the primary: None if it has not streamed since it started) and replayed.
POSITIONS = sa.text(
    "SELECT pg_is_in_recovery(), (pg_last_wal_receive_lsn() - '0/0'::pg_lsn)::bigint, "
    "(pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint"
)
REPLAYED = sa.text("SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint")
# How often the standby that received the most is asked whether it has replayed it too.
REPLAY_POLL = 0.01
# The share of what is left of the request's deadline a read without the primary may take.
SHARE = 0.9

Rows = TypeVar("Rows")


# Why the standbys could not show they hold every acknowledged commit (Unproven.reason): a host
# did not answer; a standby has not streamed since it started; the one that received the most
# did not replay it within the read's time; the primary was last seen committing asynchronously;
# a standby failed the read. (A standby that is the primary now sends the read to DATABASE_URL.)
REASONS = ("unanswered", "unknown", "replay", "asynchronous", "down")


class Unproven(Exception):  # noqa: N818 - not an error: a decision
    """No standby can be shown to hold every acknowledged commit, for `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StandbyHosts:
    """One engine for each host of DATABASE_READ_URL, so that each is asked on its own."""

    def __init__(self, app: Flask, url: str, received: dict[str, Position]) -> None:
        # What each host was seen to have received (standbys.Standbys.received), updated here.
        self.received = received
        parsed = make_url(url)
        listed = parsed.query.get("host")
        if listed is None:
            hosts = [f"{parsed.host or ''}:{parsed.port or 5432}"]
        else:
            hosts = [listed] if isinstance(listed, str) else list(listed)
        one = parsed.difference_update_query(["host", "target_session_attrs", "load_balance_hosts"])
        options = {**app.config["SQLALCHEMY_ENGINE_OPTIONS"], "isolation_level": "AUTOCOMMIT"}
        self.engines: dict[str, sa.Engine] = {}
        for host in hosts:
            name, _, port = host.rpartition(":") if ":" in host else (host, "", "5432")
            address = f"{name}:{port or 5432}"
            engine = sa.create_engine(one.set(host=name, port=int(port or 5432)), **options)
            watch_engine(engine, "standby_deadline")
            self.engines[address] = engine

    def read(self, read: Callable[[sa.Connection], Rows]) -> Rows:
        """Return what `read` reads on a standby that holds every commit acknowledged until now;
        raise Unproven when none can be shown to."""
        left = time_left()
        started = time.monotonic()
        if left is not None:
            g.standby_deadline = started + left * SHARE
        try:
            with ExitStack() as connections:
                best, every_acknowledged = self.every_acknowledged(connections)
                replayed = best[1]
                while replayed < every_acknowledged:
                    if left is not None and time.monotonic() - started > left * SHARE:
                        raise Unproven("replay")
                    time.sleep(REPLAY_POLL)
                    replayed = best[0].execute(REPLAYED).scalar_one()
                return read(best[0])
        except SQLAlchemyError as error:
            raise Unproven("down") from error
        finally:
            g.pop("standby_deadline", None)

    def every_acknowledged(self, connections: ExitStack) -> tuple[tuple[sa.Connection, int], int]:
        """Ask each standby, and return the one that received the most, with what it replayed,
        and that position (EVERY_ACKNOWLEDGED: the module's docstring)."""
        primary, timeline = primary_host(), primary_timeline()
        answers: list[tuple[int, int, sa.Connection, str]] = []
        for host, engine in self.engines.items():
            if host == primary:
                continue  # the primary's own (lost, hung or cut off), which is no standby
            try:
                connection = connections.enter_context(engine.connect())
                recovering, received, replayed = connection.execute(POSITIONS).one()
            except SQLAlchemyError:
                raise Unproven("unanswered") from None
            if not recovering:
                # A standby promoted: the primary now, which DATABASE_URL reaches.
                raise Unproven("promoted")
            if received is None:
                # It has not streamed since it started: what it has on disk, not yet replayed,
                # is unknown.
                raise Unproven("unknown")
            answers.append((received, replayed, connection, host))
        if not answers:
            raise Unproven("unanswered")
        self.note(timeline, answers)
        if not primary_synchronous():
            # Asynchronous replication acknowledges commits no standby may have.
            raise Unproven("asynchronous")
        received, replayed, connection, _ = max(answers, key=lambda answer: answer[0])
        return (connection, replayed), received

    def note(
        self, timeline: int | None, answers: list[tuple[int, int, sa.Connection, str]]
    ) -> None:
        """Keep what each standby has received (standbys.Standbys.left_behind), on the timeline of
        the primary they followed: every host but the lost primary's answered in recovery, so
        none is a new primary's standby yet, and the one promoted next begins its timeline past
        what it has now. Not if the worker reached another primary meanwhile."""
        if timeline is None or primary_timeline() != timeline:
            return
        for received, _, _, host in answers:
            seen = self.received.get(host)
            if seen is None or seen.timeline != timeline or received > seen.lsn:
                self.received[host] = Position(timeline, received)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.dispose()
