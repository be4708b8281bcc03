"""The database fails over with no human: Patroni, on the shipped config/patroni/ files, under
creations (each with an Idempotency-Key, sent again after a 503 or a 409 until created) and
reads through gunicorn, straight to PostgreSQL (libpq's multi-host URL) and through PgBouncer,
which reaches the primary through HAProxy health-checking Patroni's REST API (docs/deploy.rst,
High availability). Both paths are loaded at once through each fault, so each fault is measured
on both. The straight path reads on the standbys too (DATABASE_READ_URL, as docs/deploy.rst's
Reads on the standbys writes it), so each fault is also one under reads on the standbys: no read
shows an animal the new primary lacks or names otherwise, none answers 404 for the reader's own
latest creation, and its gunicorn's /metrics say where its reads went before, during and after
the fault, and once the old leader is back as a standby; through PgBouncer every read stays on
the primary, beside it.

The cluster is the module's own (tests/patroni_cluster.py: three etcd members and three Patroni
nodes on loopback ports), shared by the tests in the order they are written, each leaving it
with three members. They need no database of the suite's, and run in one pass only: the pass
with TEST_DATABASE_URL, since the other runs every test that starts a single cluster of its own
and was the longer by minutes in CI, where both run at once. `pytest -s` prints each fault's
figures, and the table of all at the end.
"""

import contextlib
import itertools
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from conftest import TEST_DATABASE_URL, Gunicorn, migrate_to_head
from patroni_cluster import MISSING, TEST_TIMINGS, HAProxy, Machine, PatroniCluster
from pgbouncer_server import PGBOUNCER, PgBouncer
from sqlalchemy.engine import make_url
from test_failover import answer_kinds, make_key, wait_for_a_creation
from test_releases import Load, scrape, walk

from animal_store.data.standbys import REASONS

pytestmark = [
    pytest.mark.skipif(
        bool(MISSING) or PGBOUNCER is None,
        reason="needs "
        + ", ".join(MISSING + ([] if PGBOUNCER else ["pgbouncer (Debian: pgbouncer)"])),
    ),
    pytest.mark.skipif(
        not TEST_DATABASE_URL,
        reason="runs in the pass with TEST_DATABASE_URL (it starts clusters of its own either way)",
    ),
]


class KeyedLoad(Load):
    """Load's readers and creators, but each creation carries an Idempotency-Key and is sent
    again, same key and body, after an answer that is not final (a 503, a dropped connection),
    as a careful client does; each reader gets the latest animal its load created, or the first
    page, and keeps every animal it was shown, when each read was answered and how, and how
    often it was told its load's latest creation is not there (a 404)."""

    def __init__(self, url, key, prefix):
        super().__init__(url, "", key, listers=1, creators=1)
        self.prefix = prefix
        self.pending: dict[int, str] = {}
        self.shown: list[tuple[int, str]] = []
        self.reads: list[tuple[float, int]] = []
        self.missing = 0

    def create_pet(self, session, n):
        me = threading.get_ident()
        key = self.pending.setdefault(me, f"{self.prefix}-{me}-{n}")
        response = session.post(
            f"{self.url}/v1/pets",
            json={"name": key, "categoryId": 1},
            headers=self.auth | {"Idempotency-Key": key},
            timeout=30,
        )
        # 409 idempotency_key_in_use: the first request under the key still runs on the server
        # (a commit that waits for a synchronous standby), so the client waits and sends it again.
        if response.status_code < 500 and response.status_code != 409:
            del self.pending[me]
        return response

    def list_pets(self, session, n):
        with self.lock:
            latest = self.acknowledged[-1]["id"] if self.acknowledged and n % 2 else None
        path = f"/v1/pets/{latest}" if latest else "/v1/pets?limit=20"
        response = session.get(f"{self.url}{path}", headers=self.auth, timeout=30)
        with self.lock:
            self.reads.append((time.monotonic(), response.status_code))
            if latest and response.status_code == 404:
                self.missing += 1
        if response.status_code == 200:
            body = response.json()
            with self.lock:
                self.shown += [
                    (pet["id"], pet["name"]) for pet in (body if latest is None else [body])
                ]
        return response


