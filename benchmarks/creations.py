"""Creations on PostgreSQL as writers grow: the service's creation path against plain INSERTs.

The database level (the default) runs pgbench on a scratch database the benchmark makes and
drops: the statements of one real creation, as the service runs them (captured from
store.add_pet in its transaction, so the benchmark follows the code), against a plain INSERT into a
twin table with an identity column and nothing else, in the same run, turn by turn. Each is
measured with 1, 16 and 64 concurrent writers, on fast commits and on 2 ms commits: the
benchmark's own connections set `commit_delay=2000` and `commit_siblings=0`, which makes every
WAL flush wait 2 ms, as network storage does (a superuser may set both per session, so the
server's configuration is untouched).

--service measures the same through the service: gunicorn with 8 sync workers on the scratch
database, wrk with 32 connections POSTing animals, on fast and on 2 ms commits in turns.

    python benchmarks/creations.py                       # 1, 16, 64 writers, fast and 2 ms
    python benchmarks/creations.py --writers 16 --duration 10 --rounds 3
    python benchmarks/creations.py --service             # through gunicorn and wrk
    python benchmarks/creations.py --instructions 1000   # instructions an insert, callgrind
    python benchmarks/creations.py --replication         # no standby, async, sync

--instructions counts the CPU instructions the server spends on one creation, the service's
against a plain INSERT, with valgrind's callgrind: the same count whatever else the machine does,
where the throughputs above move with every other process on a 2-core machine. It runs
`postgres --single` on a cluster of its own (tests/postgres_cluster.py), N and then 2N creations
each in a transaction of its own, and takes the difference: what one more creation costs, with
start and end left out. One writer, so no waiting and no lock handed over: the trigger's own
work.

--replication measures what a streaming standby costs the primary's creations (issue 32): the
same pgbench script of the service's creation, on three clusters of its own (never the server
behind --admin-url), all on this machine: a primary with no standby, a primary with an
asynchronous standby and a primary with a synchronous one (a commit returns once the standby has
flushed it), at each writer count in alternating rounds, with the ratios to the no-standby
primary measured in the same run. The clusters run with fsync and full_page_writes on, as a
deployed server does (tests/postgres_cluster.py turns both off, for speed, so each is restarted
with them on). Primary and standby share this machine's two cores and one disk, where a deployed
standby has its own host: the ratios show what waiting for the standby costs, not the figures
of two machines.

Needs pgbench (Debian's postgresql package has it) and, for --service, wrk; the admin URL
(--admin-url, default postgresql://postgres@127.0.0.1:5432/postgres) must be a superuser's.
"""

import argparse
import contextlib
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import psycopg
from http_bench import Server, flask, run_wrk, write_scripts
from psycopg import sql

SLOW_COMMITS = "-c commit_delay=2000 -c commit_siblings=0"
COMMITS = {"fast": "", "2 ms": SLOW_COMMITS}
# Issue 21: the service's creations against plain INSERTs at 16 and 64 writers, and through the
# service, creations/s on 2 ms commits against fast ones.
TARGET_RATIO = 0.8
SERVICE_TARGET_RATIO = 0.85
VERDICTS = {True: "met", False: "NOT met", None: "not measured"}
SAMPLE = {"name": "Benchmark Rex", "category_id": 3, "status": "available"}
# The baseline first: PostgreSQL's defaults (wal_level=replica) already write the WAL a standby
# needs, so the three primaries write the same and differ only in who waits for it.
REPLICATION_SETUPS = ("none", "async", "sync")


def main():
    args = parse_args()
    if args.instructions:
        return measure_instructions(args.instructions)
    if args.replication:
        return measure_replication(args)
    name = f"animal_store_creations_{os.getpid()}"
    admin = args.admin_url
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    database_url = admin.rsplit("/", 1)[0] + "/" + name
    try:
        flask(sqlalchemy_url(database_url), "db", "upgrade")
        if args.service:
            measure_service(database_url, args)
        else:
            measure_database(database_url, args)
    finally:
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(
                sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name))
            )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--admin-url",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a superuser's connection; the scratch database is made and dropped beside it",
    )
    parser.add_argument("--writers", default="1,16,64", help="concurrent writers (1,16,64)")
    parser.add_argument("--duration", type=int, default=5, help="seconds per run (5)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--service", action="store_true", help="through gunicorn and wrk")
    parser.add_argument("--workers", type=int, default=8, help="gunicorn workers (8)")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections (32)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (1)")
    parser.add_argument(
        "--instructions", type=int, metavar="N", help="count instructions with callgrind"
    )
    parser.add_argument(
        "--replication",
        action="store_true",
        help="no standby, async and sync standbys, on clusters of its own",
    )
    return parser.parse_args()


