"""The rate limits' Redis as docs/deploy.rst ships it for high availability, on one machine: one
master, two replicas and three Sentinels, each run from the shipped files in config/redis/ with
only addresses, ports, paths and the password file replaced (the timings are the shipped ones).
Every process is the test's own, on free loopback ports, in a temporary directory, signalled by
PID: never the machine's Redis or a packaged service.

A Redis "machine" is its redis-server: `kill()` SIGKILLs it as a lost machine stops, `freeze()`
SIGSTOPs it as a stalled one hangs, and `bring_back()` starts it again on its own file, which
Sentinel has rewritten, so it rejoins as a replica of whoever is master.
"""

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from nginx_server import PROJECT_DIR, free_port, stop_process, wait_for_port

REDIS_SENTINEL = shutil.which("redis-sentinel")
REDIS_SERVER = shutil.which("redis-server")
SHIPPED = PROJECT_DIR / "config" / "redis"
SERVICE = "animal-store"
PASSWORD = secrets.token_hex(16)


def shipped(name: str, replacements: dict[str, str]) -> str:
    """The shipped file `name`, each line starting with a key of `replacements` replaced by its
    value; fail if the shipped file lacks one (the test would run something else than shipped)."""
    text = (SHIPPED / name).read_text()
    for start, line in replacements.items():
        text, found = re.subn(rf"^{re.escape(start)}\b.*$", line, text, flags=re.MULTILINE)
        assert found == 1, f"config/redis/{name} has no line {start!r}"
    return text


def sentinel_timings() -> dict[str, int]:
    """The shipped Sentinel's down-after-milliseconds and failover-timeout."""
    text = (SHIPPED / "sentinel.conf").read_text()
    return {
        name: int(re.search(rf"^sentinel {name} {SERVICE} (\d+)$", text, re.MULTILINE)[1])
        for name in ("down-after-milliseconds", "failover-timeout")
    }


