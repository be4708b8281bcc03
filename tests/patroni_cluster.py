"""The production shape of docs/deploy.rst's High availability on one machine: three etcd members,
three Patroni nodes each managing a PostgreSQL, and HAProxy health-checking Patroni's REST API,
each run from the shipped files in config/patroni/ with only names, addresses, ports and paths
replaced (and the three timings of TEST_TIMINGS, below). Every process is the test's own, on free
loopback ports, in temporary directories, signalled by PID: never the machine's PostgreSQL or a
packaged service.

A "machine" is an etcd member and a Patroni node with its PostgreSQL: `lose()` SIGKILLs all of
them at once, as a lost machine stops, and `bring_back()` starts its etcd and Patroni again,
which rejoins PostgreSQL as a standby of whoever leads.
"""

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import requests
from nginx_server import PROJECT_DIR, free_port, stop_process, wait_for_port
from postgres_cluster import BINDIR, psql_options, running, signal_child, state

PATRONI = shutil.which("patroni")
PATRONICTL = shutil.which("patronictl")
ETCD = shutil.which("etcd")
HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None
)
SHIPPED = PROJECT_DIR / "config" / "patroni"

# What a test needs that Debian packages, named as the skip reason says it.
MISSING = [
    f"{program} (Debian: {package})"
    for program, found, package in [
        ("patroni", PATRONI, "patroni"),
        ("etcd", ETCD, "etcd-server"),
        ("haproxy", HAPROXY, "haproxy"),
        ("initdb", BINDIR, "postgresql"),
    ]
    if found is None
]

# The shipped files' three machines, in order, and their ports.
MACHINES = [("db1", "10.0.0.5"), ("db2", "10.0.0.6"), ("db3", "10.0.0.7")]
ETCD_CLIENT, ETCD_PEER, RESTAPI, POSTGRES = 2379, 2380, 8008, 5432

# The shipped ttl 15, loop_wait 3, retry_timeout 5 make a failover wait up to 15 s for the
# leader's key to expire; the tests keep Patroni's rule (ttl >= loop_wait + 2 x retry_timeout)
# at about half of that, so that CI waits half as long. TEST_PATRONI_TIMINGS=shipped
# runs the shipped ones (what docs/deploy.rst measured both ways).
SHIPPED_TIMINGS = {"ttl": 15, "loop_wait": 3, "retry_timeout": 5}
TEST_TIMINGS = (
    SHIPPED_TIMINGS
    if os.environ.get("TEST_PATRONI_TIMINGS") == "shipped"
    else {"ttl": 8, "loop_wait": 1, "retry_timeout": 3}
)


def replace(text: str, old: str, new: str, source: Path) -> str:
    """Replace every `old` of a shipped file, failing loudly if the file no longer has it."""
    if old not in text:
        raise AssertionError(f"{source.relative_to(PROJECT_DIR)}: {old!r} not found")
    return text.replace(old, new)


