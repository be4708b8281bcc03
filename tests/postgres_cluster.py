"""A PostgreSQL cluster of a test's own: initdb in a temporary directory, started on a free
loopback port, frozen and thawed with SIGSTOP and SIGCONT, stopped, all by PID. With
`passwords=True` a TCP connection must give its role's password (scram-sha-256), as on a
deployed server; the machine's shared server trusts every local connection, so a password tested
there proves nothing.

Never the machine's shared PostgreSQL: only the processes this cluster's postmaster started are
ever signalled. Standard library only: benchmarks/hung_database.py runs one too.
"""

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from nginx_server import free_port


def find_bindir() -> Path | None:
    """Return the directory of initdb, postgres and pg_ctl, or None where PostgreSQL's server
    binaries are not installed (Debian keeps them out of PATH, in /usr/lib/postgresql/N/bin)."""
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    if shutil.which("pg_config"):
        bindir = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        if (Path(bindir.stdout.strip()) / "initdb").is_file():
            return Path(bindir.stdout.strip())
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(candidates[-1]).parent if candidates else None


BINDIR = find_bindir()


class PostgresCluster:
    """A throwaway cluster: superuser `postgres`, loopback only; trust authentication, or
    scram-sha-256 passwords over TCP with `passwords=True` (the Unix socket, which only this
    class uses, always trusts).

    As root the server runs as the `postgres` user (PostgreSQL refuses to run as root), through
    `runuser`, so the directory is handed to that user.
    """

    def __init__(self, passwords: bool = False):
        if BINDIR is None:
            raise RuntimeError("PostgreSQL's initdb is not installed")
        self.directory = Path(tempfile.mkdtemp(prefix="animal-postgres-"))
        self.data = self.directory / "data"
        self.port = free_port()
        self.as_postgres = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.directory, user.pw_uid, user.pw_gid)
            self.as_postgres = ["runuser", "-u", "postgres", "--"]
        authentication = ["--auth", "trust"]
        self.superuser_password = None
        if passwords:
            # initdb wants the superuser's password when connections must give one.
            self.superuser_password = secrets.token_urlsafe(16)
            password_file = self.directory / "superuser-password"
            password_file.write_text(self.superuser_password + "\n")
            if self.as_postgres:
                shutil.chown(password_file, "postgres", "postgres")
            authentication = [
                "--auth-local",
                "trust",
                "--auth-host",
                "scram-sha-256",
                "--pwfile",
                str(password_file),
            ]
        self.run(
            "initdb",
            "--pgdata",
            str(self.data),
            "--username",
            "postgres",
            *authentication,
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            "--no-sync",
        )
        # fsync off: these tests freeze processes, they never crash the machine, and it saves
        # seconds of CI on every commit.
        options = (
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off"
        )
        self.run(
            "pg_ctl",
            "--pgdata",
            str(self.data),
            "--log",
            str(self.directory / "postgres.log"),
            "--options",
            options,
            "--wait",
            "start",
        )
        self.postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        password = f":{self.superuser_password}" if passwords else ""
        self.url = f"postgresql+psycopg://postgres{password}@127.0.0.1:{self.port}"

    def run(self, program, *arguments, stdin: str | None = None) -> str:
        return subprocess.run(
            [*self.as_postgres, str(BINDIR / program), *arguments],
            check=True,
            capture_output=True,
            cwd=self.directory,
            input=stdin,
            text=True,
        ).stdout

    def sql(self, statements: str, database: str = "postgres") -> str:
        """Run SQL as the superuser over the Unix socket (no password), from stdin, so a
        password in it is on no command line; return psql's unaligned output."""
        return self.run(
            "psql",
            "--host",
            str(self.directory),
            "--port",
            str(self.port),
            "--username",
            "postgres",
            "--dbname",
            database,
            "--no-psqlrc",
            "--quiet",
            "--tuples-only",
            "--no-align",
            "--set",
            "ON_ERROR_STOP=1",
            stdin=statements,
        )

    def database_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def create_database(
        self, name: str, template: str | None = None, owner: str | None = None
    ) -> str:
        """Create a database, a copy of `template` if given, and return its URL."""
        copy = ["--template", template] if template else []
        owned = ["--owner", owner] if owner else []
        self.run(
            "createdb", "--host", str(self.directory), "--port", str(self.port), *copy, *owned, name
        )
        return self.database_url(name)

    def create_role(self, name: str, password: str) -> None:
        """Create a login role that must give `password` over TCP (with `passwords=True`)."""
        # Dollar-quoted: the password may hold any character but the quote's tag.
        self.sql(f"CREATE ROLE {name} LOGIN PASSWORD $secret${password}$secret$")

    def processes(self) -> list[int]:
        """Return the postmaster's PID and those of its children (backends, background
        workers), read from /proc."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == self.postmaster:
                children.append(int(stat.parent.name))
        return [self.postmaster, *children]

    def freeze(self) -> None:
        """Stop every process of the cluster (SIGSTOP): it accepts connections (the kernel does)
        and answers nothing, as a stalled host or a partition looks from the client."""
        # The postmaster first, so it starts no backend that the list below would miss.
        os.kill(self.postmaster, signal.SIGSTOP)
        for pid in self.processes()[1:]:
            signal_child(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in reversed(self.processes()):
            signal_child(pid, signal.SIGCONT)

    def log(self) -> str:
        path = self.directory / "postgres.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Thaw, then stop the postmaster (fast shutdown: SIGINT), waiting for it to exit."""
        self.thaw()
        os.kill(self.postmaster, signal.SIGINT)
        deadline = time.monotonic() + 20
        while running(self.postmaster) and time.monotonic() < deadline:
            time.sleep(0.05)
        if running(self.postmaster):
            os.kill(self.postmaster, signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)


def signal_child(pid: int, number: int) -> None:
    # A backend may exit between the listing and the signal.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, number)


def running(pid: int) -> bool:
    # An exited postmaster may stay a zombie until whoever adopted it reaps it.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