def kinds_of(load: KeyedLoad) -> Counter:
    """answer_kinds, and "409 in use": a creation's retry while its first request still runs,
    told to wait (Retry-After) and retried, as the API documents."""
    kinds = answer_kinds(load)
    for _, status, retry_after, body in load.answers:
        if status == 409 and retry_after and body.get("code") == "idempotency_key_in_use":
            kinds[409] -= 1
            kinds["409 in use"] += 1
    return +kinds


@dataclass
class Figures:
    """One path's figures through one fault."""

    fault: str
    mode: str
    path: str
    promotion: float
    first_creation: float
    longest_gap: float
    answers: Counter
    acknowledged: int
    lost: int
    stale: int
    missing: int
    rejoined: float | None = None

    def row(self) -> str:
        answers = ", ".join(
            f"{count} {kind}" for kind, count in sorted(self.answers.items(), key=str)
        )
        rejoined = "-" if self.rejoined is None else f"{self.rejoined:.1f} s"
        return (
            f"{self.fault:<10} {self.mode:<10} {self.path:<9} {self.promotion:>6.2f} s "
            f"{self.first_creation:>6.2f} s {self.longest_gap:>6.2f} s  "
            f"{self.lost} of {self.acknowledged:<5} {self.stale:>5} {self.missing:>7}  "
            f"{rejoined:>7}  {answers}"
        )


HEADER = (
    "fault      mode       path      promoted  then 201  no 201  lost        stale  missing"
    "  rejoined  answers"
)
MEASURED: list[Figures] = []


@dataclass
class Reads:
    """Where the direct path's reads went through one fault, by its gunicorn's /metrics: before
    the fault; during it, until the new leader's Patroni said so; after, as the load went on;
    and once the old leader had rejoined as a standby. And how long after the promotion a
    standby served a read again, and how each path's reads during the fault were answered (a
    read answered 503 before any server was asked is in no phase's count)."""

    fault: str
    mode: str
    standby_again: float
    answered_during: dict[str, Counter]
    phases: dict[str, Counter]

    def row(self) -> str:
        answered = [
            f"{path} " + ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))
            for path, statuses in self.answered_during.items()
        ]
        return f"{self.fault:<10} {self.mode:<10} {self.standby_again:>5.2f} s  " + "; ".join(
            answered + [f"{name} {said(n)}" for name, n in self.phases.items()]
        )


READS_HEADER = (
    "fault      mode       standby  reads answered during the fault by path; the direct path's"
    " reads by server (of the primary's, why)"
)


READS: list[Reads] = []


def reads_so_far(server: Gunicorn) -> Counter:
    """The reads the gunicorn counted (its /metrics, summed over its workers): by the server that
    served them ("standby", "without_primary", "primary") and, of the primary's, by why the
    standby did not."""
    counts: Counter = Counter()
    for (name, labels), value in scrape(server).items():
        if name == "animal_store_database_reads_total":
            counts[dict(labels)["server"]] += int(value)
        elif name == "animal_store_database_reads_sent_to_primary_total":
            counts[dict(labels)["reason"]] += int(value)
    return counts


def said(counts: Counter) -> str:
    reasons = ", ".join(f"{counts[reason]} {reason}" for reason in REASONS if counts[reason])
    return (
        f"{counts['standby']} standby, {counts['without_primary']} without the primary, "
        f"{counts['primary']} primary" + (f" ({reasons})" if reasons else "")
    )


