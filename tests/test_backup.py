"""Backups while the service writes and restores while it is stopped, of a SQLite file and of a
PostgreSQL database whose role needs a password; and every bad path refused with a message."""

import contextlib
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import uuid
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
import requests
from alembic.script import ScriptDirectory
from conftest import PROJECT_DIR, TEST_DATABASE_URL, Gunicorn, migrate_to_head
from postgres_cluster import BINDIR, PostgresCluster

from animal_store import create_app
from animal_store.extensions import db

on_sqlite = pytest.mark.skipif(
    TEST_DATABASE_URL is not None,
    reason="SQLite's; PostgreSQL's run on a cluster of their own, without TEST_DATABASE_URL",
)


def flask(database_url, *args, env=None):
    """Run `flask --app animal_store ...` as an operator would, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "animal_store", *args],
        cwd=PROJECT_DIR,
        env={**os.environ, "DATABASE_URL": database_url, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def in_process(database_url, *args):
    """Run `flask ...` in this process, for a test's setup (its animals, its key, the backup it
    restores): a process of its own is what the command under test gets, and each one is seconds
    of importing the app on a busy machine. Asserts it succeeded; returns its output."""
    app = create_app({"DATABASE_URL": database_url})
    try:
        result = app.test_cli_runner().invoke(args=list(args))
    finally:
        with app.app_context():
            db.engine.dispose()  # a restore refuses while other sessions are connected
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


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
@pytest.mark.parametrize("what", ["not-a-database", "another-database"])
def test_restoring_what_is_not_a_backup_is_refused_and_changes_nothing(
    database_url, make_pet, count_pets, tmp_path, what
):
    make_pet()
    source = tmp_path / "source"
    if what == "not-a-database":
        source.write_bytes(b"x" * 4096)
    else:
        with closing(sqlite3.connect(source)) as other:
            other.execute("CREATE TABLE things (id INTEGER)")
    result = flask(database_url, "restore", str(source))
    assert result.returncode != 0
    assert "is not an Animal Store database" in result.stderr
    assert "Traceback" not in result.stderr
    assert count_pets() == 1


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process may not create files in. Root may write anywhere else, but not
    in sysfs, which refuses every new file."""
    if os.geteuid() == 0:
        return Path("/sys")
    directory = tmp_path / "read-only"
    directory.mkdir(mode=0o555)
    return directory


# command, path (from the test's directory), what stderr says, exit status (click's own checks
# of the argument exit 2, the command's refusals 1).
BAD_PATHS = {
    "backup to a missing directory": (
        "backup",
        lambda tmp: tmp / "missing" / "backup.sqlite3",
        "Error: The directory {parent} does not exist: make it first (install -d -m 700 {parent})",
        1,
    ),
    "backup without permission": (
        "backup",
        lambda tmp: unwritable_directory(tmp) / f"animal-store-{uuid.uuid4().hex}.sqlite3",
        "Error: Cannot create {path}: Permission denied.",
        1,
    ),
    "backup onto an existing file": (
        "backup",
        lambda tmp: tmp / "existing.sqlite3",
        "Error: {path} exists already: give a new file.",
        1,
    ),
    "backup to a directory": ("backup", lambda tmp: tmp, "is a directory", 2),
    "backup under a file": (
        "backup",
        lambda tmp: tmp / "existing.sqlite3" / "backup.sqlite3",
        "Error: {parent} is not a directory.",
        1,
    ),
    "restore of a missing file": ("restore", lambda tmp: tmp / "missing.sqlite3", "not exist", 2),
    "restore of a directory": ("restore", lambda tmp: tmp, "is a directory", 2),
}


