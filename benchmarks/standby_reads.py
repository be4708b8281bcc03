"""Reads on the standbys against reads on the primary alone, through gunicorn, with wrk (issue 48).

One run starts a PostgreSQL primary and two streaming standbys of its own
(tests/postgres_cluster.py: initdb and pg_basebackup -R in temporary directories, never the
machine's server), migrates and seeds the primary (`flask --app animal_store db upgrade`,
`seed N`), makes a key with a rate limit wrk never reaches, and starts two gunicorns on the
production config, side by side:

- baseline: DATABASE_URL on the primary, no DATABASE_READ_URL (every read on the primary);
- standbys: the same, and DATABASE_READ_URL naming both standbys in one libpq host list
  (`load_balance_hosts=random&target_session_attrs=standby`, as docs/deploy.rst has it).

wrk sends both the same read mix, in turns, round after round (each round starts with the other
variant): getPet of an animal drawn at random, and listPets pages of 20 after a cursor drawn at
random, every one a full page with a next link (half and half). Every read reaches a database:
the answers kept per worker are off (ANSWER_CACHE_BYTES=0), since with them most reads never
leave the worker once warm; --answer-cache measures as shipped.

Where the reads went is read on the servers themselves: the scans of the pets table each one ran
during the round (seq_scan + idx_scan of pg_stat_user_tables, read before and
STATS_FLUSH_SECONDS after, once every backend has written its counts; a standby counts the scans
its own backends run, which the run checks on each server before it measures). It prints per
variant the 2xx answers a second, the other answers by status (any 5xx stops the run), the
primary's reads of pets per request and the standbys' share of them, and the service's own count
of the same (animal_store_database_reads_total{server}, from /metrics); then the ratio of the
standbys' read throughput to the baseline's (the median of the rounds' ratios) and the standbys'
share, against issue 48's targets.

--lagging adds a phase on the standbys variant: one standby replays --delay seconds behind
(recovery_min_apply_delay) while one client creates --creations animals a second, reading each
back by id at once, and another walks the last pages and reads animals by id, beside wrk's mix;
it prints each server's share of the reads of pets, why reads went to the primary, and checks
that nothing read was stale: each animal's name as the primary stores it, each page a gapless
run of the primary's ids.

    python benchmarks/standby_reads.py                    # 1,000 animals, 3 rounds of 10 s
    python benchmarks/standby_reads.py --lagging          # and the phase with a lagging standby
    python benchmarks/standby_reads.py --rounds 1 --duration 3 --quiet-wait 0   # does it run

Needs wrk (Debian: `apt-get install wrk`) and PostgreSQL's server binaries (initdb, pg_basebackup);
as root the servers run as the postgres user. Rate limits are counted in the machine's Redis, as
http_bench.py counts them (it says so when none answers on 127.0.0.1:6379).
"""

import argparse
import bisect
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from http_bench import (
    QUIET_LOAD,
    Server,
    check_rate_limits,
    load,
    prepare_database,
    service_env,
    verdict,
    wait_for_quiet,
)
from prometheus_client.parser import text_string_to_metric_families

PROJECT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_DIR / "tests"))
import wrk  # noqa: E402
from postgres_cluster import BINDIR, PostgresCluster  # noqa: E402

LIMIT = 20
VARIANTS = ("baseline", "standbys")
SERVERS = ("primary", "standby1", "standby2")
# Issue 48: with standbys, at least this share of the baseline's read throughput, and at least
# this share of the reads of pets on the standbys.
THROUGHPUT_TARGET = 0.95
SHARE_TARGET = 0.8
# Every scan of the table, by whichever plan: a read of an animal or of a page is one.
PETS_READS = (
    "SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) FROM pg_stat_user_tables "
    "WHERE relname = 'pets'"
)
# PostgreSQL 15 writes a backend's table counts to the shared statistics at most once a second,
# at the end of a transaction (PGSTAT_MIN_INTERVAL); what a backend counted in its last second
# before going idle is written 10 s later (PGSTAT_IDLE_INTERVAL, pgstat.c). So each round's
# counts are read this long after its last request.
STATS_FLUSH_SECONDS = 11
# A standby's lag as the service reads it (standbys.CHECK).
LAG = (
    "SELECT CASE WHEN pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn() "
    "THEN 0 ELSE extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8 END"
)
APP_CONNECTIONS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = 'store' "
    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