@dataclass
class Deployment:
    cluster: PatroniCluster
    key: str
    direct: Gunicorn
    bounced: Gunicorn


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The three machines, a migrated database `store`, HAProxy and PgBouncer in front, and two
    gunicorns: one on every machine's PostgreSQL, its reads on the standbys, one on PgBouncer."""
    directory = tmp_path_factory.mktemp("patroni")
    cluster = PatroniCluster()
    haproxy = bouncer = None
    servers: list[Gunicorn] = []
    try:
        cluster.start()
        cluster.sql(cluster.wait_for_leader(None), "CREATE DATABASE store")
        url = cluster.url()
        migrate_to_head(url)
        key = make_key(url)
        haproxy = HAProxy(cluster)
        password = cluster.superuser_password
        through = make_url(f"postgresql://postgres:{password}@127.0.0.1:{haproxy.port}/store")
        bouncer = PgBouncer(through, "postgres", pool_size=4).wait_until_serving()
        # Straight: the two URLs of docs/deploy.rst. Every read reaches a server, none is
        # answered from what a worker kept (it would be most of them, an animal being read
        # again until the next is created), and every count is written at once, so that a
        # scrape between the phases of a fault counts where each phase's reads went. Through
        # PgBouncer: every read on the primary, as before, beside it under the same fault.
        straight = {
            "DATABASE_READ_URL": cluster.read_url(),
            "ANIMAL_STORE_ANSWER_CACHE_BYTES": "0",
            "ANIMAL_STORE_METRICS_WRITE_INTERVAL": "0",
        }
        bounced = {"ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true"}
        for database, environment in [
            (url, straight),
            (bouncer.url.render_as_string(hide_password=False), bounced),
        ]:
            log = directory / f"gunicorn-{len(servers)}.log"
            servers.append(Gunicorn(database, 2, environment, log))
        for server in servers:
            server.wait_until_serving(timeout=120)
        yield Deployment(cluster, key, *servers)
    finally:
        for server in servers:
            server.stop()
        if bouncer is not None:
            bouncer.stop()
        if haproxy is not None:
            haproxy.stop()
        cluster.stop()
        if MEASURED:
            timings = ", ".join(f"{name} {value}" for name, value in TEST_TIMINGS.items())
            print(f"\nPatroni failovers ({timings}):\n{HEADER}")
            print("\n".join(figures.row() for figures in MEASURED))
        if READS:
            print(f"The direct path's reads:\n{READS_HEADER}")
            print("\n".join(reads.row() for reads in READS))


def stored(cluster: PatroniCluster) -> dict[int, str]:
    """Every animal on the leader, {id: name}."""
    leader = cluster.wait_for_leader(None)
    rows = cluster.sql(leader, "SELECT id, name FROM pets ORDER BY id", "store").split()
    return {int(pet_id): name for pet_id, name in (row.split("|") for row in rows)}


def longest_gap(load: KeyedLoad, moment: float) -> float:
    """The longest time around `moment` with no creation acknowledged: from the last before it
    to the first after, and between those after."""
    created = sorted(when for when, status, *_ in load.answers if status == 201)
    around = [when for when in created if when < moment][-1:] + [w for w in created if w >= moment]
    return max(b - a for a, b in itertools.pairwise(around))


