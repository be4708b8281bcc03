"""SIGKILL of gunicorn's master and workers in the middle of a write load, three times: after
each restart on the same database every animal whose 201 reached a client is there, unchanged,
the database passes its integrity check, and it takes new writes."""

import os
import signal
import threading
import time
from pathlib import Path

import requests
import sqlalchemy as sa

from animal_store.data.models import Pet
from animal_store.extensions import db

ROUNDS = 3
WRITERS = 8


def children(pid):
    try:
        return [
            int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        ]
    except FileNotFoundError:
        return []


def kill_everything(server):
    """SIGKILL the master and its workers at once, as a power cut of the processes would."""
    workers = children(server.process.pid)
    assert workers, "no gunicorn workers to kill"
    for pid in [server.process.pid, *workers]:
        os.kill(pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def write_until_stopped(url, key, writer, stop, acknowledged, lock):
    n = 0
    with requests.Session() as session:
        session.headers["Authorization"] = f"Bearer {key}"
        while not stop.is_set():
            body = {
                "name": f"w{writer}-{n}",
                "categoryId": writer * 100_000 + n,
                "status": "pending",
            }
            n += 1
            try:
                response = session.post(url, json=body, timeout=5)
            except requests.RequestException:
                continue  # killed mid-request: no answer, no promise
            if response.status_code == 201:
                with lock:
                    acknowledged[response.json()["id"]] = (
                        body["name"],
                        body["categoryId"],
                        "pending",
                    )


def stored_pets(app):
    with app.app_context():
        rows = db.session.execute(sa.select(Pet.id, Pet.name, Pet.category_id, Pet.status))
        return {row.id: (row.name, row.category_id, row.status) for row in rows}


def check_integrity(app):
    with app.app_context():
        db.session.remove()
        db.engine.dispose()  # see the file as a fresh process would
        if db.engine.dialect.name == "sqlite":
            assert db.session.scalar(sa.text("PRAGMA integrity_check")) == "ok"
            db.session.remove()


def test_acknowledged_writes_survive_sigkill(app, make_key, start_gunicorn, tmp_path):
    key = make_key()
    acknowledged, lock = {}, threading.Lock()
    for _ in range(ROUNDS):
        # A killed master cannot remove the metrics directory it made: made in the test's own.
        server = start_gunicorn(workers=2, env={"TMPDIR": str(tmp_path)})
        stop = threading.Event()
        writers = [
            threading.Thread(
                daemon=True,
                target=write_until_stopped,
                args=(server.url + "/v1/pets", key, n, stop, acknowledged, lock),
            )
            for n in range(WRITERS)
        ]
        before = len(acknowledged)
        for writer in writers:
            writer.start()
        try:
            deadline = time.monotonic() + 30
            while len(acknowledged) < before + 100:  # kill in full flow
                assert time.monotonic() < deadline, f"writes stalled: {server.log()[-2000:]}"
                time.sleep(0.01)
            kill_everything(server)
        finally:
            stop.set()
            for writer in writers:
                writer.join(timeout=30)

        check_integrity(app)
        stored = stored_pets(app)
        lost = {pet_id for pet_id in acknowledged if pet_id not in stored}
        assert not lost, f"{len(lost)} acknowledged animals lost"
        assert {pet_id: stored[pet_id] for pet_id in acknowledged} == acknowledged

    # The database takes new writes after the last crash.
    server = start_gunicorn(workers=2)
    response = requests.post(
        server.url + "/v1/pets",
        json={"name": "after", "categoryId": 1},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert response.status_code == 201
    assert stored_pets(app)[response.json()["id"]] == ("after", 1, None)
