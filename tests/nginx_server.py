"""A real nginx running the shipped config/nginx.conf, rendered with a test's ports and paths."""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import PROJECT_DIR, free_port, stop_process
from requests.structures import CaseInsensitiveDict

NGINX = shutil.which("nginx") or next(
    (path for path in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(path, os.X_OK)), None
)
SHIPPED_CONFIG = PROJECT_DIR / "config" / "nginx.conf"

# Stands in for Debian's /etc/nginx/nginx.conf, which includes the shipped file in its http block.
MAIN_CONFIG = """\
{user}
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log info;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {directory}/client_body;
    proxy_temp_path {directory}/proxy;
    fastcgi_temp_path {directory}/fastcgi;
    uwsgi_temp_path {directory}/uwsgi;
    scgi_temp_path {directory}/scgi;
    include {directory}/animal-store.conf;
}}
"""


def substitute(pattern, replacement, text, count):
    """Replace a setting of the shipped file, failing loudly if the file no longer has it."""
    result, found = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    if found != count:
        raise AssertionError(f"config/nginx.conf: {pattern!r} found {found} times, not {count}")
    return result


def render(directory, upstreams, certificate, key, proxy_read_timeout=None):
    """Return the shipped config with the test's upstreams, loopback ports and files."""
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
    return config, http_port, https_port


class Nginx:
    """nginx in the foreground with its own prefix directory, stopped by PID."""

    def __init__(self, directory: Path, upstreams, certificate, key, proxy_read_timeout=None):
        self.directory = directory
        directory.mkdir(parents=True)
        config, self.http_port, self.https_port = render(
            directory, upstreams, certificate, key, proxy_read_timeout
        )
        (directory / "animal-store.conf").write_text(config)
        # Worker processes started by root default to user nobody, who cannot enter pytest's
        # private tmp directory to buffer request bodies.
        user = "user root;" if os.geteuid() == 0 else ""
        (directory / "nginx.conf").write_text(MAIN_CONFIG.format(user=user, directory=directory))
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

    def wait_until_serving(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.error_log()}")
            try:
                socket.create_connection(("127.0.0.1", self.https_port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nginx did not listen within {timeout}s: {self.error_log()}")

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


CURL = shutil.which("curl")


@dataclass
class CurlResponse:
    http_version: str
    status_code: int
    headers: CaseInsensitiveDict
    content: bytes

    def json(self):
        return json.loads(self.content)


def curl(protocol, method, url, certificate, headers=(), content=None, timeout=10):
    """One request with curl over "HTTP/1.1" or "HTTP/2", as a user would send it.

    curl rather than a Python client: over HTTP/2, httpx keeps sending a body nginx has refused
    and waits for flow-control credit that never comes; curl reads the early answer.
    """
    with tempfile.TemporaryDirectory() as directory:
        head, body = Path(directory) / "head", Path(directory) / "body"
        command = [CURL, "--silent", "--show-error", "--cacert", str(certificate)]
        command += ["--http2" if protocol == "HTTP/2" else "--http1.1", "--max-time", str(timeout)]
        command += ["--request", method, "--dump-header", str(head), "--output", str(body)]
        for name, value in dict(headers).items():
            command += ["--header", f"{name}: {value}"]
        if content is not None:
            command += ["--data-binary", "@-"]
        subprocess.run([*command, url], input=content, check=True, capture_output=True)
        status_line, *lines = head.read_bytes().decode().split("\r\n\r\n")[-2].splitlines()
        version, status = status_line.split()[:2]
        fields = (line.partition(":") for line in lines)
        return CurlResponse(
            "HTTP/2" if version == "HTTP/2" else version,
            int(status),
            CaseInsensitiveDict({name: value.strip() for name, _, value in fields}),
            body.read_bytes(),
        )