def through_a_fault(
    deployment: Deployment, fault: str, mode: str, act
) -> tuple[list[Figures], Reads]:
    """Load both paths, call `act()` (the fault; it returns once it is under way), wait for the
    new leader and for creations on both paths, load on a while; check every answer and what was
    stored, and that the direct path read on the standbys before the fault and after it; return
    the figures, and where the direct path's reads went."""
    cluster = deployment.cluster
    old = cluster.wait_for_leader(None)
    name = f"{fault}-{mode.replace(' ', '-')}"
    loads = {
        "direct": KeyedLoad(deployment.direct.url, deployment.key, f"{name}-direct"),
        "PgBouncer": KeyedLoad(deployment.bounced.url, deployment.key, f"{name}-bounced"),
    }
    scrapes = [reads_so_far(deployment.direct)]
    with contextlib.ExitStack() as stack:
        for load in loads.values():
            stack.enter_context(load)
        for load in loads.values():
            load.wait_for_answers(50)
        scrapes.append(reads_so_far(deployment.direct))
        started = time.monotonic()
        act(old)
        promoted = cluster.wait_for_leader(old, timeout=60)
        promoted_at = time.monotonic()
        promotion = promoted_at - started
        scrapes.append(reads_so_far(deployment.direct))
        standby_again = wait_for_a_read_on_a_standby(deployment.direct, scrapes[-1], promoted_at)
        first = {path: wait_for_a_creation(load, promoted_at, 60) for path, load in loads.items()}
        for load in loads.values():
            load.wait_for_answers(100, timeout=60)
        scrapes.append(reads_so_far(deployment.direct))
    phases = zip(("before", "during", "after"), itertools.pairwise(scrapes), strict=True)
    answered = {
        path: Counter(status for when, status in load.reads if started <= when < promoted_at)
        for path, load in loads.items()
    }
    reads = Reads(
        fault, mode, standby_again, answered, {name: phase(*pair) for name, pair in phases}
    )
    print(reads.row())
    animals = stored(cluster)
    assert cluster.leader() is promoted
    figures = []
    for path, load in loads.items():
        kinds = kinds_of(load)
        acknowledged = {pet["id"]: pet["name"] for pet in load.acknowledged}
        lost = sorted(set(acknowledged) - set(animals))
        stale = [shown for shown in load.shown if animals.get(shown[0]) != shown[1]]
        figures.append(
            Figures(
                fault,
                mode,
                path,
                promotion,
                first[path],
                longest_gap(load, started),
                kinds,
                len(acknowledged),
                len(lost),
                len(stale),
                load.missing,
            )
        )
        print(figures[-1].row())
        assert set(kinds) <= {"ok", "503", "409 in use"}, load.failures[:5]
        # A synchronous standby is promoted, strict or not: it has every commit acknowledged.
        assert lost == []
        assert stale == [], stale[:5]
        # A creation is found by id at once, wherever the read goes (a standby that lacks it
        # leaves the answer to the primary), and through the fault too.
        assert load.missing == 0
        # Each key made one animal, however often its creation was sent.
        names = Counter(name for name in animals.values() if name.startswith(load.prefix))
        assert [name for name, count in names.items() if count > 1] == []
        assert set(names) >= set(acknowledged.values())
    assert [pet["id"] for pet in walk(deployment.direct.url, "", deployment.key)] == list(animals)
    assert reads.phases["before"]["standby"] > 0, reads.row()
    return figures, reads


def wait_for_a_read_on_a_standby(server: Gunicorn, since: Counter, moment: float) -> float:
    """Return how long after `moment` the gunicorn had read on a standby more than `since` says:
    once a standby, the one left or the old leader back, has what the reads ask of it."""
    deadline = moment + 60
    while reads_so_far(server)["standby"] == since["standby"]:
        assert time.monotonic() < deadline, "no read on a standby within 60 s"
        time.sleep(0.1)
    return time.monotonic() - moment


def phase(before: Counter, after: Counter) -> Counter:
    """What was counted between two scrapes."""
    return Counter({name: after[name] - before[name] for name in after})


def reads_back_on_the_standbys(deployment: Deployment, reads: Reads) -> None:
    """Once the old leader has rejoined: read straight, by id, the last 20 animals, count where
    the reads went into `reads`, and check that standbys served some."""
    before = reads_so_far(deployment.direct)
    auth = {"Authorization": f"Bearer {deployment.key}"}
    for pet in list(stored(deployment.cluster))[-20:]:
        answer = requests.get(f"{deployment.direct.url}/v1/pets/{pet}", headers=auth, timeout=30)
        assert answer.status_code == 200, answer.text
    reads.phases["rejoined"] = phase(before, reads_so_far(deployment.direct))
    READS.append(reads)
    assert reads.phases["rejoined"]["standby"] > 0, reads.row()


def rejoin(cluster: PatroniCluster, machine: Machine) -> float:
    """Wait for `machine` to be a standby of the leader again, streaming; return how long."""
    started = time.monotonic()
    members = cluster.wait_for_members(3, timeout=120)
    role = next(member["role"] for member in members if member["name"] == machine.name)
    assert role in ("replica", "sync_standby")
    return time.monotonic() - started


MODES = {"strict": True, "not strict": False}


