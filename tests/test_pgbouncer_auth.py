"""PgBouncer as docs/deploy.rst sets it up, with a deployment's authentication: a cluster of the
test's own that wants passwords (scram-sha-256), the role and database made by step 2's commands,
PgBouncer's files made by the commands of Many instances: PgBouncer (config/pgbouncer.ini copied,
the userlist from the docs' query on pg_authid), the shipped file left as it is but for ports,
paths and each [databases] line the docs give (its host and port the cluster's), and gunicorn
through PgBouncer with the role's password creating and reading an animal.

tests/test_deploy.py's PgBouncer trusts its clients (auth_type = trust) and gives the server a
password of its own, so it cannot see a server login that PgBouncer cannot make.

The documented commands run in bash as written, against this cluster alone: PGHOST and PGPORT
name it (runuser keeps the environment), and a first psql checks that they reach it, never the
machine's PostgreSQL.
"""

import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import requests
from conftest import migrate_to_head, start_own_cluster
from nginx_server import PROJECT_DIR, free_port, stop_process, substitute, wait_for_port
from pgbouncer_server import PGBOUNCER, SHIPPED_CONFIG

from animal_store import create_app
from animal_store.access.auth import issue_key
from animal_store.extensions import db

pytestmark = [
    pytest.mark.skipif(PGBOUNCER is None, reason="PgBouncer is not installed (Debian: pgbouncer)"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]

DEPLOY = PROJECT_DIR / "docs" / "deploy.rst"
DOCS = DEPLOY.read_text()


def literal_block(start: str) -> str:
    """The first literal block (after a "::") from the line that begins with `start`,
    unindented, as an operator pastes it."""
    match = re.search(
        rf"^ *{re.escape(start)}.*?::\n\n((?: {{4,}}[^\n]*\n|\n)+)", DOCS, re.MULTILINE | re.DOTALL
    )
    assert match, f"docs/deploy.rst: no literal block after {start!r}"
    return textwrap.dedent(match[1])


# Step 2: the role, its password and its database.
ROLE_STEP = literal_block("2. The database")
# Many instances: PgBouncer: the shipped file copied, the userlist, the role's statement timeout
# (the package's installation aside: the test runs the PgBouncer installed).
PGBOUNCER_STEP = "".join(
    line
    for line in literal_block("The standard answer is PgBouncer").splitlines(keepends=True)
    if not line.startswith("apt-get ")
)
# Every [databases] line the docs give PgBouncer: on the database machine, and through HAProxy.
DATABASE_LINES = sorted(set(re.findall(r"^ +(store = host=.*)$", DOCS, re.MULTILINE)))


def test_the_docs_give_the_steps_and_lines_this_test_runs():
    assert "createdb --owner store store" in ROLE_STEP
    assert "FROM pg_authid" in PGBOUNCER_STEP
    assert "/etc/pgbouncer/userlist.txt" in PGBOUNCER_STEP
    assert len(DATABASE_LINES) == 2, DATABASE_LINES


class Shell:
    """bash running documented commands as root runs them, against `cluster` alone."""

    def __init__(self, cluster, directory: Path):
        self.cluster = cluster
        self.directory = directory
        self.env = {**os.environ, "PGHOST": str(cluster.directory), "PGPORT": str(cluster.port)}
        if os.geteuid() != 0:  # the cluster runs as this user, its superuser called postgres
            self.env["PGUSER"] = "postgres"
        shown = self.run("runuser -u postgres -- psql -Atc 'SHOW port'")
        assert shown.strip() == str(cluster.port), "psql reached another server than the test's"

    def run(self, commands: str) -> str:
        """Run `commands`, stopping at the first that fails (which fails the test); return
        what they printed."""
        result = self.paste(commands, "-e")
        assert result.returncode == 0, f"{result.args}\n{result.stdout}{result.stderr}"
        return result.stdout

    def paste(self, commands: str, *options: str) -> subprocess.CompletedProcess:
        """Run `commands` as pasted into root's shell: each whatever the ones before it did
        (unless `options` say otherwise), with no terminal to ask a password from (a new
        session: a command that wants one reads /dev/tty and fails, not wait at the test's)."""
        commands = commands.replace("/root/", f"{self.directory}/")
        commands = commands.replace("/etc/pgbouncer/", f"{self.directory}/")
        commands = commands.replace("/srv/animal-store/", f"{PROJECT_DIR}/")
        assert not re.search(r"(^|\s)(-h|--host|-p|--port)\b", commands), commands
        if os.geteuid() != 0:
            commands = commands.replace("runuser -u postgres -- ", "")
        return subprocess.run(
            ["bash", *options, "-c", commands],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.directory,
            timeout=60,
            start_new_session=True,
        )


class DocumentedPgBouncer:
    """PgBouncer on the file the PgBouncer step copied into `directory`, as the docs have it
    edited: `line` under [databases], its host and port the cluster's; only its own port,
    log, pid and userlist paths besides, its clients authenticated as shipped."""

    def __init__(self, directory: Path, line: str, cluster):
        self.directory = directory
        self.port = free_port()
        config_path = directory / "pgbouncer.ini"
        line = substitute(r"host=\S+ port=\d+", f"host=127.0.0.1 port={cluster.port}", line, 1)
        config = config_path.read_text()
        assert config == SHIPPED_CONFIG.read_text()
        config = substitute(r"^store = .*$", line, config, 1, SHIPPED_CONFIG)
        for setting, value in [
            ("listen_port", str(self.port)),
            ("auth_file", f"{directory}/userlist.txt"),
            ("logfile", f"{directory}/pgbouncer.log"),
            ("pidfile", f"{directory}/pgbouncer.pid"),
        ]:
            config = substitute(
                rf"^{setting} = .*$", f"{setting} = {value}", config, 1, SHIPPED_CONFIG
            )
        # No Unix socket; started as root, PgBouncer must run as another user.
        config += "unix_socket_dir =\n" + ("user = postgres\n" if os.geteuid() == 0 else "")
        config_path.write_text(config)
        for path in directory.iterdir():
            path.chmod(0o644)
        self.process = subprocess.Popen(
            [PGBOUNCER, str(config_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        wait_for_port(self.process, self.port, "pgbouncer", self.log)

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        stop_process(self.process, timeout=10)


@pytest.fixture
def directory():
    """Where the documented commands put /root's and /etc/pgbouncer's files: readable by
    PgBouncer, which runs as postgres when the test runs as root."""
    path = Path(tempfile.mkdtemp(prefix="animal-pgbouncer-auth-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    "line", DATABASE_LINES, ids=[re.search(r"port=\d+", line)[0] for line in DATABASE_LINES]
)
def test_pgbouncer_as_documented_logs_in_with_scram_and_serves(
    line, directory, start_gunicorn, production_env
):
    cluster = start_own_cluster(passwords=True)
    bouncer = None
    try:
        shell = Shell(cluster, directory)
        shell.run(ROLE_STEP)
        password = (directory / "store-password").read_text().strip()
        direct = f"postgresql://store:{password}@127.0.0.1:{cluster.port}/store"
        migrate_to_head(direct)  # step 4, before PgBouncer
        app = create_app({"DATABASE_URL": direct})
        with app.app_context():
            _, key = issue_key("tester")
            db.session.commit()
            db.engine.dispose()

        shell.run(PGBOUNCER_STEP)
        assert (directory / "userlist.txt").read_text().startswith('"store" "SCRAM-SHA-256$')
        bouncer = DocumentedPgBouncer(directory, line, cluster)

        # The instances' DATABASE_URL through PgBouncer, as the docs give it.
        env = {**production_env, "ANIMAL_STORE_DATABASE_BEHIND_PGBOUNCER": "true"}
        url = f"postgresql://store:{password}@127.0.0.1:{bouncer.port}/store"
        gunicorn = start_gunicorn(workers=1, env=env, database=url)
        auth = {"Authorization": f"Bearer {key}"}
        created = requests.post(
            f"{gunicorn.url}/v1/pets",
            json={"name": "Rex", "categoryId": 1},
            headers=auth,
            timeout=10,
        )
        assert created.status_code == 201, f"{created.text}\n{bouncer.log()[-2000:]}"
        read = requests.get(created.headers["Location"], headers=auth, timeout=10)
        assert (read.status_code, read.json()) == (200, created.json())
        assert "Starting anyway" not in gunicorn.log()
        assert "login attempt: db=store user=store" in bouncer.log()
        assert "ERROR" not in bouncer.log()
    finally:
        if bouncer is not None:
            bouncer.stop()
        cluster.stop()
