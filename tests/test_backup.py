"""Backups of the embedded database while the service writes, and restores while it is stopped;
on PostgreSQL the command points at pg_dump."""

import os
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest
import requests
from conftest import PROJECT_DIR, TEST_DATABASE_URL

from animal_store.extensions import db

on_sqlite = pytest.mark.skipif(
    TEST_DATABASE_URL is not None, reason="SQLite's backup; the PostgreSQL run checks pg_dump's"
)


def flask(database_url, *args):
    """Run `flask --app animal_store ...` as an operator would, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", *args],
        cwd=PROJECT_DIR,
        env={**os.environ, "DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def ids_in(path):
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as copy:
        assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return {row[0] for row in copy.execute("SELECT id FROM pets")}


@on_sqlite
def test_backup_while_the_service_writes_holds_every_acknowledged_animal(
    database_url, api_key, start_gunicorn, tmp_path
):
    server = start_gunicorn(workers=2)
    acknowledged, statuses, stop = [], [], threading.Event()

    def write():
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {api_key}"
            while not stop.is_set():
                response = session.post(
                    server.url + "/v1/pets", json={"name": "Rex", "categoryId": 1}, timeout=30
                )
                statuses.append(response.status_code)
                if response.status_code == 201:
                    acknowledged.append((response.json()["id"], time.monotonic()))

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    try:
        time.sleep(1)
        started = time.monotonic()
        result = flask(database_url, "backup", str(tmp_path / "backup.sqlite3"))
        finished = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        for writer in writers:
            writer.join()
    assert result.returncode == 0, result.stderr
    copied = ids_in(tmp_path / "backup.sqlite3")
    assert {pet_id for pet_id, at in acknowledged if at < started} <= copied
    assert f"{len(copied)} animals, integrity check ok" in result.stdout
    # The service kept serving and writing, during the backup and after it.
    assert set(statuses) == {201}
    assert any(at > finished for _, at in acknowledged)


@on_sqlite
def test_restore_refuses_while_a_server_holds_the_file_then_puts_the_backup_back(
    app, database_url, api_key, start_gunicorn, tmp_path
):
    server = start_gunicorn(workers=1)
    headers = {"Authorization": f"Bearer {api_key}"}
    for name in ("Rex", "Kitty"):
        requests.post(
            server.url + "/v1/pets",
            json={"name": name, "categoryId": 1},
            headers=headers,
            timeout=10,
        )
    assert flask(database_url, "backup", str(tmp_path / "two.sqlite3")).returncode == 0
    polly = {"name": "Polly", "categoryId": 1}
    requests.post(server.url + "/v1/pets", json=polly, headers=headers, timeout=10)

    refused = flask(database_url, "restore", str(tmp_path / "two.sqlite3"))
    assert refused.returncode != 0
    assert "is open in processes" in refused.stderr
    assert "stop the service" in refused.stderr
    assert len(requests.get(server.url + "/v1/pets", headers=headers, timeout=10).json()) == 3

    server.stop()
    with app.app_context():
        db.engine.dispose()  # this test's own connections (the key was made through them)
    restored = flask(database_url, "restore", str(tmp_path / "two.sqlite3"))
    assert restored.returncode == 0, restored.stderr
    assert "2 animals" in restored.stdout
    server = start_gunicorn(workers=1)
    listed = requests.get(server.url + "/v1/pets", headers=headers, timeout=10).json()
    names = [pet["name"] for pet in listed]
    assert names == ["Rex", "Kitty"]


@on_sqlite
@pytest.mark.parametrize("what", ["not-a-database", "another-database", "existing-destination"])
def test_bad_backups_and_restores_are_refused_and_change_nothing(
    database_url, make_pet, count_pets, tmp_path, what
):
    make_pet()
    source = tmp_path / "source"
    if what == "not-a-database":
        source.write_bytes(b"x" * 4096)
        result = flask(database_url, "restore", str(source))
    elif what == "another-database":
        with closing(sqlite3.connect(source)) as other:
            other.execute("CREATE TABLE things (id INTEGER)")
        result = flask(database_url, "restore", str(source))
    else:
        source.write_bytes(b"keep me")
        result = flask(database_url, "backup", str(source))
        assert source.read_bytes() == b"keep me"
    assert result.returncode != 0
    assert "Error:" in result.stderr
    assert count_pets() == 1


@pytest.mark.skipif(TEST_DATABASE_URL is None, reason="PostgreSQL's: set TEST_DATABASE_URL")
@pytest.mark.parametrize("command", ["backup", "restore"])
def test_on_postgresql_the_commands_give_the_pg_dump_line(database_url, tmp_path, command):
    target = tmp_path / "file"
    if command == "restore":
        target.write_bytes(b"")
    result = flask(database_url, command, str(target))
    assert result.returncode != 0
    assert "pg_dump --format=custom --file BACKUP.dump 'postgresql://" in result.stderr
    assert "pg_restore" in result.stderr
    assert not (tmp_path / "file").exists() or command == "restore"
