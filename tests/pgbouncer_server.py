"""A real PgBouncer running the shipped config/pgbouncer.ini, rendered with a test's port, paths
and database; in front of the test PostgreSQL, for a role whose server connections are capped."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from nginx_server import PROJECT_DIR, free_port, stop_process, substitute, wait_for_port

PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None
)
SHIPPED_CONFIG = PROJECT_DIR / "config" / "pgbouncer.ini"


class PgBouncer:
    """PgBouncer in the foreground on a loopback port, stopped by PID.

    Its files live in a directory of their own that any user may read: started as root, PgBouncer
    must switch to another user (`user`), who then has to reach them.
    """

    def __init__(self, server_url, role, pool_size):
        self.directory = Path(tempfile.mkdtemp(prefix="animal-pgbouncer-"))
        self.directory.chmod(0o777)
        self.port = free_port()
        database = (
            f"test = host={server_url.host} port={server_url.port} "
            f"dbname={server_url.database} user={role}"
        )
        if server_url.password:
            # For a server that wants one (scram-sha-256), which PgBouncer's trusted clients
            # never give it.
            database += f" password={server_url.password}"
        config = SHIPPED_CONFIG.read_text()
        config = substitute(r"^store = .*$", database, config, 1, SHIPPED_CONFIG)
        config = substitute(
            r"^listen_port = .*$", f"listen_port = {self.port}", config, 1, SHIPPED_CONFIG
        )
        config = substitute(r"^auth_type = .*$", "auth_type = trust", config, 1, SHIPPED_CONFIG)
        config = substitute(
            r"^auth_file = .*$",
            f"auth_file = {self.directory}/users.txt",
            config,
            1,
            SHIPPED_CONFIG,
        )
        config = substitute(
            r"^logfile = .*$",
            f"logfile = {self.directory}/pgbouncer.log",
            config,
            1,
            SHIPPED_CONFIG,
        )
        config = substitute(
            r"^pidfile = .*$",
            f"pidfile = {self.directory}/pgbouncer.pid",
            config,
            1,
            SHIPPED_CONFIG,
        )
        config = substitute(
            r"^default_pool_size = .*$",
            f"default_pool_size = {pool_size}",
            config,
            1,
            SHIPPED_CONFIG,
        )
        # No Unix socket; the role may read SHOW CLIENTS and SHOW SERVERS (the test counts them).
        config += f"unix_socket_dir =\nadmin_users = {role}\n"
        if os.geteuid() == 0:
            config += "user = postgres\n"
        (self.directory / "users.txt").write_text(f'"{role}" ""\n')
        (self.directory / "pgbouncer.ini").write_text(config)
        for path in self.directory.iterdir():
            path.chmod(0o644)
        # The database by its [databases] name above, whatever the server's is called.
        self.url = server_url.set(
            host="127.0.0.1", port=self.port, username=role, password=None, database="test"
        )
        self.process = subprocess.Popen(
            [PGBOUNCER, str(self.directory / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def repoint(self, server_url):
        """Point the database at another server, as docs/deploy.rst has an operator do after a
        failover: its [databases] line edited, then `systemctl reload pgbouncer`, which sends
        the process SIGHUP (Debian's unit)."""
        config = self.directory / "pgbouncer.ini"
        line = f"host={server_url.host} port={server_url.port} "
        config.write_text(re.sub(r"host=\S+ port=\d+ ", line, config.read_text(), count=1))
        os.kill(self.process.pid, signal.SIGHUP)

    def wait_until_serving(self, timeout=30):
        wait_for_port(self.process, self.port, "pgbouncer", self.log, timeout)
        return self

    def log(self):
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self):
        stop_process(self.process, timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
