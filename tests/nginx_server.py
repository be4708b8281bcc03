"""A real nginx running the shipped config/nginx.conf, rendered with a test's ports and paths.

Standard library only: benchmarks/http_bench.py drives the same nginx without the test extras.
"""

import fcntl
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent


# The ports of the servers tests start: below the kernel's range for the local ports of outgoing
# connections (32768-60999), where a port the kernel would choose (a bind to 0) lies and where a
# client's connection could take it before the server binds it (CI saw gunicorn refused so). Each
# process that chooses ports at once (CI's two passes, its benchmark smokes) takes a block of its
# own, locked for its life, and walks it in turn: no two processes choose the same port.
PORTS_FROM, PORTS_PER_BLOCK, BLOCKS = 10_000, 2_000, 11
PORT_BLOCKS = Path(tempfile.gettempdir()) / "animal-store-port-blocks"
_ports: "Iterator[int] | None" = None
_held = []  # the lock of this process's block, open as long as it lives


def free_port():
    """Return a loopback port no server listens on, nor will another process choose."""
    global _ports
    if _ports is None:
        _ports = itertools.cycle(range(*port_block()))
    for port in itertools.islice(_ports, PORTS_PER_BLOCK):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # a server listens on it (the machine's own, or a test's still)
            return port
    raise RuntimeError(f"no free port in {port_block()}")


@functools.cache
def port_block():
    """Claim a block of ports no other process holds (a lock the kernel drops when the process
    ends): the range's start and end."""
    PORT_BLOCKS.mkdir(exist_ok=True)
    for block in range(BLOCKS):
        lock = open(PORT_BLOCKS / str(block), "a")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _held.append(lock)
        start = PORTS_FROM + block * PORTS_PER_BLOCK
        return start, start + PORTS_PER_BLOCK
    raise RuntimeError(f"{BLOCKS} processes hold every block of ports in {PORT_BLOCKS}")


