"""Each request's answer time and outcome while PostgreSQL hangs, by hand (issue 20).

Starts a PostgreSQL cluster of its own (tests/postgres_cluster.py: initdb in a temporary
directory, never the machine's), gunicorn on the shipped config with 2 workers on it, and
optionally the shipped nginx in front; six clients (two creating, two getting, two listing) send
requests one after another. After a healthy spell the cluster is frozen (SIGSTOP, every process),
then thawed (SIGCONT). Printed: for each phase and operation, the answers by status and code and
their times (median and max), then the time from the thaw to the first success of each operation:

    python benchmarks/hung_database.py                  # straight to gunicorn
    python benchmarks/hung_database.py --via nginx      # through config/nginx.conf
    python benchmarks/hung_database.py --checkout /tmp/before   # another checkout, e.g. main

Needs PostgreSQL's server binaries (initdb), and nginx and openssl for --via nginx. Run as root
or as a user that may run initdb.
"""

import argparse
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_DIR / "tests"))
from nginx_server import Nginx, free_port, make_certificate, stop_process  # noqa: E402
from postgres_cluster import PostgresCluster  # noqa: E402

OPERATIONS = {"create": 2, "get": 2, "list": 2}
NEW_PET = json.dumps({"name": "Rex", "categoryId": 1}).encode()
GUNICORN = (sys.executable, "-m", "gunicorn", "-c", "config/gunicorn.conf.py", "wsgi:app")
# A request unanswered this long is counted as hung (gunicorn would have killed it by then).
CLIENT_TIMEOUT = 60


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", choices=["gunicorn", "nginx"], default="gunicorn")
    parser.add_argument("--checkout", type=Path, default=PROJECT_DIR, help="project to serve")
    parser.add_argument("--healthy", type=float, default=3, help="seconds before the freeze (3)")
    parser.add_argument("--frozen", type=float, default=20, help="seconds frozen (20)")
    parser.add_argument("--after", type=float, default=8, help="seconds after the thaw (8)")
    parser.add_argument("--setting", action="append", default=[], help="NAME=VALUE for the app")
    args = parser.parse_args()

    cluster = PostgresCluster()
    servers = []
    try:
        database_url = cluster.create_database("store")
        key = prepare(args.checkout, database_url)
        environment = {
            **os.environ,
            "DATABASE_URL": database_url,
            **{f"ANIMAL_STORE_{s.split('=', 1)[0]}": s.split("=", 1)[1] for s in args.setting},
        }
        port = free_port()
        log = open(Path(tempfile.mkdtemp()) / "gunicorn.log", "w+b")  # noqa: SIM115
        gunicorn = subprocess.Popen(
            [*GUNICORN, "--bind", f"127.0.0.1:{port}", "--workers", "2"],
            cwd=args.checkout,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        servers.append(lambda: stop_process(gunicorn, 30))
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/healthz")
        if args.via == "nginx":
            directory = Path(tempfile.mkdtemp(prefix="animal-nginx-"))
            nginx = Nginx(
                directory / "nginx", [f"127.0.0.1:{port}"], *make_certificate(directory)
            ).wait_until_serving()
            servers.append(nginx.stop)
            url = nginx.url
        first = request(url, "POST", "/v1/pets", key, NEW_PET)[1]
        pet_id = json.loads(first)["id"]

        results, stop = [], threading.Event()
        clients = [
            threading.Thread(target=client, args=(url, key, operation, pet_id, results, stop))
            for operation, count in OPERATIONS.items()
            for _ in range(count)
        ]
        for thread in clients:
            thread.start()
        time.sleep(args.healthy)
        frozen_at = time.monotonic()
        cluster.freeze()
        time.sleep(args.frozen)
        thawed_at = time.monotonic()
        cluster.thaw()
        time.sleep(args.after)
        stop.set()
        for thread in clients:
            thread.join(CLIENT_TIMEOUT + 5)
        log.seek(0)
        report(args, results, frozen_at, thawed_at, log.read().decode(errors="replace"))
        lost = lost_writes(results, database_url)
        print(f"acknowledged creations missing from the database: {lost}")
    finally:
        for stop_server in reversed(servers):
            stop_server()
        cluster.stop()


def prepare(checkout, database_url) -> str:
    """Migrate the database and make a key, with the served checkout's own code."""
    script = (
        "from flask_migrate import upgrade\n"
        "from animal_store import create_app\n"
        "from animal_store.access.auth import issue_key\n"
        "from animal_store.extensions import db\n"
        f"app = create_app({{'DATABASE_URL': {database_url!r}}})\n"
        "with app.app_context():\n"
        "    upgrade()\n"
        "    _, key = issue_key('hung-database')\n"
        "    db.session.commit()\n"
        "print(key)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=checkout, capture_output=True, text=True, check=True
    )
    return done.stdout.split()[-1]


def lost_writes(results, database_url) -> int:
    import sqlalchemy as sa

    engine = sa.create_engine(database_url)
    with engine.connect() as connection:
        stored = set(connection.scalars(sa.text("SELECT id FROM pets")))
    engine.dispose()
    return sum(1 for r in results if r["status"] == 201 and r["id"] not in stored)


CONTEXT = ssl.create_default_context()
CONTEXT.check_hostname = False
CONTEXT.verify_mode = ssl.CERT_NONE


def request(url, method, path, key, body=None):
    """Return (status, body bytes, headers); status 0 for a dropped or unanswered request."""
    sent = urllib.request.Request(  # noqa: S310 - our own http(s) URLs
        url + path,
        data=body,
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(sent, timeout=CLIENT_TIMEOUT, context=CONTEXT) as answer:  # noqa: S310
            return answer.status, answer.read(), answer.headers
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers
    except (OSError, urllib.error.URLError) as error:
        return 0, str(error).encode(), {}


def client(url, key, operation, pet_id, results, stop):
    method, path, body = {
        "create": ("POST", "/v1/pets", NEW_PET),
        "get": ("GET", f"/v1/pets/{pet_id}", None),
        "list": ("GET", "/v1/pets?limit=5", None),
    }[operation]
    while not stop.is_set():
        started = time.monotonic()
        status, answer, headers = request(url, method, path, key, body)
        result = {
            "operation": operation,
            "started": started,
            "seconds": time.monotonic() - started,
            "status": status,
            "code": None,
            "retry_after": headers.get("Retry-After") if headers else None,
        }
        if status >= 400:
            try:
                result["code"] = json.loads(answer)["code"]
            except ValueError:
                result["code"] = "not JSON"
        elif status == 0:
            result["code"] = "dropped: " + answer.decode()[:40]
        elif status == 201:
            result["id"] = json.loads(answer)["id"]
        results.append(result)


def report(args, results, frozen_at, thawed_at, log):
    print(f"via {args.via}, serving {args.checkout}, settings {args.setting or 'as shipped'}")
    print(f"healthy {args.healthy:.0f} s, frozen {args.frozen:.0f} s, thawed {args.after:.0f} s")
    phases = {
        "healthy": lambda r: r["started"] + r["seconds"] < frozen_at,
        "frozen": lambda r: r["started"] + r["seconds"] >= frozen_at and r["started"] < thawed_at,
        "thawed": lambda r: r["started"] >= thawed_at,
    }
    for phase, belongs in phases.items():
        print(f"\n{phase}: answers by operation (outcome: count, median s, max s)")
        for operation in OPERATIONS:
            mine = [r for r in results if r["operation"] == operation and belongs(r)]
            outcomes = {}
            for r in mine:
                outcome = f"{r['status']} {r['code'] or ''}".strip()
                if r["retry_after"] and r["status"] == 503:
                    outcome += f" (Retry-After {r['retry_after']})"
                outcomes.setdefault(outcome, []).append(r["seconds"])
            cells = [
                f"{outcome}: {len(times)}, {statistics.median(times):.2f}, {max(times):.2f}"
                for outcome, times in sorted(outcomes.items())
            ]
            print(f"  {operation:6} " + ("; ".join(cells) or "none"))
    print("\nfirst success after the thaw, seconds:")
    for operation in OPERATIONS:
        firsts = [
            r["started"] + r["seconds"] - thawed_at
            for r in results
            if r["operation"] == operation and r["status"] < 300 and r["started"] >= thawed_at
        ]
        print(f"  {operation:6} {min(firsts):.2f}" if firsts else f"  {operation:6} none")
    print(f"\ngunicorn log: {log.count('WORKER TIMEOUT')} WORKER TIMEOUT lines")


def wait_for(url, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):  # noqa: S310 - our own URL
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


if __name__ == "__main__":
    main()
