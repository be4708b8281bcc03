"""A redis-server of the test's own on a free loopback port, which the test may freeze.

Never the machine's shared Redis: a test that makes Redis hang stops this one (SIGSTOP by PID),
as a stalled host, a partition or a slow command look from the service. Standard library only:
benchmarks/hung_redis.py drives the same server.
"""

import os
import shutil
import signal
import subprocess
from pathlib import Path

from nginx_server import free_port, stop_process, wait_for_port

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    def __init__(self, directory: Path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = directory / f"redis-{self.port}.log"
        options = {
            "bind": "127.0.0.1",
            "port": self.port,
            "save": "",  # nothing on disk
            "appendonly": "no",
            "dir": directory,
            "logfile": self.log_path,
        }
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                *(part for item in options.items() for part in (f"--{item[0]}", str(item[1]))),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.process, self.port, "redis-server", self.log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def freeze(self) -> None:
        """Stop the process: connections stay open, nothing is answered."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.thaw()  # a stopped process would not act on SIGTERM until continued
        stop_process(self.process, timeout=10)