def stop_process(process, timeout):
    """Stop a server this test started, by PID: SIGTERM, then SIGKILL after `timeout` seconds."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def wait_for_port(process, port, name, log, timeout=30):
    """Return once `process` accepts connections on the loopback `port`; raise, with its log,
    if it exits or does not listen within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {log()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen within {timeout}s: {log()}")


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made by openssl: (certificate, key) paths."""
    certificate, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(certificate),
        ],
        check=True,
        capture_output=True,
    )
    return certificate, key


NGINX = shutil.which("nginx") or next(
    (path for path in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(path, os.X_OK)), None
)
SHIPPED_CONFIG = PROJECT_DIR / "config" / "nginx.conf"

# Installed as /etc/nginx/nginx.conf (docs/deploy.rst): its main and events settings.
SHIPPED_MAIN_CONFIG = PROJECT_DIR / "config" / "nginx-main.conf"


def substitute(pattern, replacement, text, count, source=SHIPPED_CONFIG):
    """Replace a setting of the shipped file, failing loudly if the file no longer has it."""
    result, found = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    if found != count:
        name = source.relative_to(PROJECT_DIR) if source.is_relative_to(PROJECT_DIR) else source
        raise AssertionError(f"{name}: {pattern!r} found {found} times, not {count}")
    return result


def render_main(directory, worker_processes, user, source=SHIPPED_MAIN_CONFIG) -> str:
    """Return config/nginx-main.conf (or `source`, Debian's own for a benchmark's baseline) as the
    test runs it: its own pid, logs and temporary files in `directory`, the site's file from
    there, no other site, `worker_processes` workers, and `user` (root's workers default to
    nobody)."""
    config = source.read_text()
    replacements = [
        (r"^user www-data;", user),
        (r"^worker_processes auto;", f"worker_processes {worker_processes};"),
        (r"^pid /run/nginx\.pid;", f"pid {directory}/nginx.pid;"),
        (r"^error_log /var/log/nginx/error\.log;", f"error_log {directory}/error.log info;"),
        (r"^\taccess_log /var/log/nginx/access\.log;", f"\taccess_log {directory}/main.log;"),
        (r"^\tinclude /etc/nginx/conf\.d/\*\.conf;\n", ""),
        (
            r"^\tinclude /etc/nginx/sites-enabled/\*;",
            "".join(
                f"\t{kind}_temp_path {directory}/{path};\n"
                for kind, path in [
                    ("client_body", "client_body"),
                    ("proxy", "proxy"),
                    ("fastcgi", "fastcgi"),
                    ("uwsgi", "uwsgi"),
                    ("scgi", "scgi"),
                ]
            )
            + f"\tinclude {directory}/animal-store.conf;",
        ),
    ]
    for pattern, replacement in replacements:
        config = substitute(pattern, replacement, config, 1, source)
    return config


def render(
    directory,
    upstreams,
    certificate,
    key,
    proxy_read_timeout=None,
    upstream_keepalive=0,
    limit_conn=None,
    uncapped=(),
):
    """Return the shipped config with the test's upstreams, loopback ports and files; with
    `upstream_keepalive`, nginx keeps that many idle connections to the upstream (benchmarks);
    with `limit_conn`, that cap on an address's requests at once instead of the shipped one, and
    the `uncapped` addresses listed as never capped."""
    config = SHIPPED_CONFIG.read_text()
    servers = "".join(
        f"    server {address} max_fails=1 fail_timeout=10s;\n" for address in upstreams
    )
    config = substitute(r"^    server 127\.0\.0\.1:8000 .*;\n", servers, config, 1)
    config = substitute(r"^    listen \[::\]:\d+.*;\n", "", config, 2)
    http_port, https_port = free_port(), free_port()
    config = substitute(r"^    listen 80;", f"    listen 127.0.0.1:{http_port};", config, 1)
    config = substitute(r"^    listen 443 ssl", f"    listen 127.0.0.1:{https_port} ssl", config, 1)
    config = substitute(
        r"^    ssl_certificate \S+;", f"    ssl_certificate {certificate};", config, 1
    )
    config = substitute(
        r"^    ssl_certificate_key \S+;", f"    ssl_certificate_key {key};", config, 1
    )
    config = substitute(
        r"^    access_log \S+ ", f"    access_log {directory}/access.log ", config, 2
    )
    if proxy_read_timeout is not None:
        config = substitute(
            r"^    proxy_read_timeout \S+;",
            f"    proxy_read_timeout {proxy_read_timeout};",
            config,
            1,
        )
    if limit_conn is not None:
        config = substitute(
            r"^    limit_conn animal_store_addresses \d+;",
            f"    limit_conn animal_store_addresses {limit_conn};",
            config,
            1,
        )
    if uncapped:
        listed = "".join(f"    {address} 1;\n" for address in uncapped)
        config = substitute(r"^    # 192\.0\.2\.7 1;\n", listed, config, 1)
    if upstream_keepalive:
        config = substitute(
            r"^(upstream animal_store \{\n(?:    server .*\n)+)",
            rf"\g<1>    keepalive {upstream_keepalive};\n",
            config,
            1,
        )
        config = substitute(
            r"^    location / \{\n",
            "    location / {\n"
            "        proxy_http_version 1.1;\n"
            '        proxy_set_header Connection "";\n',
            config,
            1,
        )
    return config, http_port, https_port


class Nginx:
    """nginx in the foreground with its own prefix directory, stopped by PID."""

    def __init__(
        self,
        directory: Path,
        upstreams,
        certificate,
        key,
        proxy_read_timeout=None,
        upstream_keepalive=0,
        worker_processes=1,
        limit_conn=None,
        uncapped=(),
        main_config=SHIPPED_MAIN_CONFIG,
    ):
        self.directory = directory
        directory.mkdir(parents=True)
        config, self.http_port, self.https_port = render(
            directory,
            upstreams,
            certificate,
            key,
            proxy_read_timeout,
            upstream_keepalive,
            limit_conn,
            uncapped,
        )
        (directory / "animal-store.conf").write_text(config)
        # Worker processes started by root default to user nobody, who cannot enter pytest's
        # private tmp directory to buffer request bodies.
        user = "user root;" if os.geteuid() == 0 else ""
        (directory / "nginx.conf").write_text(
            render_main(directory, worker_processes, user, main_config)
        )
        self.url = f"https://127.0.0.1:{self.https_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.process = subprocess.Popen(
            [
                NGINX,
                "-p",
                str(directory),
                "-c",
                str(directory / "nginx.conf"),
                "-e",
                str(directory / "error.log"),
                "-g",
                "daemon off;",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def wait_until_serving(self, timeout=30):
        wait_for_port(self.process, self.https_port, "nginx", self.error_log, timeout)
        return self

    def error_log(self):
        path = self.directory / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def access_log(self, lines=0, timeout=5):
        """Return the access log once it has this many lines: nginx writes a request's line
        after sending the response, so the client can be faster than the log."""
        path = self.directory / "access.log"
        deadline = time.monotonic() + timeout
        while True:
            text = path.read_text(errors="replace") if path.exists() else ""
            if len(text.splitlines()) >= lines or time.monotonic() > deadline:
                return text
            time.sleep(0.02)

    def stop(self):
        stop_process(self.process, timeout=10)