def descendants(pid: int) -> list[int]:
    """Return the PIDs of `pid`'s children, theirs, and so on, read from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    """Stop them all (SIGSTOP), so none acts on another's death, then SIGKILL them all and wait
    until they are gone (or zombies, which whoever adopted them reaps)."""
    for pid in pids:
        signal_child(pid, signal.SIGSTOP)
    for pid in pids:
        signal_child(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)


class Machine:
    """One database machine of three: its etcd member and its Patroni node, run as postgres."""

    def __init__(self, cluster: "PatroniCluster", number: int):
        self.cluster = cluster
        self.name, self.address = MACHINES[number]
        self.directory = cluster.directory / self.name
        self.directory.mkdir()
        self.ports = {port: free_port() for port in (ETCD_CLIENT, ETCD_PEER, RESTAPI, POSTGRES)}
        self.data = self.directory / "data"
        self.etcd_process: subprocess.Popen | None = None
        self.patroni_process: subprocess.Popen | None = None

    @property
    def postgres_port(self) -> int:
        return self.ports[POSTGRES]

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports[RESTAPI]}"

    def loopback(self, text: str, source: Path) -> str:
        """Every machine's address:port of the shipped file, made the test's loopback port."""
        for machine in self.cluster.machines:
            for port, test_port in machine.ports.items():
                if f"{machine.address}:{port}" in text:
                    text = text.replace(f"{machine.address}:{port}", f"127.0.0.1:{test_port}")
        return text

    def etcd_environment(self) -> dict[str, str]:
        """config/patroni/etcd.env's lines for this member (as its file on db2 or db3 would be),
        as the environment etcd reads them from."""
        source = SHIPPED / "etcd.env"
        text = source.read_text()
        # This machine's own lines (all but the cluster's list) name it and its address.
        text = replace(text, "ETCD_NAME=db1", f"ETCD_NAME={self.name}", source)
        text = replace(text, ",http://127.0.0.1:2379", "", source)  # the loopback's is taken
        own = []
        for line in text.splitlines():
            if line.startswith(("ETCD_LISTEN_", "ETCD_INITIAL_ADVERTISE_", "ETCD_ADVERTISE_")):
                line = line.replace(MACHINES[0][1], self.address)
            own.append(line)
        text = self.loopback("\n".join(own), source)
        text = replace(text, "/var/lib/etcd/animal-store", str(self.directory / "etcd"), source)
        environment = dict(
            line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
        assert "10.0.0." not in str(environment), environment
        return environment

    def patroni_config(self) -> str:
        """config/patroni/patroni.yml for this node (as on db2 or db3), on loopback ports."""
        source = SHIPPED / "patroni.yml"
        text = source.read_text()
        text = replace(text, "name: db1", f"name: {self.name}", source)
        text = replace(text, f"listen: {MACHINES[0][1]}:", f"listen: {self.address}:", source)
        text = replace(
            text, f"connect_address: {MACHINES[0][1]}:", f"connect_address: {self.address}:", source
        )
        text = self.loopback(text, source)
        paths = {
            "/var/lib/postgresql/15/animal-store": self.data,
            "/usr/lib/postgresql/15/bin": BINDIR,
            "/var/lib/postgresql/.pgpass.patroni": self.directory / "pgpass",
            "unix_socket_directories: /var/run/postgresql": (
                f"unix_socket_directories: {self.directory}"
            ),
            "10.0.0.0/24": "127.0.0.1/32",
        }
        for old, new in paths.items():
            text = replace(text, old, str(new), source)
        for name, value in TEST_TIMINGS.items():
            text = replace(
                text, f"    {name}: {SHIPPED_TIMINGS[name]}\n", f"    {name}: {value}\n", source
            )
        assert not any(
            "10.0.0." in line for line in text.splitlines() if not line.lstrip().startswith("#")
        ), text
        return text

    def start_etcd(self) -> None:
        (self.directory / "etcd").mkdir(exist_ok=True, mode=0o700)
        environment = self.etcd_environment()
        if (self.directory / "etcd" / "member").exists():
            environment["ETCD_INITIAL_CLUSTER_STATE"] = "existing"  # as after a reboot
        self.etcd_log = open(self.directory / "etcd.log", "ab")  # noqa: SIM115 - closed on stop
        self.etcd_process = subprocess.Popen(
            [ETCD],
            env={"PATH": os.environ["PATH"], **environment},
            stdout=self.etcd_log,
            stderr=subprocess.STDOUT,
        )

    def start_patroni(self) -> None:
        config = self.directory / "patroni.yml"
        config.write_text(self.patroni_config())
        self.patroni_log = open(self.directory / "patroni.log", "ab")  # noqa: SIM115
        as_postgres = {}
        if os.geteuid() == 0:
            # As the postgres user, as Debian's patroni.service runs it: set by Popen rather than
            # through runuser, which would stay Patroni's parent, so that the PID is Patroni's
            # own, to SIGKILL.
            as_postgres = {"user": "postgres", "group": "postgres", "extra_groups": []}
        self.patroni_process = subprocess.Popen(
            [PATRONI, str(config)],
            env={
                "PATH": os.environ["PATH"],
                "HOME": str(self.directory),
                "LC_ALL": "C.UTF-8",
                **self.cluster.secrets,
            },
            cwd=self.directory,
            stdout=self.patroni_log,
            stderr=subprocess.STDOUT,
            **as_postgres,
        )

    def postmaster(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def processes(self) -> list[int]:
        """Every process of the machine: etcd, Patroni, PostgreSQL's postmaster, and theirs."""
        found = []
        for process in (self.etcd_process, self.patroni_process):
            if process is not None and process.poll() is None:
                found += [process.pid, *descendants(process.pid)]
        postmaster = self.postmaster()
        if postmaster is not None and state(postmaster) not in (None, "Z"):
            found += [postmaster, *descendants(postmaster)]
        return list(dict.fromkeys(found))

    def lose(self) -> None:
        """SIGKILL every process of the machine at once, as its loss: nothing says goodbye."""
        kill_all(self.processes())
        for process in (self.etcd_process, self.patroni_process):
            if process is not None:
                process.wait()
        self.etcd_process = self.patroni_process = None
        self.close_logs()

    def lose_database(self) -> None:
        """SIGKILL its Patroni and PostgreSQL, leaving its etcd member: the database lost, the
        machine not (or the machine lost, with etcd elsewhere)."""
        pids = []
        if self.patroni_process is not None:
            pids += [self.patroni_process.pid, *descendants(self.patroni_process.pid)]
        postmaster = self.postmaster()
        if postmaster is not None and state(postmaster) not in (None, "Z"):
            pids += [postmaster, *descendants(postmaster)]
        kill_all(list(dict.fromkeys(pids)))
        if self.patroni_process is not None:
            self.patroni_process.wait()
            self.patroni_log.close()
        self.patroni_process = None

    def bring_back(self) -> None:
        """Start what is not running (etcd, Patroni) again, as the machine's boot would."""
        if self.etcd_process is None:
            self.start_etcd()
        if self.patroni_process is None:
            # A killed postmaster's lock file names a PID that may be anyone's by now.
            postmaster = self.postmaster()
            if postmaster is not None and not running(postmaster):
                (self.data / "postmaster.pid").unlink(missing_ok=True)
            self.start_patroni()

    def close_logs(self) -> None:
        for name in ("etcd_log", "patroni_log"):
            log = getattr(self, name, None)
            if log is not None:
                log.close()

    def log(self, name: str = "patroni") -> str:
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        """Stop Patroni (SIGTERM: it stops its PostgreSQL), then etcd; kill what stays."""
        if self.patroni_process is not None:
            stop_process(self.patroni_process, timeout=30)
        postmaster = self.postmaster()
        if postmaster is not None and running(postmaster):
            kill_all([postmaster, *descendants(postmaster)])
        if self.etcd_process is not None:
            stop_process(self.etcd_process, timeout=10)
        self.etcd_process = self.patroni_process = None
        self.close_logs()