@pytest.mark.parametrize("mode", MODES)
def test_patroni_switchover_under_load_is_barely_noticed(deployment, mode):
    cluster = deployment.cluster
    cluster.set_strict(MODES[mode])
    finished = {}

    def switch_over(old: Machine) -> None:
        # The synchronous standby: the only one Patroni lets take over in synchronous mode.
        (candidate,) = [m["name"] for m in cluster.members() if m["role"] == "sync_standby"]
        finished["old"] = old

        def run():
            finished["said"] = cluster.patronictl(
                "switchover", "--leader", old.name, "--candidate", candidate, "--force"
            )

        finished["thread"] = threading.Thread(target=run)
        finished["thread"].start()

    figures, reads = through_a_fault(deployment, "switchover", mode, switch_over)
    finished["thread"].join(60)
    assert "Successfully switched over" in finished["said"], finished["said"]
    # The old leader follows the new one by itself: Patroni stopped it cleanly, no rewind needed.
    rejoined = rejoin(cluster, finished["old"])
    reads_back_on_the_standbys(deployment, reads)
    for each in figures:
        each.rejoined = rejoined
    MEASURED.extend(figures)
    for each in figures:
        # Under the failover's: no wait for a key to expire.
        assert each.promotion < TEST_TIMINGS["ttl"] + 5
        assert each.first_creation < 15


@pytest.mark.parametrize("mode", MODES)
def test_patroni_promotes_a_standby_when_the_leaders_machine_is_lost(deployment, mode):
    cluster = deployment.cluster
    cluster.set_strict(MODES[mode])
    lost: list[Machine] = []

    def lose_the_leader(old: Machine) -> None:
        old.lose()
        lost.append(old)

    try:
        figures, reads = through_a_fault(deployment, "kill", mode, lose_the_leader)
    finally:
        # Its etcd member and Patroni start again, as the machine's boot would (and for the
        # next test, whatever happened): Patroni rewinds its PostgreSQL if it must (it was the
        # primary of the timeline that ended) and starts it as a standby.
        for machine in lost:
            machine.bring_back()
    (old,) = lost
    rejoined = rejoin(cluster, old)
    reads_back_on_the_standbys(deployment, reads)
    for each in figures:
        each.rejoined = rejoined
    MEASURED.extend(figures)
    for each in figures:
        # The leader's key expires within ttl of its last renewal; then a loop or two.
        assert each.promotion < TEST_TIMINGS["ttl"] + 10
        assert each.first_creation < each.promotion + 15
    # The reads on the standbys go on without the primary (data/without_primary.py): from the
    # fault to the promotion, at least 0.99 of them answered.
    direct = reads.answered_during["direct"]
    assert direct[200] >= 0.99 * sum(direct.values()), reads.row()


def test_patroni_the_synchronous_standbys_machine_lost_silently_stops_creations_about_ttl(
    deployment,
):
    """The synchronous standby's machine lost as a machine or a partition is (every process
    frozen: nothing answers, no connection is closed): each commit waits for it until the
    leader's Patroni names the other standby, which it does only once the frozen one's member
    key has expired in etcd, its WAL sender staying for wal_sender_timeout (60 s): about ttl and
    a loop, where a killed one costs a loop (docs/deploy.rst, Strict or not). Then creations go
    on, nothing acknowledged is lost, and the machine rejoins once it answers."""
    cluster = deployment.cluster
    cluster.set_strict(True)
    leader = cluster.wait_for_leader(None)
    (synchronous,) = [
        cluster.machine(member["name"])
        for member in cluster.members()
        if member["role"] == "sync_standby"
    ]
    # etcd's leader elsewhere: a frozen etcd leader adds an election, and with the tests'
    # retry_timeout (3 s) may make the leader's Patroni demote itself (measured once: 63.5 s).
    cluster.move_etcd_leader(leader)
    load = KeyedLoad(deployment.direct.url, deployment.key, "sync-standby-frozen")
    frozen: list[int] = []
    try:
        with load:
            load.wait_for_answers(50)
            frozen = synchronous.processes()
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            lost = time.monotonic()
            wait_for_a_creation(load, lost + 1, 60)
            load.wait_for_answers(50, timeout=60)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    cluster.wait_for_members(3, timeout=120)
    gap = longest_gap(load, lost)
    kinds = kinds_of(load)
    print(f"the synchronous standby frozen: {gap:.2f} s without a 201; answers {dict(kinds)}")
    assert cluster.leader() is leader
    assert set(kinds) <= {"ok", "503", "409 in use"}, load.failures[:5]
    assert not {pet["id"] for pet in load.acknowledged} - set(stored(cluster))
    ttl, loop = TEST_TIMINGS["ttl"], TEST_TIMINGS["loop_wait"]
    # At least its key's ttl (up to a loop_wait less: a refresh is skipped within loop_wait of
    # the last), never the loop alone that a killed machine costs (1 to 1.4 s). Then a loop and
    # the client's retry: 9.5 and 9.8 s with the tests' timings here, but 23.2 and 36.7 s in two
    # CI runs, both passes at once (not understood yet: no upper bound but the resumption, 60 s).
    assert gap > ttl - loop