def main():
    args = parse_args()
    if wrk.WRK is None:
        sys.exit("wrk is not installed: on Debian or Ubuntu `sudo apt-get install wrk`.")
    if BINDIR is None:
        sys.exit("PostgreSQL's server binaries (initdb) are not installed (Debian: postgresql).")
    # The baseline must not read from standbys named in this shell's environment.
    for name in ("DATABASE_READ_URL", "ANIMAL_STORE_DATABASE_READ_URL"):
        os.environ.pop(name, None)
    workdir = Path(tempfile.mkdtemp(prefix="animal-standby-reads-"))
    primary = None
    gunicorns = []
    try:
        print(f"load average {load()}; {os.cpu_count()} cores; {args.workers} workers each")
        primary = PostgresCluster(replication="async")
        database_url = primary.create_database("store")
        key = prepare_database(database_url, args.animals)
        # Made from the seeded primary: they start with every animal, and stream what follows.
        standbys = [primary.standby(), primary.standby()]
        for standby in standbys:
            standby.wait_for_replay()
        servers = dict(zip(SERVERS, (primary, *standbys), strict=True))
        check_counters(servers)
        ids = seeded_ids(primary)
        script = write_script(workdir, ids, args.get_share)

        env = service_env(database_url)
        if not args.answer_cache:
            env["ANIMAL_STORE_ANSWER_CACHE_BYTES"] = "0"
        hosts = ",".join(standby.host_port for standby in standbys)
        read_url = (
            f"postgresql://postgres@{hosts}/store"
            "?load_balance_hosts=random&target_session_attrs=standby"
        )
        variants = {}
        for name, extra in (("baseline", {}), ("standbys", {"DATABASE_READ_URL": read_url})):
            variants[name] = Server(name, "wsgi:app", args.workers, workdir, {**env, **extra})
            gunicorns.append(variants[name])
        for server in variants.values():
            server.wait_until_serving()
        check_rate_limits(variants["standbys"])
        print(
            f"{args.animals} animals; wrk -c{args.connections} -d{args.duration}s, "
            f"{args.get_share:.0%} getPet, the rest listPets pages of {LIMIT}; "
            f"answers kept per worker: {'as shipped' if args.answer_cache else 'none'}; "
            f"{args.rounds} rounds"
        )
        # Warm up: imports, key caches, connection pools, what each worker knows is settled.
        for server in variants.values():
            run_reads(server, key, args, script, 2)
        time.sleep(STATS_FLUSH_SECONDS)
        results = {name: [] for name in VARIANTS}
        busy_rounds = []
        for round_number in range(1, args.rounds + 1):
            started_at = wait_for_quiet(args.quiet_wait)
            if started_at >= QUIET_LOAD:
                busy_rounds.append(f"round {round_number} at {started_at:.2f}")
            order = VARIANTS if round_number % 2 else VARIANTS[::-1]
            for name in order:
                figures = measure(variants[name], servers, key, args, script, args.duration)
                results[name].append(figures)
                print(f"  round {round_number} (load {started_at:.2f}) {describe(name, figures)}")
        connections = {name: app_connections(servers[name]) for name in SERVERS[1:]}
        print_results(results, connections, busy_rounds)
        if args.lagging:
            measure_lagging(variants["standbys"], servers, key, args, script, ids, connections)
        print(f"load average {load()}")
    finally:
        for server in gunicorns:
            server.stop()
        if primary is not None:
            for standby in primary.standbys:
                standby.stop()
            primary.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--animals", type=int, default=1000, help="animals seeded (1,000)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (10)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="gunicorn workers (one per core)"
    )
    parser.add_argument(
        "--get-share", type=float, default=0.5, help="share of getPet in the mix (0.5)"
    )
    parser.add_argument(
        "--answer-cache",
        action="store_true",
        help="keep answers per worker as shipped (default: none, every read reaches a database)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=240,
        metavar="SECONDS",
        help=f"before each round, wait this long at most for a load under {QUIET_LOAD} (240)",
    )
    parser.add_argument(
        "--lagging", action="store_true", help="then a phase with one standby replaying late"
    )
    parser.add_argument(
        "--delay", type=float, default=5, help="the lagging standby's replay delay, seconds (5)"
    )
    parser.add_argument(
        "--creations", type=float, default=20, help="creations a second beside the lag (20)"
    )
    return parser.parse_args()