class PatroniCluster:
    """Three machines of etcd and Patroni, started together; Patroni's first node creates the
    cluster (initdb) and the others copy it (pg_basebackup), as on first deployment."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="animal-patroni-"))
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.directory, user.pw_uid, user.pw_gid)
        self.superuser_password = secrets.token_urlsafe(16)
        # /etc/patroni_env.conf's lines, as Debian's patroni.service passes them.
        self.secrets = {
            "PATRONI_SUPERUSER_PASSWORD": self.superuser_password,
            "PATRONI_REPLICATION_PASSWORD": secrets.token_urlsafe(16),
            "PATRONI_REWIND_PASSWORD": secrets.token_urlsafe(16),
            "PATRONI_RESTAPI_USERNAME": "patroni",
            "PATRONI_RESTAPI_PASSWORD": secrets.token_urlsafe(16),
        }
        self.machines: list[Machine] = []
        self.machines = [Machine(self, number) for number in range(len(MACHINES))]
        if os.geteuid() == 0:
            for machine in self.machines:
                shutil.chown(machine.directory, "postgres", "postgres")
                machine.directory.chmod(0o700)

    def start(self, timeout: float = 120) -> "PatroniCluster":
        for machine in self.machines:
            machine.start_etcd()
        for machine in self.machines:
            wait_for_port(
                machine.etcd_process,
                machine.ports[ETCD_CLIENT],
                "etcd",
                lambda m=machine: m.log("etcd"),
            )
        for machine in self.machines:
            machine.start_patroni()
        self.wait_for_members(len(self.machines), timeout)
        return self

    def members(self) -> list[dict]:
        """Patroni's view of the cluster (GET /cluster), from the first node that answers."""
        for machine in self.machines:
            if machine.patroni_process is None:
                continue
            with contextlib.suppress(requests.RequestException, ValueError):
                answer = requests.get(f"{machine.api}/cluster", timeout=1)
                if answer.status_code == 200:
                    return answer.json()["members"]
        return []

    def machine(self, name: str) -> Machine:
        return next(machine for machine in self.machines if machine.name == name)

    def move_etcd_leader(self, to: Machine, timeout: float = 30) -> None:
        """Make `to`'s etcd member lead etcd (MoveLeader, through etcd's JSON gateway), so that a
        fault elsewhere does not also cost an etcd election."""

        def status(machine: Machine) -> dict:
            url = f"http://127.0.0.1:{machine.ports[ETCD_CLIENT]}/v3/maintenance/status"
            return requests.post(url, json={}, timeout=3).json()

        target = status(to)["header"]["member_id"]
        deadline = time.monotonic() + timeout
        while (leader := status(to)["leader"]) != target:
            assert time.monotonic() < deadline, f"etcd's leader is still {leader}, not {to.name}"
            holder = next(m for m in self.machines if status(m)["header"]["member_id"] == leader)
            requests.post(
                f"http://127.0.0.1:{holder.ports[ETCD_CLIENT]}/v3/maintenance/transfer-leadership",
                json={"targetID": target},
                timeout=10,
            )
            time.sleep(0.2)

    def leader(self) -> Machine | None:
        """The machine whose PostgreSQL leads and runs, by its own REST API (GET /primary)."""
        for machine in self.machines:
            if machine.patroni_process is None:
                continue
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{machine.api}/primary", timeout=1).status_code == 200:
                    return machine
        return None

    def wait_for_members(self, count: int, timeout: float = 120) -> list[dict]:
        """Wait for a running leader and `count` - 1 streaming standbys, one of them
        synchronous; return the members."""
        deadline = time.monotonic() + timeout
        while True:
            members = self.members()
            roles = sorted(member["role"] for member in members if self.settled(member))
            if len(roles) == count and "leader" in roles and "sync_standby" in roles:
                return members
            if time.monotonic() > deadline:
                logs = "\n".join(f"{m.name}:\n{m.log()}" for m in self.machines)
                raise TimeoutError(f"not {count} members within {timeout}s: {members}\n{logs}")
            time.sleep(0.1)

    @staticmethod
    def settled(member: dict) -> bool:
        if member["role"] == "leader":
            return member["state"] == "running"
        # Patroni 3.0 says "running" of a standby that streams (3.1 and later, "streaming").
        return member["state"] in ("running", "streaming") and member.get("lag") == 0

    def wait_for_leader(self, other_than: Machine | None, timeout: float = 60) -> Machine:
        """Wait for a machine other than `other_than` to lead, as its REST API says; return it."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            if leader is not None and leader is not other_than:
                return leader
            assert time.monotonic() < deadline, f"no new leader within {timeout}s"
            time.sleep(0.05)

    def patronictl(self, *arguments: str) -> str:
        """Run patronictl as an operator would on db1, with its configuration file."""
        return subprocess.run(
            [PATRONICTL, "-c", str(self.machines[0].directory / "patroni.yml"), *arguments],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, **self.secrets},
            timeout=60,
        ).stdout

    def strict(self) -> bool:
        """Whether the cluster's settings, as the leader's Patroni has them, say strict."""
        leader = self.wait_for_leader(None)
        config = requests.get(f"{leader.api}/config", timeout=5).json()
        return config.get("synchronous_mode_strict", False) is True

    def set_strict(self, strict: bool, timeout: float = 30) -> None:
        """Set synchronous_mode_strict in the cluster's settings (patronictl edit-config), and
        wait for the leader's Patroni to have it."""
        if self.strict() is strict:
            return
        value = "true" if strict else "false"
        self.patronictl("edit-config", "--set", f"synchronous_mode_strict={value}", "--force")
        deadline = time.monotonic() + timeout
        while self.strict() is not strict:
            assert time.monotonic() < deadline, "the setting did not reach the leader"
            time.sleep(0.1)
        # Read by the next loop of each node: wait one, with room.
        time.sleep(2 * TEST_TIMINGS["loop_wait"])

    def url(self, database: str = "store", machines: list[Machine] | None = None) -> str:
        """The service's DATABASE_URL: every machine, libpq's way, the writable one chosen."""
        hosts = ",".join(f"127.0.0.1:{m.postgres_port}" for m in machines or self.machines)
        return (
            f"postgresql://postgres:{self.superuser_password}@{hosts}/{database}"
            "?target_session_attrs=read-write"
        )

    def read_url(self, database: str = "store") -> str:
        """The service's DATABASE_READ_URL, as docs/deploy.rst (Reads on the standbys) writes it:
        every machine, a standby taken at random for each connection."""
        hosts = ",".join(f"127.0.0.1:{m.postgres_port}" for m in self.machines)
        return (
            f"postgresql://postgres:{self.superuser_password}@{hosts}/{database}"
            "?target_session_attrs=standby&load_balance_hosts=random"
        )

    def sql(self, machine: Machine, statements: str, database: str = "postgres") -> str:
        """Run SQL as postgres over the machine's Unix socket (peer); return psql's output."""
        as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            [
                *as_postgres,
                str(BINDIR / "psql"),
                *psql_options(machine.directory, machine.postgres_port, database),
            ],
            input=statements,
            check=True,
            capture_output=True,
            text=True,
            cwd=machine.directory,
        ).stdout

    def stop(self) -> None:
        for machine in self.machines:
            machine.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class HAProxy:
    """HAProxy on config/patroni/haproxy.cfg, in the foreground, the cluster's ports in it."""

    def __init__(self, cluster: PatroniCluster):
        self.directory = Path(tempfile.mkdtemp(prefix="animal-haproxy-"))
        self.port = free_port()
        source = SHIPPED / "haproxy.cfg"
        text = replace(
            source.read_text(), "bind 127.0.0.1:5000", f"bind 127.0.0.1:{self.port}", source
        )
        # What HAProxy says goes to its standard error (the shipped file has no syslog), here
        # the log file.
        assert "\n    log " not in text, "config/patroni/haproxy.cfg logs elsewhere than stderr"
        if os.geteuid() != 0:  # only root may change user or chroot
            for line in (
                "    user haproxy\n",
                "    group haproxy\n",
                "    chroot /var/lib/haproxy\n",
            ):
                text = replace(text, line, "", source)
        for machine in cluster.machines:
            server = f"server {machine.name} {machine.address}:{POSTGRES} check port {RESTAPI}"
            text = replace(
                text,
                server,
                f"server {machine.name} 127.0.0.1:{machine.postgres_port} "
                f"check port {machine.ports[RESTAPI]}",
                source,
            )
        assert not any(
            "10.0.0." in line for line in text.splitlines() if not line.lstrip().startswith("#")
        ), text
        config = self.directory / "haproxy.cfg"
        config.write_text(text)
        self.log_file = open(self.directory / "haproxy.log", "wb")  # noqa: SIM115
        # -db: in the foreground, so its PID is HAProxy's to stop.
        self.process = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(config)], stdout=self.log_file, stderr=subprocess.STDOUT
        )
        wait_for_port(self.process, self.port, "haproxy", self.log)

    def log(self) -> str:
        return (self.directory / "haproxy.log").read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.process, timeout=10)
        self.log_file.close()
        shutil.rmtree(self.directory, ignore_errors=True)