def sqlalchemy_url(url: str, options: str = "") -> str:
    url = url.replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{url}?options={quote(options)}" if options else url


def creation_statements(database_url) -> list[str]:
    """The SQL of one creation as the service runs it, values inlined, for pgbench."""
    import sqlalchemy as sa

    from animal_store import create_app
    from animal_store.data import store
    from animal_store.extensions import db

    app = create_app({"DATABASE_URL": sqlalchemy_url(database_url), "RATELIMIT_ENABLED": False})
    statements = []
    with app.app_context(), psycopg.connect(database_url) as quoting:

        def record(conn, cursor, statement, parameters, context, executemany):
            values = {k: sql.Literal(v).as_string(quoting) for k, v in (parameters or {}).items()}
            statements.append(statement % values if values else statement)

        sa.event.listen(db.engine, "before_cursor_execute", record)
        with db.engine.begin() as connection:
            store.add_pet(connection, dict(SAMPLE))
        sa.event.remove(db.engine, "before_cursor_execute", record)
        db.session.execute(sa.text("TRUNCATE pets"))
        db.session.commit()
    return statements


def write_pgbench_scripts(database_url, workdir) -> dict[str, Path]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        # The same columns, constraints and indexes, an identity for the id, and nothing else.
        connection.execute(
            "CREATE TABLE plain_pets (LIKE pets INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
            "INCLUDING INDEXES)"
        )
        identity = connection.execute(
            "SELECT attidentity FROM pg_attribute "
            "WHERE attrelid = 'plain_pets'::regclass AND attname = 'id'"
        ).fetchone()[0]
        if not identity:
            connection.execute(
                "ALTER TABLE plain_pets ALTER id ADD GENERATED BY DEFAULT AS IDENTITY"
            )
    service = creation_statements(database_url)
    # The service's own INSERT, aimed at the twin table.
    plain = (
        next(s for s in service if s.startswith("INSERT"))
        .replace("INSERT INTO pets ", "INSERT INTO plain_pets ")
        .replace("RETURNING pets.", "RETURNING plain_pets.")
    )
    scripts = {"plain INSERT": [plain], "service": service}
    paths = {}
    for name, statements in scripts.items():
        path = workdir / f"{name.replace(' ', '_')}.sql"
        path.write_text("BEGIN;\n" + "".join(f"{s};\n" for s in statements) + "COMMIT;\n")
        paths[name] = path
    print("the service's creation:", " ; ".join(service))
    return paths


def find_pgbench() -> str:
    found = shutil.which("pgbench") or next(
        iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), reverse=True)), None
    )
    if found is None:
        sys.exit("pgbench is not installed (Debian: postgresql)")
    return found


