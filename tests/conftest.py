"""Fixtures: a fresh, migrated database per test (SQLite file, or PostgreSQL via TEST_DATABASE_URL),
the app and its clients, API keys, sample animals, and live gunicorn servers."""

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
from flask_migrate import upgrade
from nginx_server import NGINX, PROJECT_DIR, Nginx, free_port, make_certificate, stop_process
from playwright.sync_api import sync_playwright
from postgres_cluster import BINDIR, PostgresCluster
from redis_server import REDIS_SERVER, RedisServer

from animal_store import RESOURCES, create_app
from animal_store.access import last_used
from animal_store.access.auth import issue_key
from animal_store.data.models import Pet
from animal_store.extensions import db

TEST_DATABASE_URL = os.environ.get("TEST_DATABASE_URL")

# A test whose subject is not the database (nginx, gunicorn's side, Redis, Prometheus, a browser)
# proves the same on either, so it runs in one of the suite's two passes (docs/development.rst),
# chosen so that CI's passes, which run at once, take about as long: the other pass skips it,
# saying where it runs. The pass without TEST_DATABASE_URL also runs every test that starts
# PostgreSQL clusters of its own.
IN_SQLITE_PASS = pytest.mark.skipif(
    bool(TEST_DATABASE_URL),
    reason="not about the database: runs in the pass without TEST_DATABASE_URL",
)
IN_POSTGRESQL_PASS = pytest.mark.skipif(
    not TEST_DATABASE_URL,
    reason="not about the database: runs in the pass with TEST_DATABASE_URL",
)


def migrate_to_head(database_url):
    app = create_app({"DATABASE_URL": database_url})
    with app.app_context():
        upgrade()
        db.engine.dispose()


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory):
    """Migrate once per run: a template SQLite file to copy, or the PostgreSQL test database."""
    if TEST_DATABASE_URL:
        engine = sa.create_engine(
            create_app({"DATABASE_URL": TEST_DATABASE_URL}).config["SQLALCHEMY_DATABASE_URI"]
        )
        try:
            with engine.begin() as connection:
                connection.execute(sa.text("DROP SCHEMA public CASCADE"))
                connection.execute(sa.text("CREATE SCHEMA public"))
        except sa.exc.OperationalError as error:
            pytest.exit(f"TEST_DATABASE_URL is set but PostgreSQL does not answer: {error}", 2)
        finally:
            engine.dispose()
        migrate_to_head(TEST_DATABASE_URL)
        return TEST_DATABASE_URL
    template = tmp_path_factory.mktemp("template") / "store.sqlite3"
    migrate_to_head(f"sqlite:///{template}")
    return template


def start_own_cluster(**options):
    """Start a PostgreSQL cluster of the test's own (tests/postgres_cluster.py), or skip: such a
    test runs in the pass without TEST_DATABASE_URL, since it brings its own server."""
    if TEST_DATABASE_URL:
        pytest.skip("runs in the pass without TEST_DATABASE_URL: it starts a cluster of its own")
    if BINDIR is None:
        pytest.skip("needs PostgreSQL's server binaries, initdb (Debian: postgresql)")
    return PostgresCluster(**options)