def test_patroni_files_are_run_as_shipped_but_for_addresses_ports_paths_and_timings():
    """What tests/patroni_cluster.py replaces in config/patroni/ is all it may: the three
    machines' lines, rendered for each, keep every other line of the shipped files."""
    cluster = PatroniCluster()
    try:
        shipped = (Path(__file__).parent.parent / "config" / "patroni" / "patroni.yml").read_text()
        rendered = cluster.machines[1].patroni_config()
        kept = [line for line in shipped.splitlines() if line in rendered.splitlines()]
        changed = [line.strip() for line in shipped.splitlines() if line not in kept]
        replaced = {"name:", "listen:", "connect_address:", "hosts:", "data_dir:", "bin_dir:"}
        replaced |= {
            "pgpass:",
            "unix_socket_directories:",
            "- host",
            *map("{}:".format, TEST_TIMINGS),
        }
        assert all(line.startswith(tuple(replaced)) for line in changed), changed
        environment = cluster.machines[2].etcd_environment()
        assert environment["ETCD_NAME"] == "db3"
        assert environment["ETCD_INITIAL_CLUSTER"].count("=http://127.0.0.1:") == 3
    finally:
        cluster.stop()


@pytest.mark.parametrize("mode", MODES)
def test_patroni_primary_left_alone_commits_only_when_not_strict(deployment, mode):
    """Both standbys' Patroni and PostgreSQL lost, their etcd members not (etcd keeps its
    quorum, the primary its key): strict, creations wait (the JSON 503) until a standby is back;
    not strict, they go on after a loop of the leader's Patroni, on one machine alone, which is
    the window in which losing that machine too would lose them."""
    cluster = deployment.cluster
    cluster.set_strict(MODES[mode])
    leader = cluster.wait_for_leader(None)
    standbys = [machine for machine in cluster.machines if machine is not leader]
    load = KeyedLoad(deployment.direct.url, deployment.key, f"alone-{mode.replace(' ', '-')}")
    try:
        with load:
            load.wait_for_answers(50)
            for standby in standbys:
                standby.lose_database()
            alone = time.monotonic()
            time.sleep(6)
            back = time.monotonic()
            for standby in standbys:
                standby.bring_back()
            cluster.wait_for_members(3, timeout=120)
            followed = time.monotonic()
            load.wait_for_answers(50)
    finally:
        for standby in standbys:
            standby.bring_back()  # if the test stopped before it did
    created = sorted(when for when, status, *_ in load.answers if status == 201)
    while_alone = [when for when in created if alone + 1 < when < back]
    first_alone = [when - alone for when in created if when > alone + 1][:1]
    kinds = kinds_of(load)
    print(
        f"alone {mode}: {len(while_alone)} creations acknowledged in {back - alone:.1f} s alone, "
        f"the first {first_alone} s after the loss; standbys back in {followed - back:.1f} s; "
        f"answers {dict(kinds)}"
    )
    assert cluster.leader() is leader
    assert set(kinds) <= {"ok", "503", "409 in use"}, load.failures[:5]
    if MODES[mode]:
        assert while_alone == []
        assert first_alone[0] > back - alone
    else:
        # Once the leader's Patroni has seen its synchronous standby gone (a loop or two).
        assert while_alone
        assert first_alone[0] < TEST_TIMINGS["ttl"]
    assert not {pet["id"] for pet in load.acknowledged} - set(stored(cluster))