def run_pgbench(pgbench, database_url, script, writers, duration, options) -> float:
    output = subprocess.run(
        [
            pgbench,
            "--no-vacuum",
            f"--file={script}",
            f"--client={writers}",
            f"--jobs={min(writers, 2)}",
            f"--time={duration}",
            "--protocol=prepared",
            database_url,
        ],
        env={**os.environ, "PGOPTIONS": options},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(re.search(r"tps = ([\d.]+) \(without initial connection time\)", output)[1])


def measure_database(database_url, args):
    pgbench = find_pgbench()
    writers = [int(count) for count in args.writers.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        scripts = write_pgbench_scripts(database_url, Path(workdir))
        print(
            f"pgbench, {args.duration} s a run, {args.rounds} rounds, load {load()}\n"
            f"{'commits':<8}{'writers':>8}{'plain tps':>12}{'service tps':>13}{'ratio':>8}"
        )
        met = None  # nothing measured at 16 writers or more
        for commits, options in COMMITS.items():
            for count in writers:
                tps = {name: [] for name in scripts}
                for _ in range(args.rounds):
                    for name, script in scripts.items():
                        tps[name].append(
                            run_pgbench(
                                pgbench, database_url, script, count, args.duration, options
                            )
                        )
                plain, service = (statistics.median(tps[name]) for name in scripts)
                ratio = statistics.median(
                    s / p for s, p in zip(tps["service"], tps["plain INSERT"], strict=True)
                )
                if count >= 16:
                    met = (met is not False) and ratio >= TARGET_RATIO
                print(f"{commits:<8}{count:>8}{plain:>12,.0f}{service:>13,.0f}{ratio:>8.2f}")
        print(
            f"target: at 16 and more writers, at least {TARGET_RATIO} of plain INSERTs: "
            f"{VERDICTS[met]} (load {load()})"
        )


def measure_service(database_url, args):
    # A key and the production settings, as http_bench.py runs the service.
    key = flask(
        sqlalchemy_url(database_url), "keys", "create", "bench", "--rate-limit", "1000000000/hour"
    ).split()[-1]
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        script = write_scripts(workdir)["create"]
        servers = {}
        for commits, options in COMMITS.items():
            env = {
                "ANIMAL_STORE_ENV": "production",
                "DATABASE_URL": sqlalchemy_url(database_url, options),
            }
            servers[commits] = Server(
                commits.replace(" ", ""), "wsgi:app", args.workers, workdir, env
            )
        try:
            for server in servers.values():
                server.wait_until_serving()
            rps = {commits: [] for commits in servers}
            for _ in range(args.rounds):
                for commits, server in servers.items():
                    rps[commits].append(
                        run_wrk(server, "/v1/pets", key, args, script=script)["rps"]
                    )
        finally:
            for server in servers.values():
                server.stop()
    ratio = statistics.median(s / f for s, f in zip(rps["2 ms"], rps["fast"], strict=True))
    print(
        f"through the service: {args.workers} sync workers, wrk -c{args.connections}, "
        f"{args.rounds} rounds of {args.duration} s (load {load()})"
    )
    for commits, figures in rps.items():
        print(f"  {commits:<6} commits: {statistics.median(figures):8,.0f} creations/s")
    met = "met" if ratio >= SERVICE_TARGET_RATIO else "NOT met"
    print(f"  2 ms / fast: {ratio:.2f} (target at least {SERVICE_TARGET_RATIO}: {met})")


def measure_instructions(count: int) -> None:
    from postgres_cluster import BINDIR, PostgresCluster

    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed (Debian: valgrind)")
    cluster = PostgresCluster()
    stopped = False
    try:
        database_url = cluster.create_database("creations")
        flask(database_url, "db", "upgrade")
        workdir = cluster.directory
        scripts = write_pgbench_scripts(libpq_url(database_url), workdir)
        cluster.run("pg_ctl", "--pgdata", str(cluster.data), "--wait", "stop")
        stopped = True
        print(f"instructions in the server, per creation (callgrind; {count} and {2 * count})")
        per_creation = {}
        for name, script in scripts.items():
            counts = [
                single_user_instructions(cluster, script, n, BINDIR) for n in (count, 2 * count)
            ]
            per_creation[name] = (counts[1] - counts[0]) / count
            print(f"  {name:<13}{per_creation[name]:>12,.0f}")
        ratio = per_creation["plain INSERT"] / per_creation["service"]
        print(f"  plain / service: {ratio:.2f}")
    finally:
        if stopped:
            shutil.rmtree(cluster.directory, ignore_errors=True)
        else:
            cluster.stop()


def measure_replication(args) -> None:
    from postgres_cluster import PostgresCluster

    pgbench = find_pgbench()
    writers = [int(count) for count in args.writers.split(",")]
    with contextlib.ExitStack() as clusters, tempfile.TemporaryDirectory() as workdir:
        primaries = {}
        for setup in REPLICATION_SETUPS:
            # Stopped (and removed) however the run ends, even halfway through; the last made first.
            primary = PostgresCluster(replication=None if setup == "none" else setup)
            clusters.callback(primary.stop)
            primaries[setup] = primary
            prepare_primary(primary, setup, clusters)
        scripts = write_pgbench_scripts(
            libpq_url(primaries["none"].database_url("creations")), Path(workdir)
        )
        urls = {setup: libpq_url(p.database_url("creations")) for setup, p in primaries.items()}
        # Each primary starts just after a checkpoint (a standby's base backup made one), so each
        # writes the same full pages again in its first runs.
        for primary in primaries.values():
            primary.sql("CHECKPOINT")
        print(
            f"pgbench, the service's creation, {args.duration} s a run, {args.rounds} rounds; "
            "clusters of its own on this machine, fsync on\n"
            "the load average is printed before each round (from round 2 it counts this "
            "benchmark's own writers too): figures from a busy machine mean little"
        )
        tps = {(setup, count): [] for setup in urls for count in writers}
        for round_number in range(args.rounds):
            print(f"  round {round_number + 1} load {load()}:", end="", flush=True)
            # Each round starts with the next setup, so none of them is always measured first.
            shift = round_number % len(REPLICATION_SETUPS)
            order = REPLICATION_SETUPS[shift:] + REPLICATION_SETUPS[:shift]
            for count in writers:
                for setup in order:
                    tps[setup, count].append(
                        run_pgbench(
                            pgbench, urls[setup], scripts["service"], count, args.duration, ""
                        )
                    )
                figures = ", ".join(f"{s} {tps[s, count][-1]:,.0f}" for s in REPLICATION_SETUPS)
                print(f" {count} writers: {figures};", end="", flush=True)
            print()
        # A standby that had fallen behind or away would have made its figures those of none.
        for primary in primaries.values():
            for standby in primary.standbys:
                primary.wait_for_streaming(standby, timeout=5)
        print_replication(tps, writers)


def prepare_primary(primary, setup: str, clusters: contextlib.ExitStack) -> None:
    """Make the scratch database on `primary`, with fsync on, and its standby unless `setup` is
    "none", registered in `clusters` to be stopped."""
    url = primary.create_database("creations")
    flask(url, "db", "upgrade")
    with_fsync(primary)
    if setup == "none":
        return
    standby = primary.standby()
    clusters.callback(standby.stop)
    with_fsync(standby)
    # A restarted standby streams again; a sync primary's commits wait for it from then on.
    primary.wait_for_streaming(standby)


def with_fsync(cluster) -> None:
    """Restart `cluster` with fsync and full_page_writes on: postgres_cluster.py turns both off
    on the command line (tests never crash the machine), where ALTER SYSTEM cannot override
    them. A deployed primary flushes each commit, and a sync standby each before it answers."""
    cluster.run("pg_ctl", "--pgdata", str(cluster.data), "--wait", "stop")
    # The later -c wins.
    cluster.options += " -c fsync=on -c full_page_writes=on"
    cluster.start()
    settings = cluster.sql("SHOW fsync; SHOW full_page_writes").split()
    if settings != ["on", "on"]:
        sys.exit(f"fsync and full_page_writes are {settings} on port {cluster.port}, not on")


def print_replication(tps: dict, writers: list[int]) -> None:
    print(f"{'writers':<8}" + "".join(f"{s + ' /s':>12}" for s in REPLICATION_SETUPS), end="")
    print(f"{'async/none':>12}{'sync/none':>11}")
    for count in writers:
        medians = [statistics.median(tps[setup, count]) for setup in REPLICATION_SETUPS]
        # Each round's own ratio, then their median: rounds alternate, so a load that comes and
        # goes weighs on the baseline as on the standbys.
        ratios = [
            statistics.median(
                s / n for s, n in zip(tps[setup, count], tps["none", count], strict=True)
            )
            for setup in ("async", "sync")
        ]
        print(
            f"{count:<8}"
            + "".join(f"{median:>12,.0f}" for median in medians)
            + f"{ratios[0]:>12.2f}{ratios[1]:>11.2f}"
        )
    print(
        f"(load {load()}) Primary and standby share this machine's cores and disk: the ratios "
        "show what waiting for the standby costs, not what two machines would give."
    )


def single_user_instructions(cluster, script: Path, count: int, bindir: Path) -> int:
    """Run the pgbench script `count` times in `postgres --single` under callgrind; return the
    instructions it counted."""
    # Single-user mode with -j ends a statement at a semicolon followed by an empty line.
    statements = [line for line in script.read_text().splitlines() if line.strip()]
    commands = cluster.directory / f"{script.stem}-{count}.sql"
    commands.write_text("".join(f"{line}\n\n" for line in statements) * count)
    output = cluster.directory / f"{script.stem}-{count}.callgrind"
    completed = subprocess.run(
        [
            *cluster.as_postgres,
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={output}",
            str(bindir / "postgres"),
            "--single",
            "-j",
            "-D",
            str(cluster.data),
            "creations",
        ],
        stdin=commands.open(),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(re.search(r"Collected : (\d+)", completed.stderr)[1])


def libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