@contextlib.contextmanager
def mounted_tmpfs(mount_point, owner=None):
    """Mount a small tmpfs (4 MiB) the test can fill or make read-only, owned by `owner` if
    given; root only (root ignores file modes). Yields a function that remounts it."""
    mount_point.mkdir(exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("needs mount(8)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")

    def remount(mode):
        subprocess.run(["mount", "-o", f"remount,{mode}", str(mount_point)], check=True)

    try:
        if owner:
            shutil.chown(mount_point, owner, owner)
        yield remount
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(mount_point):
    """Fill the filesystem with a file of its own, until no space is left; return the file."""
    filler = mount_point / "filler"
    with open(filler, "wb", buffering=0) as fill, contextlib.suppress(OSError):
        while True:
            fill.write(b"\0" * 4096)  # until: no space left on device
    return filler


@pytest.fixture
def database_url(migrated_database, tmp_path):
    """An empty database at the latest migration, just for this test."""
    if TEST_DATABASE_URL:
        engine = sa.create_engine(
            create_app({"DATABASE_URL": TEST_DATABASE_URL}).config["SQLALCHEMY_DATABASE_URI"]
        )
        with engine.begin() as connection:
            tables = ", ".join(t for t in db.metadata.tables)
            connection.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
        engine.dispose()
        return TEST_DATABASE_URL
    database_file = tmp_path / "store.sqlite3"
    shutil.copyfile(migrated_database, database_file)
    return f"sqlite:///{database_file}"


@pytest.fixture
def make_app(database_url):
    """Create apps on the test's database with settings overridden, serving RESOURCES or the
    resources given; their pools close after."""
    apps = []

    def make(resources=RESOURCES, **settings):
        config = {"TESTING": True, "DATABASE_URL": database_url, **settings}
        apps.append(create_app(config, resources=resources))
        return apps[-1]

    yield make
    # Nothing a test's requests noted is written after it, into the next test's database.
    flushed = last_used.flush(timeout=30)
    for app in apps:
        with app.app_context():
            db.engine.dispose()
        # The rate limiter's Redis client, where it has one.
        redis_client = app.extensions["animal_store_rate_limits"].redis
        if redis_client is not None:
            redis_client.close()
    assert flushed, "the last-used writer was still busy 30 s after the test"


@pytest.fixture
def app(make_app):
    return make_app()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def runner(app):
    return app.test_cli_runner()


@pytest.fixture
def make_key(app):
    """Create an API key and return the key itself."""

    def make(name="tester"):
        with app.app_context():
            _, key = issue_key(name)
            db.session.commit()
        return key

    return make


@pytest.fixture
def api_key(make_key):
    return make_key()


@pytest.fixture
def auth(api_key):
    """Headers that authenticate as a valid key."""
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture
def make_pet(app):
    """Store an animal directly and return its id."""

    def make(**overrides):
        fields = {"name": "Rex", "category_id": 1, "status": "available"} | overrides
        with app.app_context():
            pet = Pet(**fields)
            db.session.add(pet)
            db.session.commit()
            return pet.id

    return make


@pytest.fixture
def row_counts(app):
    """Return {table: rows} over every table: a request refused before its view changes none."""

    def counts():
        with app.app_context():
            return {
                name: db.session.scalar(sa.select(sa.func.count()).select_from(table))
                for name, table in db.metadata.tables.items()
            }

    return counts


@pytest.fixture
def count_pets(app):
    def count():
        with app.app_context():
            return db.session.scalar(sa.select(sa.func.count()).select_from(Pet))

    return count


# A creation that takes its id, then waits before it commits: the trigger stalls the insert of an
# animal named "Slowpoke" (PostgreSQL sleeps; SQLite, which cannot sleep, counts to six million).
SLOW_INSERT = {
    "postgresql": [
        """CREATE FUNCTION slow_insert() RETURNS trigger AS $$
           BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$ LANGUAGE plpgsql""",
        """CREATE TRIGGER slow_insert AFTER INSERT ON pets FOR EACH ROW
           WHEN (NEW.name = 'Slowpoke') EXECUTE FUNCTION slow_insert()""",
    ],
    "sqlite": [
        """CREATE TRIGGER slow_insert AFTER INSERT ON pets WHEN NEW.name = 'Slowpoke' BEGIN
           SELECT count(*) FROM (WITH RECURSIVE n(i) AS
               (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 6000000) SELECT i FROM n);
           END""",
    ],
}
SLOW_INSERT_CLEANUP = {
    "postgresql": ["DROP TRIGGER slow_insert ON pets", "DROP FUNCTION slow_insert()"],
    "sqlite": ["DROP TRIGGER slow_insert"],
}


@pytest.fixture
def slow_insert(app):
    """Creations of animals named "Slowpoke" take their id, then about 2 s before they commit."""
    with app.app_context():
        statements = SLOW_INSERT[db.engine.dialect.name]
        with db.engine.begin() as connection:
            for statement in statements:
                connection.execute(sa.text(statement))
    yield
    with app.app_context(), db.engine.begin() as connection:
        for statement in SLOW_INSERT_CLEANUP[db.engine.dialect.name]:
            connection.execute(sa.text(statement))


@pytest.fixture(scope="session")
def suite_redis(tmp_path_factory):
    """A redis-server of the suite's own on a free loopback port, started once per run for the
    tests that count in Redis without freezing it, stopped by PID at the end. Never the
    machine's Redis: the suite neither reads, writes nor flushes a server it did not start."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (Debian: redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(suite_redis):
    """The suite's own Redis, emptied: each test's keys start from id 1, so counts left by an
    earlier test would count against it."""
    import redis

    with redis.Redis.from_url(suite_redis.url) as connection:
        connection.flushall()
    return suite_redis.url


@pytest.fixture
def production_env(redis_url):
    """The environment of a server on config/production.py, as deployed but for one setting:
    rate limits count in the suite's own Redis, not in the machine's (redis://127.0.0.1:6379/0)."""
    return {"ANIMAL_STORE_ENV": "production", "ANIMAL_STORE_RATELIMIT_STORAGE_URI": redis_url}


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of the test's own, which it may freeze; stopped by PID afterwards."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (Debian: redis-server)")
    server = RedisServer(tmp_path)
    yield server
    server.stop()


class Gunicorn:
    """A real gunicorn serving wsgi:app with the production config on a loopback port, from the
    checkout or from another `directory` holding a release (its package, config/ and wsgi.py),
    on this Python or on a deployment's."""

    def __init__(
        self,
        database_url,
        workers=2,
        env=None,
        log_path=None,
        directory=PROJECT_DIR,
        python=sys.executable,
    ):
        self.port = free_port()
        self.workers = workers
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environment = {**os.environ, "DATABASE_URL": database_url, **(env or {})}
        if environment.get("ANIMAL_STORE_ENV") and (
            "ANIMAL_STORE_RATELIMIT_STORAGE_URI" not in environment
        ):
            # A deployment's settings file counts in the machine's Redis; a test must not.
            raise ValueError(
                "a deployment's settings count rate limits in the machine's Redis: "
                "start it with the production_env fixture or a RATELIMIT_STORAGE_URI of the test's"
            )
        self.log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                python,
                "-m",
                "gunicorn",
                "-c",
                "config/gunicorn.conf.py",
                "wsgi:app",
                "--bind",
                f"127.0.0.1:{self.port}",
                "--workers",
                str(workers),
            ],
            cwd=directory,
            env=environment,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )

    def wait_until_serving(self, timeout=60):
        """Return once every worker has loaded the app and one of them answers: a test that
        spreads requests over the workers must not find most of them still booting. (A loaded
        2-core machine took 16 s to import the app; one that never serves fails all the same.)"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {self.log()}")
            if self.log().count("Worker ready") < self.workers:
                time.sleep(0.05)
                continue
            try:
                if requests.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except (requests.ConnectionError, requests.Timeout):
                pass  # Refused before gunicorn listens; unanswered while its workers still boot.
            time.sleep(0.05)
        raise RuntimeError(f"gunicorn did not serve within {timeout}s: {self.log()}")

    def log(self):
        return Path(self.log_path).read_text(errors="replace")

    def stop(self):
        stop_process(self.process, timeout=30)
        self.log_file.close()


@pytest.fixture
def start_gunicorn(database_url, tmp_path):
    """Start gunicorn servers on the test's database; every one is stopped by PID afterwards."""
    servers = []

    def start(workers=2, env=None, wait=True, database=database_url, **where):
        log_path = tmp_path / f"gunicorn-{len(servers)}.log"
        server = Gunicorn(database, workers, env, log_path, **where)
        servers.append(server)
        return server.wait_until_serving() if wait else server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def module_database(migrated_database, tmp_path_factory):
    """A database for servers that outlive a test (module_gunicorn): a copy of the migrated
    SQLite template, or the suite's PostgreSQL database, which database_url empties before each
    test that takes it."""
    if TEST_DATABASE_URL:
        return TEST_DATABASE_URL
    copy = tmp_path_factory.mktemp("module-database") / "store.sqlite3"
    shutil.copyfile(migrated_database, copy)
    return f"sqlite:///{copy}"