def check_counters(servers) -> None:
    """Stop unless each server counts the reads of pets its own backends run, and only those:
    what the run takes for granted of the standbys (a standby's statistics are its own, not the
    primary's, in PostgreSQL 15). A psql session writes its counts as it exits."""
    for name, cluster in servers.items():
        before = pets_reads(servers)
        cluster.sql("SELECT name FROM pets WHERE id = 1", "store")
        after = pets_reads(servers)
        moved = {each: after[each] - before[each] for each in servers}
        if moved != {each: int(each == name) for each in servers}:
            sys.exit(f"one read of pets on {name} moved the servers' counts by {moved}")
    print("each server counts its own reads of pets (pg_stat_user_tables): checked")


def pets_reads(servers) -> dict[str, int]:
    return {name: int(cluster.sql(PETS_READS, "store")) for name, cluster in servers.items()}


def app_connections(cluster) -> int:
    return int(cluster.sql(APP_CONNECTIONS, "store"))


def seeded_ids(primary) -> range:
    low, high, count = map(
        int, primary.sql("SELECT min(id), max(id), count(*) FROM pets", "store").split("|")
    )
    if count != high - low + 1:
        sys.exit(f"the seeded ids have gaps ({count} animals from {low} to {high})")
    return range(low, high + 1)


def write_script(workdir, ids, get_share) -> Path:
    """wrk's script: each request getPet or a full page of the list, drawn at random, and every
    answer counted by status (tests/wrk.py)."""
    from animal_store.data.filters import walk_of
    from animal_store.data.pagination import Position, encode_cursor

    # A page after one of these has LIMIT animals and one more: a full page, with a next link.
    afters = random.sample(range(ids.stop - LIMIT - 1), min(500, ids.stop - LIMIT - 1))
    cursors = ", ".join(f'"{encode_cursor(Position(after, walk_of({})))}"' for after in afters)
    script = workdir / "reads.lua"
    script.write_text(
        f"WARMUP = 0\nWINDOW = 0\n{wrk.COUNTING_SCRIPT}\n"
        f"local cursors = {{{cursors}}}\n"
        "local seeded = false\n"
        "function request()\n"
        "  if not seeded then math.randomseed(os.time()) seeded = true end\n"
        f"  if math.random() < {get_share} then\n"
        f'    return wrk.format("GET", "/v1/pets/" .. math.random({ids.start}, {ids.stop - 1}))\n'
        "  end\n"
        f'  return wrk.format("GET", "/v1/pets?limit={LIMIT}&cursor=" .. '
        "cursors[math.random(#cursors)])\n"
        "end\n"
    )
    return script