class Process:
    """One redis-server or redis-sentinel on its own file, started again on the same file."""

    def __init__(self, program: str, directory: Path, name: str, text: str):
        self.program, self.name = program, name
        self.port = int(re.search(r"^port (\d+)$", text, re.MULTILINE)[1])
        self.config = directory / f"{name}.conf"
        self.config.write_text(text)
        self.log_path = directory / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.program, str(self.config), "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.process, self.port, self.name, self.log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **options) -> redis.Redis:
        return redis.Redis(*self.address, password=PASSWORD, socket_timeout=5, **options)

    def kill(self) -> None:
        """SIGKILL, as a machine that is lost: no goodbye to any client."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.running():
            self.thaw()  # a stopped process would not act on SIGTERM until continued
            stop_process(self.process, timeout=10)


class SentinelCluster:
    """Three Redis (the first the master) and three Sentinels watching them."""

    def __init__(self, directory: Path):
        self.directory = directory
        (directory / "password.conf").write_text(f"requirepass {PASSWORD}\nmasterauth {PASSWORD}\n")
        (directory / "sentinel-password.conf").write_text(
            f"requirepass {PASSWORD}\nsentinel auth-pass {SERVICE} {PASSWORD}\n"
        )
        self.redis: list[Process] = []
        self.sentinels: list[Process] = []
        try:
            for number in range(3):
                self.redis.append(self.start_redis(number))
            for number in range(3):
                self.sentinels.append(self.start_sentinel(number))
            self.wait_until_watched()
        except BaseException:
            self.stop()
            raise

    def start_redis(self, number: int) -> Process:
        name, port = f"redis-{number}", free_port()
        text = shipped(
            "redis.conf",
            {
                "bind": "bind 127.0.0.1",
                "port": f"port {port}",
                "include": f"include {self.directory / 'password.conf'}",
            },
        )
        text += f"dir {self.directory}\nlogfile {self.directory / name}.log\n"
        text += f"dbfilename {name}.rdb\n"
        if number:
            text += f"replicaof 127.0.0.1 {self.redis[0].port}\n"
        return Process(REDIS_SERVER, self.directory, name, text)

    def start_sentinel(self, number: int) -> Process:
        name, port = f"sentinel-{number}", free_port()
        text = shipped(
            "sentinel.conf",
            {
                "bind": "bind 127.0.0.1",
                "port": f"port {port}",
                "pidfile": f"pidfile {self.directory / name}.pid",
                "logfile": f"logfile {self.directory / name}.log",
                "dir": f"dir {self.directory}",
                f"sentinel monitor {SERVICE}": (
                    f"sentinel monitor {SERVICE} 127.0.0.1 {self.redis[0].port} 2"
                ),
                "include": f"include {self.directory / 'sentinel-password.conf'}",
            },
        )
        return Process(REDIS_SENTINEL, self.directory, name, text)

    def uri(self, sentinels: list[tuple[str, int]] | None = None) -> str:
        """The instances' setting: every Sentinel, or those given."""
        listed = ",".join(f"{host}:{port}" for host, port in sentinels or self.addresses())
        return f"redis+sentinel://:{PASSWORD}@{listed}/{SERVICE}"

    def addresses(self) -> list[tuple[str, int]]:
        return [sentinel.address for sentinel in self.sentinels]

    def master_port(self, sentinel: Process | None = None) -> int:
        """The master's port as a Sentinel that runs names it."""
        asked = sentinel or next(s for s in self.sentinels if s.running())
        with asked.client() as client:
            _, port = client.sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def master(self) -> Process:
        port = self.master_port()
        return next(server for server in self.redis if server.port == port)

    def wait_until_watched(self, settled: bool = False, timeout: float = 30) -> None:
        """Return once every running Sentinel names the same master, which answers as one, and
        knows the two replicas and the other two Sentinels: a failover can then happen. Settled:
        also once every Sentinel has seen each replica as a replica of that master (its INFO of
        a replica comes every 10 s), as a planned failover needs (watched(), below)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.watched(settled):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    "the Sentinels did not settle: "
                    + "\n".join(s.log()[-2000:] for s in self.sentinels)
                )
            time.sleep(0.1)

    def watched(self, settled: bool) -> bool:
        running = [s for s in self.sentinels if s.running()]
        ports = {self.master_port(s) for s in running}
        if len(ports) != 1:
            return False
        master = next(server for server in self.redis if server.port in ports)
        with master.client() as client:
            replication = client.info("replication")
        if replication["role"] != "master" or replication["connected_slaves"] != 2:
            return False
        for sentinel in running:
            with sentinel.client() as client:
                state = client.sentinel_master(SERVICE)
                replicas = client.sentinel_slaves(SERVICE)
            if state["num-slaves"] != 2 or state["num-other-sentinels"] != 2:
                return False
            if state["is_sdown"] or state["is_odown"] or state["flags"] != "master":
                return False
            # Every Sentinel has seen each replica as one: one that saw a replica still master
            # (the old master, back) would make it a replica again, in the middle of a planned
            # failover that promotes it.
            if settled and any(
                replica["flags"] != "slave"
                or replica["role-reported"] != "slave"
                or replica["master-link-status"] != "ok"
                or replica["master-port"] != master.port
                for replica in replicas
            ):
                return False
        return True

    def wait_until_replica(self, server: Process, master_port: int, timeout: float = 30) -> None:
        """Return once `server` follows the master on `master_port`, its copy made."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with server.client() as client:
                    replication = client.info("replication")
                if (
                    replication["role"] == "slave"
                    and replication["master_port"] == master_port
                    and replication["master_link_status"] == "up"
                ):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{server.name} did not follow {master_port} within {timeout}s")

    def wait_for_new_master(self, old_port: int, timeout: float = 30) -> int:
        """Return the new master's port once every running Sentinel names one other than
        `old_port`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ports = {self.master_port(s) for s in self.sentinels if s.running()}
            except redis.RedisError:
                ports = set()
            if len(ports) == 1 and old_port not in ports:
                return ports.pop()
            time.sleep(0.05)
        raise AssertionError(f"no new master within {timeout}s")

    def failover(self) -> None:
        """A planned switchover: SENTINEL FAILOVER, as an operator runs it."""
        with self.sentinels[0].client() as client:
            client.sentinel_failover(SERVICE)

    def stop(self) -> None:
        for process in self.sentinels + self.redis:
            process.stop()