@pytest.fixture
def emptied_module_database(database_url, module_database):
    """module_database emptied for a test, for a module whose tests' apps (their keys, their
    counts of animals) use the database module_gunicorn serves (its `database_url` returns this):
    a sync worker answers or closes a connection before it takes the next, so no test's requests
    meet another's. On PostgreSQL conftest's database_url has emptied it."""
    if not TEST_DATABASE_URL:
        engine = sa.create_engine(module_database)
        with engine.begin() as connection:
            for table in reversed(db.metadata.sorted_tables):
                connection.execute(table.delete())
        engine.dispose()
    return module_database


@pytest.fixture(scope="module")
def module_gunicorn(module_database, tmp_path_factory):
    """One gunicorn worker on module_database for a module's tests, where what each proves does
    not depend on a fresh server (its boot is seconds: one a test was most of such a module's
    time); stopped by PID after the module."""
    log_path = tmp_path_factory.mktemp("module-gunicorn") / "gunicorn.log"
    server = Gunicorn(module_database, workers=1, log_path=log_path)
    try:
        yield server.wait_until_serving()
    finally:
        server.stop()


# What a release is made of, as gunicorn and `flask` load it from its directory.
RELEASE_FILES = ("animal_store", "config", "wsgi.py")
# A distribution no environment has: what a release that needs one not installed imports.
MISSING_DEPENDENCY = "animal_store_missing_dependency"


