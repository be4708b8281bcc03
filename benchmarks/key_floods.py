"""A flood of made-up API keys against gunicorn (shipped config), and what it costs the database.

Starts the service under config/gunicorn.conf.py (2 workers by default, counts in a Redis of its
own), then drives it with wrk from one address for --duration seconds, twice: every request
with the same wrong key (`wrk -c16` as the issue tried it), then every request with a key of its
own, made up by a wrk script. For each it prints the answers a second by status (401, 429: the
workers' /metrics) and the key look-ups a second the database saw: scans of the api_keys table
(PostgreSQL's pg_stat_user_tables, read once the workers have exited so their figures are
flushed), over the scans one look-up makes (--scans-per-look-up, 1 for the current query).

    python benchmarks/key_floods.py --database-url postgresql://postgres@127.0.0.1:5432/scratch
    python benchmarks/key_floods.py --database-url ... --project /tmp/before   # another tree
    python benchmarks/key_floods.py --database-url ... --set AUTH_FAILURE_LIMIT=null  # misses only

--project runs another checkout of the store (an earlier commit, `git archive`) with this
interpreter: its animal_store is imported first. The database is migrated and given one key: use
a scratch one. Needs wrk and redis-server.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import sqlalchemy as sa

PROJECT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_DIR / "tests"))
from nginx_server import free_port, stop_process, wait_for_port  # noqa: E402
from redis_server import REDIS_SERVER, RedisServer  # noqa: E402

# A key of its own on every request: 256 bits as the real ones, from wrk's LuaJIT.
DISTINCT_KEYS = """
local counter = 0
request = function()
  counter = counter + 1
  local key = string.format("ask_madeup%08x%08x%08x", math.random(0, 2^31), counter,
                            math.random(0, 2^31))
  return wrk.format("GET", "/v1/pets", {["Authorization"] = "Bearer " .. key})
end
"""


def main():
    args = parse_args()
    for tool, found in (("wrk", shutil.which("wrk")), ("redis-server", REDIS_SERVER)):
        if not found:
            sys.exit(f"{tool} is not installed")
    project = Path(args.project).resolve()
    workdir = Path(tempfile.mkdtemp(prefix="key-floods-"))
    env = {
        **os.environ,
        "PYTHONPATH": str(project),
        "DATABASE_URL": args.database_url,
        "WEB_CONCURRENCY": str(args.workers),
    }
    for setting in args.set:
        name, _, value = setting.partition("=")
        env[f"ANIMAL_STORE_{name}"] = value
    subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", "db", "upgrade"],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
    )
    script = workdir / "distinct.lua"
    script.write_text(DISTINCT_KEYS)
    print(
        f"{project}: {args.workers} workers, wrk -c{args.connections} for {args.duration} s"
        + "".join(f", {setting}" for setting in args.set)
    )
    print(f"{'flood':<10} {'401/s':>8} {'429/s':>8} {'look-ups/s':>11}")
    for name, wrk_args in (
        ("same key", ["-H", "Authorization: Bearer ask_wrong_key_sent_again"]),
        ("distinct", ["-s", str(script)]),
    ):
        redis = RedisServer(workdir)
        scans_before = api_key_scans(args.database_url)
        server = start_gunicorn(project, env, redis.url, workdir / f"{name}.log")
        try:
            url = f"http://127.0.0.1:{server.port}"
            subprocess.run(
                [
                    "wrk",
                    "-t1",
                    f"-c{args.connections}",
                    f"-d{args.duration}s",
                    *wrk_args,
                    url + "/v1/pets",
                ],
                check=True,
                capture_output=True,
            )
            with urllib.request.urlopen(url + "/metrics", timeout=10) as response:  # noqa: S310
                metrics = response.read().decode()
        finally:
            stop_process(server, timeout=30)
            redis.stop()
        time.sleep(1)  # the backends' statistics, flushed as they exit
        scans = api_key_scans(args.database_url) - scans_before
        answered = {status: answers(metrics, status) / args.duration for status in ("401", "429")}
        look_ups = scans / args.scans_per_look_up / args.duration
        print(f"{name:<10} {answered['401']:>8.0f} {answered['429']:>8.0f} {look_ups:>11.1f}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="a scratch PostgreSQL database")
    parser.add_argument("--project", default=str(PROJECT_DIR), help="the checkout to run")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (2)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per flood (10)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="a setting of the service, as ANIMAL_STORE_SETTING=VALUE (JSON)",
    )
    parser.add_argument(
        "--scans-per-look-up", type=float, default=1.0, help="api_keys scans a look-up makes (1)"
    )
    return parser.parse_args()


def start_gunicorn(project, env, redis_url, log_path):
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - the process writes it until it stops
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "config/gunicorn.conf.py",
            "wsgi:app",
            "--bind",
            f"127.0.0.1:{port}",
        ],
        cwd=project,
        env={**env, "ANIMAL_STORE_RATELIMIT_STORAGE_URI": redis_url},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    process.port = port
    wait_for_port(process, port, "gunicorn", lambda: Path(log_path).read_text(), timeout=30)
    time.sleep(2)  # every worker booted
    return process


def answers(metrics: str, status: str) -> float:
    found = re.search(
        rf'^animal_store_requests_total\{{operation="listPets",status="{status}"\}} (\S+)$',
        metrics,
        re.MULTILINE,
    )
    return float(found[1]) if found else 0.0


def api_key_scans(database_url: str) -> int:
    engine = sa.create_engine(database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as connection:
            return connection.execute(
                sa.text(
                    "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) "
                    "FROM pg_stat_user_tables WHERE relname = 'api_keys'"
                )
            ).scalar_one()
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
