"""A PostgreSQL cluster of a test's own: initdb in a temporary directory, started on a free
loopback port, frozen and thawed with SIGSTOP and SIGCONT, stopped, all by PID. With
`passwords=True` a TCP connection must give its role's password (scram-sha-256), as on a
deployed server; the machine's shared server trusts every local connection, so a password tested
there proves nothing.

With `replication="sync"` or `"async"` the cluster can have streaming standbys
(`cluster.standby()`: pg_basebackup into a directory and port of their own), so a test can fail
over as the faults really happen: `kill()` SIGKILLs a postmaster and all its children (nothing
flushes, nothing says goodbye), `promote()` makes a standby the primary, and `wal_receiver_pid()`
names the process that streams, to stop or kill it alone.

Never the machine's shared PostgreSQL: only the processes this cluster's postmaster started are
ever signalled. Standard library only: benchmarks/hung_database.py runs one too.
"""

import atexit
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


def psql_options(socket_directory: Path, port: int, database: str) -> list[str]:
    """psql's options to run SQL from stdin as postgres over a cluster's Unix socket: the
    values alone, unaligned, stopping at the first error."""
    return [
        "--host",
        str(socket_directory),
        "--port",
        str(port),
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
    ]


# initdb's data directory and superuser password for each authentication (passwords or not),
# made once per process and copied for each cluster after: a copy takes a fraction of initdb's
# time, and the suite starts a cluster in dozens of tests. Each copy is a cluster of its own
# (its settings, databases and roles); they share initdb's system identifier and, with passwords,
# the superuser's password.
TEMPLATES: dict[bool, tuple[Path, str | None]] = {}