def copy_release(directory):
    """Copy the checkout's release files into `directory`; return it."""
    directory.mkdir(exist_ok=True)
    for name in RELEASE_FILES:
        source = PROJECT_DIR / name
        if source.is_dir():
            shutil.copytree(source, directory / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, directory / name)
    return directory


def break_release(directory):
    """Have the release in `directory` need a dependency that is not installed, as one whose
    lock gained a distribution does when `pip install` was skipped; return the error's last
    line, as Python says it."""
    module = directory / "animal_store" / "pets.py"
    module.write_text(f"import {MISSING_DEPENDENCY}\n" + module.read_text())
    return f"ModuleNotFoundError: No module named '{MISSING_DEPENDENCY}'"


@pytest.fixture(scope="session")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1, made by openssl: (certificate, key) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (Debian: openssl)")
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def start_nginx(tmp_path, certificate):
    """Start nginx on the shipped config with the given upstream addresses; stopped afterwards.
    Tests skip where nginx is not installed."""
    if NGINX is None:
        pytest.skip("nginx is not installed (Debian: nginx)")
    servers = []

    def start(upstreams, proxy_read_timeout=None, limit_conn=None, uncapped=()):
        server = Nginx(
            tmp_path / f"nginx-{len(servers)}",
            upstreams,
            *certificate,
            proxy_read_timeout,
            limit_conn=limit_conn,
            uncapped=uncapped,
        )
        servers.append(server)
        return server.wait_until_serving()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def page():
    """A page in headless Chromium that records every request it makes and every console error."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("needs Debian's chromium package (.ci/run installs it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page()
        page.requested_urls = []
        page.console_errors = []
        page.on("request", lambda request: page.requested_urls.append(request.url))
        page.on(
            "console",
            lambda message: message.type == "error" and page.console_errors.append(message.text),
        )
        yield page
        browser.close()


@pytest.fixture
def postgres_url(app):
    """A libpq URL of the test's PostgreSQL database, for transactions the service never runs."""
    with app.app_context():
        if db.engine.dialect.name != "postgresql":
            pytest.skip("PostgreSQL's ordering of ids; SQLite's single writer orders them itself")
        return db.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