def run_reads(server, key, args, script, duration) -> wrk.WrkRun:
    process = subprocess.Popen(
        [
            wrk.WRK,
            "--threads=1",
            f"--connections={args.connections}",
            f"--duration={duration}s",
            "--timeout=10s",
            "--script",
            str(script),
            "--header",
            f"Authorization: Bearer {key}",
            server.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        return wrk.finish(process, duration + 60)
    finally:
        if process.poll() is None:  # it outlived its time: stopped, by its PID
            process.kill()
            process.wait()


def measure(server, servers, key, args, script, duration, then=None) -> dict:
    """One wrk run of the read mix on `server`, with what each database and the service counted
    meanwhile; `then` is called once wrk is done, before the counts are read."""
    counted_before, service_before = pets_reads(servers), scrape(server)
    run = run_reads(server, key, args, script, duration)
    if then:
        then()
    time.sleep(STATS_FLUSH_SECONDS)
    counted_after, service_after = pets_reads(servers), scrape(server)
    errors = {status: n for status, n in run.statuses.items() if not 200 <= status < 300}
    if any(status >= 500 for status in errors) or run.errors.get("timeout"):
        sys.exit(f"{server.name}: server errors {errors}, socket errors {run.errors}")
    return {
        "rps": run.ok / run.seconds,
        "requests": sum(run.statuses.values()),
        "errors": errors,
        "reads": {name: counted_after[name] - counted_before[name] for name in SERVERS},
        "service": {
            name: service_after.get(name, 0) - service_before.get(name, 0) for name in service_after
        },
    }


def scrape(server) -> dict[str, float]:
    """The service's counts of reads by server, and of those sent to the primary by reason."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:  # noqa: S310
        text = response.read().decode()
    counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "animal_store_database_reads_total":
                counts[sample.labels["server"]] = sample.value
            elif sample.name == "animal_store_database_reads_sent_to_primary_total":
                counts["because " + sample.labels["reason"]] = sample.value
    return counts


def standbys_share(reads) -> float:
    total = sum(reads.values())
    return (total - reads["primary"]) / total if total else 0.0


def describe(name, figures) -> str:
    reads, requests = figures["reads"], figures["requests"]
    text = (
        f"{name:8} {figures['rps']:7.0f} req/s, other answers {figures['errors'] or 'none'}; "
        f"reads of pets per request: "
        + ", ".join(f"{server} {reads[server] / requests:.2f}" for server in SERVERS)
    )
    service = figures["service"]
    if service.get("standby") or service.get("primary"):
        served = service.get("standby", 0) + service.get("primary", 0)
        text += f"; the service counted {service.get('standby', 0) / served:.2f} on standbys"
    return text


def print_results(results, connections, busy_rounds):
    print(
        f"\n{'':10}{'req/s 2xx':>10}{'other':>8}{'primary reads':>15}{'standbys':>10}"
        f"{'service says':>14}"
    )
    print(f"{'':10}{'':>10}{'answers':>8}{'of pets/req':>15}{'share':>10}{'standbys':>14}")
    for name, rounds in results.items():
        rps = statistics.median(figures["rps"] for figures in rounds)
        errors = sum(sum(figures["errors"].values()) for figures in rounds)
        per_request = statistics.median(
            figures["reads"]["primary"] / figures["requests"] for figures in rounds
        )
        share = statistics.median(standbys_share(figures["reads"]) for figures in rounds)
        service = [figures["service"] for figures in rounds]
        said = "--"
        if any(counts.get("standby") for counts in service):
            said = f"{statistics.median(counted_share(counts) for counts in service):.2f}"
        print(f"{name:10}{rps:10.0f}{errors:8}{per_request:15.2f}{share:10.2f}{said:>14}")
    split = {
        server: sum(figures["reads"][server] for figures in results["standbys"])
        for server in SERVERS
    }
    total = sum(split.values())
    print(
        "standbys variant, the reads of pets by server over the rounds: "
        + ", ".join(f"{server} {count / total:.2f}" for server, count in split.items())
        + "; the app's connections on each standby at the end: "
        + ", ".join(f"{server} {count}" for server, count in connections.items())
    )
    sent = {}
    for figures in results["standbys"]:
        for reason, count in figures["service"].items():
            if reason.startswith("because ") and count:
                sent[reason] = sent.get(reason, 0) + count
    print(f"reads the service sent to the primary, by reason: {sent or 'none'}")
    ratio = statistics.median(
        standbys["rps"] / baseline["rps"]
        for baseline, standbys in zip(results["baseline"], results["standbys"], strict=True)
    )
    share = statistics.median(standbys_share(figures["reads"]) for figures in results["standbys"])
    if busy_rounds:
        print(f"\nno verdict: {', '.join(busy_rounds)}, at or above {QUIET_LOAD}; for information:")
    else:
        print(f"\ntargets (issue 48; medians of the rounds, every one started under {QUIET_LOAD}):")
    print(
        f"  read req/s, standbys / baseline   {ratio:5.2f}  target >= {THROUGHPUT_TARGET:.2f}  "
        f"{verdict(ratio >= THROUGHPUT_TARGET, busy_rounds)}"
    )
    print(
        f"  standbys' share of pets reads      {share:5.2f}  target >= {SHARE_TARGET:.2f}  "
        f"{verdict(share >= SHARE_TARGET, busy_rounds)}"
    )


def counted_share(counts) -> float:
    served = counts.get("standby", 0) + counts.get("primary", 0)
    return counts.get("standby", 0) / served if served else 0.0


class Clients:
    """The lagging phase's clients: one creates animals and reads each back by id at once; one
    walks the last pages of the list and reads animals by id. Every answer is kept to be checked
    against the primary afterwards."""

    def __init__(self, url, key, creations, ids):
        self.url, self.key, self.interval = url, key, 1 / creations
        self.known = list(ids)  # ids to read: the seeded ones, then each one created
        self.by_id = []  # (id, status, name)
        self.pages = []  # (after, [ids])
        self.created = 0
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self.create, daemon=True),
            threading.Thread(target=self.read, daemon=True),
        ]

    def start(self):
        for thread in self.threads:
            thread.start()

    def finish(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def call(self, method, path, body=None):
        request = urllib.request.Request(  # noqa: S310 - our own http URL
            self.url + path,
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
                return answer.status, answer.headers, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    def get_pet(self, pet_id):
        status, _, body = self.call("GET", f"/v1/pets/{pet_id}")
        self.by_id.append((pet_id, status, json.loads(body).get("name")))

    def create(self):
        number = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            number += 1
            body = json.dumps({"name": f"Lagging {number}", "categoryId": 1}).encode()
            status, _, answer = self.call("POST", "/v1/pets", body)
            if status == 201:
                self.created += 1
                pet_id = json.loads(answer)["id"]
                self.known.append(pet_id)
                self.get_pet(pet_id)  # the client's own creation, at once
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def read(self):
        from animal_store.data.filters import walk_of
        from animal_store.data.pagination import Position, decode_cursor, encode_cursor

        while not self.stopping.is_set():
            after = max(self.known[-1] - 3 * LIMIT, 0)
            path = f"/v1/pets?limit={LIMIT}&cursor={encode_cursor(Position(after, walk_of({})))}"
            while path and not self.stopping.is_set():
                status, headers, body = self.call("GET", path)
                if status != 200:
                    self.pages.append((after, status))
                    break
                self.pages.append((after, [pet["id"] for pet in json.loads(body)]))
                link = headers.get("Link")
                path = None
                if link:
                    query = urllib.parse.urlsplit(link[1 : link.index(">")]).query
                    cursor = urllib.parse.parse_qs(query)["cursor"][0]
                    after = decode_cursor(cursor).last_id
                    path = f"/v1/pets?limit={LIMIT}&cursor={cursor}"
            self.get_pet(random.choice(self.known))
            self.stopping.wait(0.05)


def measure_lagging(server, servers, key, args, script, ids, connections):
    """The standbys variant with one standby replaying `args.delay` s late and creations beside
    the reads: each server's share of the reads of pets, and whether any answer was stale."""
    # The standby the app's connections favour, so that its share has room to fall (each
    # worker's connection stays on the standby it first reached: the split is the luck of that).
    lagging = "standby1" if connections["standby1"] > connections["standby2"] else "standby2"
    servers[lagging].sql(
        f"ALTER SYSTEM SET recovery_min_apply_delay = '{args.delay}s'; SELECT pg_reload_conf();"
    )
    wait_for_quiet(args.quiet_wait)
    clients = Clients(server.url, key, args.creations, ids)
    print(
        f"\nlagging phase: {lagging} replays {args.delay:g} s behind (recovery_min_apply_delay), "
        f"one client creating {args.creations:g} animals a second, one walking the last pages, "
        f"beside wrk's reads, {args.duration} s; load {load()}"
    )
    # Until it replays the first creation, a standby idle before reads as lagging since its last
    # replayed commit, minutes ago: the measured window starts once it is `delay` behind.
    clients.start()
    time.sleep(args.delay + 2)
    lags = []

    def sample_lag_and_stop():
        lags.append(float(servers[lagging].sql(LAG, "store")))
        clients.finish()

    figures = measure(server, servers, key, args, script, args.duration, sample_lag_and_stop)
    print(f"  {describe('standbys', figures)}")
    reads = figures["reads"]
    total = sum(reads.values())
    print(
        "  the reads of pets by server: "
        + ", ".join(f"{name} {reads[name] / total:.2f}" for name in SERVERS)
        + f"; {lagging}'s lag as the service reads it, as wrk ended: {lags[0]:.1f} s"
    )
    sent = {
        reason: count
        for reason, count in figures["service"].items()
        if reason.startswith("because")
    }
    print(f"  reads the service sent to the primary, by reason: {sent}")
    stored = dict(
        (int(pet_id), name)
        for pet_id, name in (
            line.split("|", 1)
            for line in servers["primary"].sql("SELECT id, name FROM pets", "store").splitlines()
        )
    )
    order = sorted(stored)
    stale_by_id = [
        (pet_id, status, name)
        for pet_id, status, name in clients.by_id
        if status != 200 or stored.get(pet_id) != name
    ]
    stale_pages = []
    for after, page in clients.pages:
        start = bisect.bisect_right(order, after)
        if not isinstance(page, list) or page != order[start : start + len(page)]:
            stale_pages.append((after, page))
    print(
        f"  created {clients.created}; read by id {len(clients.by_id)}, stale or missing "
        f"{len(stale_by_id)}; pages {len(clients.pages)}, not a gapless run of the primary's ids "
        f"{len(stale_pages)}"
    )
    if stale_by_id or stale_pages:
        sys.exit(f"stale answers: by id {stale_by_id[:10]}, pages {stale_pages[:10]}")


if __name__ == "__main__":
    main()