class PostgresCluster:
    """A throwaway cluster: superuser `postgres`, loopback only; trust authentication, or
    scram-sha-256 passwords over TCP with `passwords=True` (the Unix socket, which only this
    class uses, always trusts).

    As root the server runs as the `postgres` user (PostgreSQL refuses to run as root), through
    `runuser`, so the directory is handed to that user.

    `replication` readies it to be a primary: None (the default), "async", or "sync", where a
    commit returns only once its first standby has flushed it (synchronous_commit is on by
    default). Replication connects over TCP, as from another host, with the cluster's own
    authentication: initdb's pg_hba.conf already has `host replication all 127.0.0.1/32` with the
    method of every TCP connection, trust or scram-sha-256. Make standbys with `standby()`, not
    with `_primary`.
    """

    def __init__(
        self,
        passwords: bool = False,
        replication: str | None = None,
        *,
        _primary: "PostgresCluster | None" = None,
    ):
        if BINDIR is None:
            raise RuntimeError("PostgreSQL's initdb is not installed")
        if replication not in (None, "sync", "async"):
            raise ValueError(f"replication is None, 'sync' or 'async', not {replication!r}")
        self.replication = replication
        self.primary = _primary
        self.standbys: list[PostgresCluster] = []
        # Killed or stopped: its PIDs may be anyone's by now, so nothing signals them again.
        self.dead = False
        self.directory = Path(tempfile.mkdtemp(prefix="animal-postgres-"))
        self.data = self.directory / "data"
        self.port = free_port()
        self.as_postgres = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.directory, user.pw_uid, user.pw_gid)
            self.as_postgres = ["runuser", "-u", "postgres", "--"]
        # The name a sync primary lists in synchronous_standby_names, and the standby's
        # processes' titles ("postgres: standby1: walreceiver"), so two clusters' differ.
        self.name = None
        if _primary is None:
            self.initdb(passwords)
        else:
            passwords = _primary.superuser_password is not None
            self.superuser_password = _primary.superuser_password
            self.name = f"standby{len(_primary.standbys) + 1}"
            self.base_backup(_primary)
        # fsync off: these tests freeze and kill processes, they never crash the machine (the
        # kernel still writes what a killed server wrote), and it saves seconds of CI on every
        # commit.
        self.options = (
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off"
        )
        if replication or _primary:
            # wal_level=replica and 10 senders are PostgreSQL's defaults, spelled out as what a
            # standby needs; a standby keeps them so that, once promoted, it can have its own.
            self.options += " -c wal_level=replica -c max_wal_senders=10 -c hot_standby=on"
            # Without a slot, a primary keeps no WAL for its standbys: a CHECKPOINT (a standby's
            # base backup takes one) may remove a segment a standby has yet to stream, and that
            # standby then stops for good ("requested WAL segment ... has already been
            # removed"), while commits go on waiting only for the other (seen: a standby that
            # lacked every key, promoted). What the tests write fits in this many times over.
            self.options += " -c wal_keep_size=256MB"
        if self.name:
            self.options += f" -c cluster_name={self.name}"
        self.start()
        password = f":{self.superuser_password}" if passwords else ""
        self.url = f"postgresql+psycopg://postgres{password}@127.0.0.1:{self.port}"

    def initdb(self, passwords: bool) -> None:
        """Copy the template data directory for `passwords`, made by initdb the first time."""
        if passwords not in TEMPLATES:
            directory = Path(tempfile.mkdtemp(prefix="animal-postgres-template-"))
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            if self.as_postgres:
                user = pwd.getpwnam("postgres")
                os.chown(directory, user.pw_uid, user.pw_gid)
            TEMPLATES[passwords] = (directory / "data", self.run_initdb(directory, passwords))
        template, self.superuser_password = TEMPLATES[passwords]
        # -a keeps the owner (postgres, when root) and the mode PostgreSQL insists on.
        subprocess.run(["cp", "-a", str(template), str(self.data)], check=True)

    def run_initdb(self, directory: Path, passwords: bool) -> str | None:
        """initdb into `directory`/data; return the superuser's password, if any."""
        authentication = ["--auth", "trust"]
        superuser_password = None
        if passwords:
            # initdb wants the superuser's password when connections must give one.
            superuser_password = secrets.token_urlsafe(16)
            password_file = directory / "superuser-password"
            password_file.write_text(superuser_password + "\n")
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
            str(directory / "data"),
            "--username",
            "postgres",
            *authentication,
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            "--no-sync",
        )
        return superuser_password

    def base_backup(self, primary: "PostgresCluster") -> None:
        """Copy the running `primary` with pg_basebackup over TCP, as from another host; -R
        writes primary_conninfo, with this standby's name as application_name (what
        synchronous_standby_names and pg_stat_replication call it) and the password if any
        (from the environment, so it is on no command line), and standby.signal."""
        password = {"PGPASSWORD": primary.superuser_password} if primary.superuser_password else {}
        self.run(
            "pg_basebackup",
            "--dbname",
            f"host=127.0.0.1 port={primary.port} user=postgres application_name={self.name}",
            "--pgdata",
            str(self.data),
            "--write-recovery-conf",
            "--wal-method",
            "stream",
            "--checkpoint",
            "fast",
            "--no-sync",
            env=password,
        )
        # The copy has the primary's ALTER SYSTEM settings: a second standby would list the
        # first as its own synchronous standby, and once promoted would block every commit.
        settings = self.data / "postgresql.auto.conf"
        kept = [
            line
            for line in settings.read_text().splitlines(keepends=True)
            if not line.startswith("synchronous_standby_names")
        ]
        settings.write_text("".join(kept))

    def start(self) -> None:
        """Start the postmaster: when created, or again after kill(), where it recovers from the
        crash as a machine that comes back does; a killed primary comes back a primary."""
        if self.dead:
            # The killed postmaster stays a zombie until whoever adopted it reaps it (seconds,
            # for some inits), and the new one would take its PID, in both lock files, for a
            # live server; kill() saw every process of it exit.
            (self.data / "postmaster.pid").unlink(missing_ok=True)
            (self.directory / f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)
        self.run(
            "pg_ctl",
            "--pgdata",
            str(self.data),
            "--log",
            str(self.directory / "postgres.log"),
            "--options",
            self.options,
            "--wait",
            "start",
        )
        self.postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        self.dead = False

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, program, *arguments, stdin: str | None = None, env=None) -> str:
        return subprocess.run(
            [*self.as_postgres, str(BINDIR / program), *arguments],
            check=True,
            capture_output=True,
            cwd=self.directory,
            input=stdin,
            text=True,
            # runuser keeps the environment but for HOME, SHELL, USER and LOGNAME.
            env={**os.environ, **env} if env else None,
        ).stdout

    def sql(self, statements: str, database: str = "postgres") -> str:
        """Run SQL as the superuser over the Unix socket (no password), from stdin, so a
        password in it is on no command line; return psql's unaligned output."""
        return self.run(
            "psql", *psql_options(self.directory, self.port, database), stdin=statements
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

    def standby(self) -> "PostgresCluster":
        """Make, start and return a streaming hot standby of this primary (made with
        `replication`), once pg_stat_replication shows it streaming and, on a sync primary,
        synchronous: from then on a commit here waits for it. A sync primary lists its standbys
        in order, `FIRST 1 (standby1, standby2)`: the first connected one is synchronous, a later
        one `potential`."""
        if not self.replication:
            raise RuntimeError("a standby needs a primary made with replication='sync'/'async'")
        standby = PostgresCluster(replication=self.replication, _primary=self)
        self.standbys.append(standby)
        try:
            if self.replication == "sync":
                # Only now: named before it streams, the standby would block every commit here,
                # the base backup's own included. Set in postgresql.auto.conf, not on the command
                # line, which would override it for good.
                names = ", ".join(f'"{each.name}"' for each in self.standbys)
                self.sql(
                    f"ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 ({names})';\n"
                    "SELECT pg_reload_conf();"
                )
            self.wait_for_streaming(standby)
            if self.replication == "sync":
                # The walsender shows the new setting before the checkpointer, which tells the
                # backends that commits must wait, has read it; a CHECKPOINT waits for that, as
                # the checkpointer reads a pending reload before it starts the checkpoint.
                self.sql("CHECKPOINT")
        except BaseException:
            standby.stop()
            raise
        return standby

    def wait_for_streaming(self, standby: "PostgresCluster", timeout: float = 60) -> None:
        """Wait until pg_stat_replication here shows `standby` streaming, and synchronous (or
        next in line) on a sync primary."""
        wanted = {"sync", "potential"} if self.replication == "sync" else {"async"}
        query = "SELECT application_name, state, sync_state FROM pg_stat_replication"
        deadline = time.monotonic() + timeout
        while not any(
            name == standby.name and streaming == "streaming" and sync_state in wanted
            for name, streaming, sync_state in (row.split("|") for row in self.sql(query).split())
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{standby.name} does not stream:\n{standby.log()[-2000:]}")
            time.sleep(0.05)

    def wait_for_replay(self, timeout: float = 60) -> None:
        """Wait until this standby has replayed all its primary has written: a synchronous
        commit only waits for the standby to flush it, not to show it to queries."""
        lsn = self.primary.sql("SELECT pg_current_wal_lsn()").strip()
        query = f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'"
        deadline = time.monotonic() + timeout
        while self.sql(query).strip() != "t":
            if time.monotonic() > deadline:
                here = self.sql("SELECT pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn()")
                there = self.primary.sql("SELECT * FROM pg_stat_replication")
                raise TimeoutError(
                    f"{self.name} has not replayed up to {lsn} (received, replayed: {here}); "
                    f"the primary's pg_stat_replication:\n{there}\n{self.log()[-2000:]}"
                )
            time.sleep(0.05)

    def promote(self, timeout: float = 60) -> None:
        """Make this standby a primary, returning once it accepts writes. pg_ctl waits for
        pg_control to say "in production", a moment before the backends are told; a
        transaction ID, which no standby can assign, tells."""
        self.run("pg_ctl", "--pgdata", str(self.data), "--wait", "promote")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sql("SELECT pg_current_xact_id()")
                return
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def wal_receiver_pid(self) -> int | None:
        """Return the PID of this standby's walreceiver, the process that streams from the
        primary, or None while it has none (the startup process starts another after one
        exits). Read from the processes' titles in /proc, so it answers while the standby is
        frozen."""
        for pid in self.processes()[1:]:
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            # "postgres: standby1: walreceiver streaming 0/3000148"
            words = title.split("\0")[0].split(": ")
            if words[0] == "postgres" and any(w.startswith("walreceiver") for w in words[1:]):
                return pid
        return None

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
        # The postmaster first, stopped before the list is read, so it starts no backend that
        # the list would miss.
        os.kill(self.postmaster, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while state(self.postmaster) not in ("T", "Z", None) and time.monotonic() < deadline:
            time.sleep(0.001)
        for pid in self.processes()[1:]:
            signal_child(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.dead:
            return
        for pid in reversed(self.processes()):
            signal_child(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the postmaster and all its children, as a machine's loss is for the server:
        nothing flushes, nothing says goodbye, and the directory stays (for `start()`, or
        `stop()`). For its clients it is not quite: the kernel closes their connections, where
        a lost machine's never answer again (`freeze()` first, for that)."""
        if self.dead:
            return
        # All stopped first, so none runs on (a walsender sending, a checkpoint writing) while
        # the others are killed, and the postmaster, stopped, starts no other.
        with contextlib.suppress(ProcessLookupError):  # a postmaster gone, reaped, already
            self.freeze()
        processes = self.processes()
        for pid in processes:
            signal_child(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(map(running, processes)) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.dead = True

    def log(self) -> str:
        path = self.directory / "postgres.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Thaw, then stop the postmaster (fast shutdown: SIGINT), waiting for it to exit, and
        remove the directory; after kill(), only remove it."""
        # A primary's shutdown waits for each walsender to send the standby all of the WAL, so
        # for a frozen walreceiver until wal_sender_timeout.
        for standby in self.standbys:
            standby.thaw()
        if not self.dead:
            self.thaw()
            signal_child(self.postmaster, signal.SIGINT)
            deadline = time.monotonic() + 20
            while running(self.postmaster) and time.monotonic() < deadline:
                time.sleep(0.05)
            if running(self.postmaster):
                self.kill()  # what is left of it
            self.dead = True
        shutil.rmtree(self.directory, ignore_errors=True)


def signal_child(pid: int, number: int) -> None:
    # A backend may exit between the listing and the signal.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, number)


def state(pid: int) -> str | None:
    """Return the process's state letter from /proc (R, S, T, Z...), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def running(pid: int) -> bool:
    # An exited postmaster may stay a zombie until whoever adopted it reaps it.
    return state(pid) not in (None, "Z")
