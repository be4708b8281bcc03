"""CPU per request in process: the app's WSGI callable called directly, no server, no network.

The steadiest figure there is for a change on the request path: no wrk, no gunicorn, no kernel
between the two sides, so a few microseconds show. It seeds a SQLite database, makes a key and
measures listPets (a page of 20), getPet and createPet, best of three rounds. With --against, the
same measurement runs on another checkout of the project (a git worktree of the commit before a
change, say) in the same run, alternating, and the ratios are printed:

    git worktree add /tmp/before HEAD~1
    python benchmarks/in_process.py --against /tmp/before

Everything runs as deployed but the server and Redis: the metrics are written to multiprocess
files (PROMETHEUS_MULTIPROC_DIR, a temporary directory, as gunicorn.conf.py sets it), the access
log at INFO to a file standing for stdout, rate limiting on (memory storage) with a limit no run
reaches. With --database-url, on that database instead (PostgreSQL: an empty database of yours;
each run migrates and seeds it):

    python benchmarks/in_process.py --against /tmp/before \
        --database-url postgresql://postgres@127.0.0.1:5432/bench
"""

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
NEW_PET = b'{"name": "Benchmark Rex", "categoryId": 3, "status": "available"}'
REQUESTS = {"list": 4000, "get": 4000, "create": 1500}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout to measure in the same run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--animals", type=int, default=1000, help="animals seeded (1000)")
    parser.add_argument("--database-url", help="the database (default: a fresh SQLite file)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.animals, args.database_url)))
        return
    checkouts = {"this": PROJECT_DIR, **({"against": args.against} if args.against else {})}
    figures = {name: [] for name in checkouts}
    for round_number in range(1, args.rounds + 1):
        for name, checkout in checkouts.items():
            command = [sys.executable, __file__, "--measure", str(checkout)]
            if args.database_url:
                command += ["--database-url", args.database_url]
            result = subprocess.run(
                [*command, "--animals", str(args.animals)],
                capture_output=True,
                text=True,
                check=True,
            )
            figures[name].append(json.loads(result.stdout.splitlines()[-1]))
            print(f"round {round_number} {name:8} {figures[name][-1]}", flush=True)
    print("\nCPU µs per request, best round:")
    best = {
        name: {operation: min(run[operation] for run in runs) for operation in REQUESTS}
        for name, runs in figures.items()
    }
    for operation in REQUESTS:
        line = f"  {operation:7} this {best['this'][operation]:7.1f}"
        if "against" in best:
            against = best["against"][operation]
            line += f"   against {against:7.1f}   ratio {best['this'][operation] / against:.3f}"
        print(line)


def measure(checkout: Path, animals: int, database_url: str | None) -> dict:
    """Return CPU µs per request for each operation, the app imported from `checkout`."""
    # Before prometheus_client is imported: it chooses where values live then.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
    sys.path.insert(0, str(checkout))
    from flask_migrate import upgrade
    from werkzeug.test import EnvironBuilder

    from animal_store import create_app
    from animal_store.access.auth import issue_key
    from animal_store.commands.seed import seed_pets
    from animal_store.extensions import db

    database = Path(tempfile.mkdtemp()) / "store.sqlite3"
    settings = {
        "DATABASE_URL": database_url or f"sqlite:///{database}",
        "LOG_LEVEL": "INFO",
        "RATE_LIMIT": "100000000 per minute",
    }
    app = create_app(settings)
    with app.app_context():
        upgrade()
        seed_pets(animals)
        _, key = issue_key(f"benchmark-{os.getpid()}")  # unique on a reused database
        db.session.commit()
    auth = {"Authorization": f"Bearer {key}"}
    environs = {
        "list": EnvironBuilder("/v1/pets?limit=20", headers=auth).get_environ(),
        "get": EnvironBuilder(f"/v1/pets/{animals // 2}", headers=auth).get_environ(),
        "create": EnvironBuilder(
            "/v1/pets", method="POST", headers=auth, data=NEW_PET, content_type="application/json"
        ).get_environ(),
    }
    statuses = set()

    def start_response(status, headers, exc_info=None):
        statuses.add(status[:3])

    def call(environ):
        request = dict(environ, **{"wsgi.input": io.BytesIO(NEW_PET)})
        b"".join(app.wsgi_app(request, start_response))

    figures = {}
    # The access log's lines go where stdout goes; the figures go to the real stdout after.
    real_stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115
    for operation, environ in environs.items():
        count = REQUESTS[operation]
        for _ in range(200):
            call(environ)
        rounds = []
        for _ in range(3):
            started = time.process_time()
            for _ in range(count):
                call(environ)
            rounds.append((time.process_time() - started) / count * 1e6)
        figures[operation] = round(min(rounds), 1)
    sys.stdout.close()
    sys.stdout = real_stdout
    if statuses - {"200", "201"}:
        raise SystemExit(f"unexpected answers: {sorted(statuses)}")
    return figures


if __name__ == "__main__":
    main()