@on_sqlite
@pytest.mark.parametrize("case", BAD_PATHS.values(), ids=BAD_PATHS.keys())
def test_bad_paths_are_refused_with_a_message_and_change_nothing(
    database_url, make_pet, count_pets, tmp_path, case
):
    command, make_path, message, status = case
    make_pet()
    (tmp_path / "existing.sqlite3").write_bytes(b"keep me")
    path = make_path(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    result = flask(database_url, command, str(path))
    assert result.returncode == status, result.stderr
    assert message.format(path=path, parent=path.parent) in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing made, nothing overwritten, the database as it was.
    assert sorted(tmp_path.rglob("*")) == before
    assert (tmp_path / "existing.sqlite3").read_bytes() == b"keep me"
    assert count_pets() == 1


@on_sqlite
def test_restore_into_a_directory_that_is_gone_says_so(database_url, tmp_path):
    in_process(database_url, "backup", str(tmp_path / "backup.sqlite3"))
    gone = tmp_path / "gone" / "store.sqlite3"
    result = flask(f"sqlite:///{gone}", "restore", str(tmp_path / "backup.sqlite3"))
    assert result.returncode == 1
    assert f"Error: Copying {tmp_path}/backup.sqlite3 to {gone} failed: unable to open" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not gone.parent.exists()


@on_sqlite
def test_restore_into_a_database_in_memory_says_so(database_url, tmp_path):
    in_process(database_url, "backup", str(tmp_path / "backup.sqlite3"))
    result = flask("sqlite://", "restore", str(tmp_path / "backup.sqlite3"))
    assert result.returncode == 1
    assert "Error: The database is in memory (sqlite://): it has no file to restore." in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


@on_sqlite
def test_sqlite_backup_is_readable_by_its_owner_only(database_url, tmp_path):
    result = flask(database_url, "backup", str(tmp_path / "backup.sqlite3"))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((tmp_path / "backup.sqlite3").stat().st_mode) == 0o600


# PostgreSQL, on a cluster of the test's own where every TCP connection must give its password.

# Characters a URL must percent-encode and a libpq password file must escape (a test role's, on
# the test's own cluster).
PASSWORD = "p@ss:w/rd %41\\ #?"  # noqa: S105
HEAD = ScriptDirectory(PROJECT_DIR / "animal_store" / "migrations").get_current_head()
on_own_cluster = pytest.mark.skipif(
    TEST_DATABASE_URL is not None,
    reason="runs in the pass without TEST_DATABASE_URL: it starts a cluster of its own",
)


@pytest.fixture(scope="module")
def password_cluster():
    if BINDIR is None:
        pytest.skip("needs PostgreSQL's server binaries, initdb (Debian: postgresql)")
    cluster = PostgresCluster(passwords=True)
    yield cluster
    cluster.stop()


@pytest.fixture
def store(password_cluster):
    """A database owned by a role of its own that needs PASSWORD: its URL, percent-encoded as
    the docs say, and the libpq keywords to reach it without the password."""
    return make_store(password_cluster)


def make_store(password_cluster):
    name = f"store_{uuid.uuid4().hex[:12]}"
    password_cluster.create_role(name, PASSWORD)
    password_cluster.create_database(name, owner=name)
    url = f"postgresql://{name}:{quote(PASSWORD, safe='')}@127.0.0.1:{password_cluster.port}/{name}"
    keywords = {"host": "127.0.0.1", "port": password_cluster.port, "user": name, "dbname": name}
    return url, keywords


@pytest.fixture
def tool_shims(tmp_path):
    """pg_dump and pg_restore first on PATH: each writes its arguments and environment to a
    file, then runs the real tool. Returns (PATH, the file)."""
    shims, record = tmp_path / "shims", tmp_path / "tool-calls.txt"
    shims.mkdir()
    for program in ("pg_dump", "pg_restore"):
        real = shutil.which(program)
        if real is None:
            pytest.skip(f"{program} is not installed (Debian: postgresql-client)")
        shim = shims / program
        shim.write_text(
            f'#!/bin/sh\nprintf "%s\\n" "$0" "$@" >>{record}\nenv >>{record}\nexec {real} "$@"\n'
        )
        shim.chmod(0o755)
    return f"{shims}:{os.environ['PATH']}", record


def count_animals(keywords):
    with psycopg.connect(**keywords, password=PASSWORD) as connection:
        return connection.execute("SELECT count(*) FROM pets").fetchone()[0]


@on_own_cluster
def test_postgres_backup_and_restore_with_a_password_role(
    password_cluster, store, tool_shims, tmp_path
):
    url, keywords = store
    path, record = tool_shims
    # The role does need its password: without one the server refuses.
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(**keywords, passfile=tmp_path / "none", connect_timeout=5).close()
    no_schema = flask(url, "keys", "list")
    assert no_schema.returncode == 1
    assert "run `flask --app animal_store db upgrade`" in no_schema.stderr
    migrate_to_head(url)
    in_process(url, "seed", "3")
    key = in_process(url, "keys", "create", "shop").strip().splitlines()[-1]

    dump = tmp_path / "store.dump"
    backup = flask(url, "backup", str(dump), env={"PATH": path, "PGPASSWORD": "wrong"})
    assert backup.returncode == 0, backup.stderr
    assert f"Database: postgresql+psycopg://{keywords['user']}:***@127.0.0.1" in backup.stderr
    assert f"3 animals, 1 API key, migration {HEAD}" in backup.stdout
    assert "pg_restore --list reads" in backup.stdout
    assert "with the data of alembic_version, api_keys, idempotency_records, pets" in backup.stdout
    assert stat.S_IMODE(dump.stat().st_mode) == 0o600
    in_process(url, "seed", "2")
    assert count_animals(keywords) == 5

    # While the service is connected, a restore is refused and changes nothing.
    server = Gunicorn(url, workers=1, log_path=tmp_path / "gunicorn.log").wait_until_serving()
    try:
        headers = {"Authorization": f"Bearer {key}"}
        assert requests.get(server.url + "/v1/pets", headers=headers, timeout=10).ok
        refused = flask(url, "restore", str(dump), env={"PATH": path})
        assert refused.returncode == 1
        assert "Other sessions are connected to the database" in refused.stderr
        assert "Stop the service" in refused.stderr
        assert count_animals(keywords) == 5
    finally:
        server.stop()

    restore = flask(url, "restore", str(dump), env={"PATH": path, "PGPASSWORD": "wrong"})
    assert restore.returncode == 0, restore.stderr
    assert "3 animals, 1 API key. Start the service again." in restore.stdout
    server = Gunicorn(url, workers=1, log_path=tmp_path / "gunicorn-2.log").wait_until_serving()
    try:
        listed = requests.get(server.url + "/v1/pets", headers=headers, timeout=10)
        assert [pet["id"] for pet in listed.json()] == [1, 2, 3]
    finally:
        server.stop()

    # Onto a new, empty database (a new server): the schema comes with the backup.
    empty = f"empty_{uuid.uuid4().hex[:12]}"
    password_cluster.create_database(empty, owner=keywords["user"])
    onto_empty = flask(url.rsplit("/", 1)[0] + f"/{empty}", "restore", str(dump))
    assert onto_empty.returncode == 0, onto_empty.stderr
    assert "3 animals, 1 API key. Start the service again." in onto_empty.stdout
    assert count_animals({**keywords, "dbname": empty}) == 3

    # The password was on no command line, in no environment variable and in nothing printed.
    calls = record.read_text()
    assert calls.count("pg_dump") >= 1
    assert "pg_restore" in calls
    # (The backup and the restore succeeded with a wrong PGPASSWORD set: it was not passed on.)
    assert "PGPASSFILE=/dev/fd/" in calls
    for output in (calls, backup.stdout, backup.stderr, restore.stdout, restore.stderr):
        assert PASSWORD not in output
        assert quote(PASSWORD, safe="") not in output


def connect_as(role, cluster, keywords, application_name):
    """Open a session in the store's database: the superuser's over the Unix socket (an
    operator's `sudo -u postgres psql store`), or the app's own role's over TCP."""
    if role == "postgres":
        return psycopg.connect(
            host=str(cluster.directory),
            port=cluster.port,
            user="postgres",
            dbname=keywords["dbname"],
            application_name=application_name,
        )
    return psycopg.connect(**keywords, password=PASSWORD, application_name=application_name)


# Who else is connected when the app's role (no superuser, to whom PostgreSQL hides much of
# other roles' sessions) asks for a restore.
OTHER_SESSIONS = {
    "another role's session": ("postgres",),
    "a session of the app's role": ("app",),
    "both": ("postgres", "app"),
}


def store_and_backup(password_cluster, directory):
    """Make a store whose backup (returned last) holds 3 animals and that now holds 5."""
    url, keywords = make_store(password_cluster)
    migrate_to_head(url)
    in_process(url, "seed", "3")
    dump = directory / "store.dump"
    assert flask(url, "backup", str(dump)).returncode == 0, "backup"
    in_process(url, "seed", "2")
    return url, keywords, dump


@pytest.fixture(scope="module")
def refused_store(password_cluster, tmp_path_factory):
    """A store and its backup for the tests whose restore is refused, and so changes nothing."""
    return store_and_backup(password_cluster, tmp_path_factory.mktemp("refused"))


@on_own_cluster
@pytest.mark.parametrize("roles", OTHER_SESSIONS.values(), ids=OTHER_SESSIONS.keys())
def test_restore_refuses_while_any_other_session_is_connected_naming_each(
    password_cluster, refused_store, roles
):
    url, keywords, dump = refused_store
    with psycopg.connect(**keywords, password=PASSWORD) as connection:
        superuser = "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        assert connection.execute(superuser).fetchone() == (False,)
    with contextlib.ExitStack() as stack:
        sessions = {
            stack.enter_context(
                connect_as(role, password_cluster, keywords, f"{role}-shell")
            ).info.backend_pid: role
            for role in roles
        }
        refused = flask(url, "restore", str(dump))
    assert refused.returncode == 1, refused.stdout
    user = keywords["user"]
    named = {
        # PostgreSQL shows the app's role no address for another role's session.
        "postgres": "role postgres, application postgres-shell, its address not shown to role "
        + user,
        "app": f"role {user}, application app-shell, from 127.0.0.1",
    }
    listed = ", ".join(f"pid {pid} ({named[role]})" for pid, role in sorted(sessions.items()))
    assert (
        f"Error: Other sessions are connected to the database: {listed}. Stop the service "
        "(every gunicorn instance on it) and end these sessions before restoring."
    ) in refused.stderr
    assert "Traceback" not in refused.stderr
    assert count_animals(keywords) == 5


@on_own_cluster
def test_restore_goes_ahead_while_autovacuum_works_on_the_database(password_cluster, tmp_path):
    url, keywords, dump = store_and_backup(password_cluster, tmp_path)
    # A table autovacuum works through for minutes (a pause of 400 ms a page), so its worker is
    # in the store's database while the restore looks; a naptime of a second to start it soon.
    database = keywords["dbname"]
    password_cluster.sql(
        "CREATE TABLE slow WITH (autovacuum_vacuum_cost_delay = 100, "
        "autovacuum_vacuum_cost_limit = 1) AS SELECT g FROM generate_series(1, 100000) AS g; "
        "DELETE FROM slow WHERE g % 2 = 0;",
        database,
    )
    workers = (
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'autovacuum worker' "
        "AND datname = current_database()"
    )
    password_cluster.sql("ALTER SYSTEM SET autovacuum_naptime = 1; SELECT pg_reload_conf();")
    try:
        deadline = time.monotonic() + 120
        while not password_cluster.sql(workers, database).strip():
            assert time.monotonic() < deadline, "no autovacuum worker started"
            time.sleep(0.2)
        restore = flask(url, "restore", str(dump))
    finally:
        password_cluster.sql("ALTER SYSTEM RESET autovacuum_naptime; SELECT pg_reload_conf();")
        password_cluster.sql("DROP TABLE slow", database)  # autovacuum yields its lock
    assert restore.returncode == 0, restore.stderr
    assert "3 animals, 0 API keys. Start the service again." in restore.stdout
    assert count_animals(keywords) == 3


def other_database_dump(cluster, tmp_path):
    """A custom-format dump of a database that is not this service's."""
    name = f"other_{uuid.uuid4().hex[:12]}"
    cluster.create_database(name)
    cluster.sql("CREATE TABLE things (id integer); INSERT INTO things VALUES (1);", name)
    inside = cluster.directory / f"{name}.dump"
    cluster.run(
        "pg_dump",
        "--host",
        str(cluster.directory),
        "--port",
        str(cluster.port),
        "--username",
        "postgres",
        "--format=custom",
        "--file",
        str(inside),
        name,
    )
    shutil.copyfile(inside, tmp_path / "other.dump")
    return tmp_path / "other.dump"


POSTGRES_REFUSALS = {
    "restore of a file that is not a dump": (
        "restore",
        lambda cluster, tmp: tmp / "existing",
        {},
        "is not a pg_dump archive (custom format): pg_restore failed",
    ),
    "restore of another database's dump": (
        "restore",
        other_database_dump,
        {},
        "is not an Animal Store backup: no data for alembic_version, api_keys, pets.",
    ),
    "backup onto an existing file": (
        "backup",
        lambda cluster, tmp: tmp / "existing",
        {},
        "exists already: give a new file.",
    ),
    "backup to a missing directory": (
        "backup",
        lambda cluster, tmp: tmp / "missing" / "store.dump",
        {},
        "does not exist",
    ),
    "backup without pg_dump": (
        "backup",
        lambda cluster, tmp: tmp / "store.dump",
        {"PATH": "/nonexistent"},
        "pg_dump is not installed (Debian: postgresql-client",
    ),
    "backup through PgBouncer": (
        "backup",
        lambda cluster, tmp: tmp / "store.dump",
        {"ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true"},
        "need a session of their own",
    ),
    "restore through PgBouncer": (
        "restore",
        lambda cluster, tmp: tmp / "existing",
        {"ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true"},
        "need a session of their own",
    ),
}


@on_own_cluster
@pytest.mark.parametrize("case", POSTGRES_REFUSALS.values(), ids=POSTGRES_REFUSALS.keys())
def test_postgres_refusals_say_why_and_change_nothing(password_cluster, store, tmp_path, case):
    command, make_path, env, message = case
    url, keywords = store
    migrate_to_head(url)
    in_process(url, "seed", "2")
    (tmp_path / "existing").write_bytes(b"keep me")
    path = make_path(password_cluster, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    result = flask(url, command, str(path), env=env)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(tmp_path.rglob("*")) == before
    assert (tmp_path / "existing").read_bytes() == b"keep me"
    assert count_animals(keywords) == 2
