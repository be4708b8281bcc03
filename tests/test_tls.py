"""TLS as shipped: config/nginx.conf follows Mozilla's "intermediate" profile (docs/deploy.rst).

testssl.sh scans nginx on the shipped file where it is installed (.ci/run installs it); the
properties the issue named are also checked without it, with Python's ssl module and raw HTTP/1.1:
HSTS on every HTTPS answer (nginx's own error pages too) and never in plain HTTP, no nginx version
in the Server header, no CBC suite under TLS 1.2, no session tickets.
"""

import contextlib
import json
import re
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass

import pytest
from conftest import IN_POSTGRESQL_PASS
from nginx_server import NGINX, SHIPPED_CONFIG, free_port

pytestmark = [
    IN_POSTGRESQL_PASS,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)"),
]

# Debian's package installs the script as `testssl`; upstream's checkout names it testssl.sh.
TESTSSL = shutil.which("testssl.sh") or shutil.which("testssl")
HSTS = "max-age=63072000"
HSTS_LINE = "add_header Strict-Transport-Security $animal_store_hsts always;"
SEVERE = {"LOW", "MEDIUM", "HIGH", "CRITICAL"}
# Findings that do not count, by testssl's id: the test's certificate is self-signed, for
# 127.0.0.1, valid for a day, without CRL or OCSP URL: every cert_* finding is about that
# certificate, not about the shipped file.
CERTIFICATE_PREFIX = "cert_"
EXEMPT = {
    "cert_revocation": "the test's certificate names no CRL or OCSP responder (self-signed)",
    "DNS_CAArecord": "127.0.0.1 has no DNS name, so no CAA record (not looked up: -n none)",
    "cipher_order": (
        "Mozilla's intermediate profile lets the client choose (ssl_prefer_server_ciphers off),"
        " as every suite offered is AEAD with forward secrecy (cipherlist_*, LUCKY13 and PFS"
        " would say otherwise); testssl 3.0 rates any client choice HIGH (testssl.sh issue 1311)"
    ),
}
# What the scan must have reported, or it did not run the checks this test relies on; with HSTS
# sent, testssl reports HSTS_time (LOW if too short) and no HSTS.
EXPECTED_IDS = {
    "TLS1",
    "TLS1_1",
    "TLS1_2",
    "TLS1_3",
    "cipherlist_AVERAGE",
    "cipherlist_3DES_IDEA",
    "PFS",
    "cipher_order",
    "TLS_extensions",
    "banner_server",
    "LUCKY13",
    "BEAST",
    "SWEET32",
    "heartbleed",
    "ROBOT",
}
# Protocols (-p), cipher categories (-s), forward secrecy (-f), the server's preferences (-P), its
# defaults (-S: session tickets and the certificate), HTTP headers (-h) and the vulnerabilities
# (-U): a standard run but for client simulations (-c: which browser would pick what, reported as
# INFO only), which take about a third of its time. No DNS lookups (-n none): the target is an IP.
TESTSSL_CHECKS = ["-p", "-s", "-f", "-P", "-S", "-h", "-U"]


@pytest.fixture
def tls_context(certificate):
    return ssl.create_default_context(cafile=str(certificate[0]))


@dataclass
class Answer:
    status: int
    fields: list[tuple[str, str]]
    body: bytes

    def values(self, name):
        """Every value of the header field `name`, in order."""
        return [value for field, value in self.fields if field == name.lower()]


def http_request(method="GET", path="/healthz", fields=(), body=b"", host="127.0.0.1"):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close", *fields]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(port, request, tls_context=None):
    """Send one HTTP/1.1 request (over TLS with a context) and read the answer to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        sock = tls_context.wrap_socket(raw, server_hostname="127.0.0.1") if tls_context else raw
        with sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = [line.split(":", 1) for line in lines]
    return Answer(
        int(status_line.split()[1]),
        [(name.strip().lower(), value.strip()) for name, value in fields],
        body,
    )


# The kinds of answer nginx gives, each made by one request: (the upstream nginx has, what it is
# started with, the request, the status). "gunicorn": the app answers; "closed": a port nothing
# listens on (nginx's 502, and the requests that never reach an upstream); "silent": a socket that
# never answers (504, and a request held in progress for the limit_conn 429).
HTTPS_ANSWERS = {
    "app-200": ("gunicorn", {}, http_request(path="/healthz"), 200),
    "app-401": ("gunicorn", {}, http_request(path="/v1/pets"), 401),
    "nginx-404-metrics": ("closed", {}, http_request(path="/metrics"), 404),
    "nginx-400-malformed": ("closed", {}, http_request(host="bad/host"), 400),
    "nginx-413-body": (
        "closed",
        {},
        http_request("POST", "/v1/pets", ["Content-Type: application/json"], b"x" * 65537),
        413,
    ),
    "nginx-414-uri": ("closed", {}, http_request(path="/v1/pets?q=" + "x" * 5000), 414),
    "nginx-431-header": ("closed", {}, http_request(fields=["X-Big: " + "x" * 131_072]), 431),
    "nginx-429-limit": ("silent", {"limit_conn": 1}, http_request(path="/v1/pets"), 429),
    "nginx-502-upstream-down": ("closed", {}, http_request(path="/v1/pets"), 502),
    "nginx-504-upstream-silent": (
        "silent",
        {"proxy_read_timeout": "1s"},
        http_request(path="/v1/pets"),
        504,
    ),
}
# Plain HTTP: the port-80 redirect, and plain HTTP sent to the TLS port (nginx's 497, the 400).
PLAIN_ANSWERS = {
    "redirect-308-port-80": ("http", http_request(path="/v1/pets"), 308),
    "nginx-400-plain-http-on-tls-port": ("https", http_request(path="/v1/pets"), 400),
}


@pytest.fixture
def silent_upstream():
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        yield f"127.0.0.1:{silent.getsockname()[1]}"


@pytest.fixture
def https_answer(request, start_nginx, silent_upstream, tls_context):
    """Return nginx's answer of one kind (HTTPS_ANSWERS) over TLS. The app's answers come from
    the module's gunicorn: each is one request on a connection of its own, from a nginx of the
    test's own."""

    def answer(kind):
        upstream, options, sent, status = HTTPS_ANSWERS[kind]
        if upstream == "gunicorn":
            gunicorn = request.getfixturevalue("module_gunicorn")
            address = gunicorn.url.removeprefix("http://")
        elif upstream == "silent":
            address = silent_upstream
        else:
            address = f"127.0.0.1:{free_port()}"
        nginx = start_nginx([address], **options)
        with contextlib.ExitStack() as held:
            if "limit_conn" in options:
                # A POST whose body never comes is in progress once nginx has read its headers.
                raw = held.enter_context(
                    socket.create_connection(("127.0.0.1", nginx.https_port), timeout=10)
                )
                tls = held.enter_context(tls_context.wrap_socket(raw, server_hostname="127.0.0.1"))
                tls.sendall(http_request("POST", "/v1/pets", ["Content-Length: 10"]))
                time.sleep(0.2)
            received = exchange(nginx.https_port, sent, tls_context)
        assert received.status == status, received
        return received

    return answer


@pytest.fixture
def plain_answer(start_nginx):
    """Return nginx's answer of one kind (PLAIN_ANSWERS) in plain HTTP."""

    def answer(kind):
        port_name, sent, status = PLAIN_ANSWERS[kind]
        nginx = start_nginx([f"127.0.0.1:{free_port()}"])
        received = exchange(getattr(nginx, f"{port_name}_port"), sent)
        assert received.status == status, received
        return received

    return answer


@pytest.mark.parametrize("kind", HTTPS_ANSWERS)
def test_every_https_answer_has_hsts(https_answer, kind):
    assert https_answer(kind).values("Strict-Transport-Security") == [HSTS]


@pytest.mark.parametrize("kind", PLAIN_ANSWERS)
def test_no_plain_http_answer_has_hsts(plain_answer, kind):
    """RFC 6797: a host sends HSTS over secure transport only."""
    assert plain_answer(kind).values("Strict-Transport-Security") == []


@pytest.mark.parametrize("kind", HTTPS_ANSWERS)
def test_https_answers_name_no_nginx_version(https_answer, kind):
    assert https_answer(kind).values("Server") == ["nginx"]


@pytest.mark.parametrize("kind", PLAIN_ANSWERS)
def test_plain_http_answers_name_no_nginx_version(plain_answer, kind):
    assert plain_answer(kind).values("Server") == ["nginx"]


def config_blocks(text):
    """[(the line opening a block, the block's own directives)] of an nginx config, nested
    blocks listed too, their directives not counted as the outer block's."""
    blocks, stack = [], [("", [])]
    for raw_line in text.splitlines():
        # Quoted strings (the JSON bodies, log_format) may hold braces and #: not the syntax's.
        line = re.sub(r"'[^']*'|\"[^\"]*\"", "''", raw_line).split("#", 1)[0].strip()
        if line.endswith("{"):
            stack.append((raw_line.strip(), []))
        elif line == "}":
            blocks.append(stack.pop())
        elif line:
            stack[-1][1].append(raw_line.strip())
    assert len(stack) == 1, "unbalanced braces"
    return blocks


def test_every_block_with_headers_of_its_own_on_https_repeats_hsts():
    """A block with an add_header of its own inherits none from around it: the JSON error pages
    nginx cannot be made to answer here (its 500, 503) must repeat the line as well."""
    blocks = config_blocks(SHIPPED_CONFIG.read_text())
    servers = [i for i, (opening, _) in enumerate(blocks) if opening == "server {"]
    assert len(servers) == 2
    # Blocks are listed as they close: the HTTP server's blocks, then the HTTPS one's.
    plain, https = blocks[: servers[0] + 1], blocks[servers[0] + 1 : servers[1] + 1]
    assert any("listen 443 ssl" in directive for directive in https[-1][1])
    missing = [
        opening
        for opening, directives in https
        if any(d.startswith("add_header ") for d in directives) and HSTS_LINE not in directives
    ]
    assert missing == []
    assert not any("Strict-Transport-Security" in d for _, directives in plain for d in directives)


def tls12_context(tls_context, suite=None):
    tls_context.maximum_version = ssl.TLSVersion.TLSv1_2
    if suite is not None:
        tls_context.set_ciphers(suite)
    return tls_context


def handshake(port, context, session=None):
    """A TLS connection's negotiated (version, suite, session, reused), after one request: a
    session ticket, where there is one, comes after the handshake."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
    ):
        tls.sendall(http_request(path="/metrics"))
        while tls.recv(65536):
            pass
        return tls.version(), tls.cipher()[0], tls.session, tls.session_reused


# The test certificate is ECDSA: these are the CBC suites it could be used with (HIGH's, which
# nginx offered by default). RSA's would be refused by any nginx with this certificate.
CBC_SUITES = [
    "ECDHE-ECDSA-AES128-SHA256",
    "ECDHE-ECDSA-AES256-SHA384",
    "ECDHE-ECDSA-AES128-SHA",
    "ECDHE-ECDSA-AES256-SHA",
]
AEAD_SUITES = [
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
]


@pytest.mark.parametrize("suite", CBC_SUITES)
def test_tls12_refuses_cbc_suites(start_nginx, tls_context, suite):
    nginx = start_nginx([f"127.0.0.1:{free_port()}"])
    with pytest.raises(ssl.SSLError, match="HANDSHAKE_FAILURE"):
        handshake(nginx.https_port, tls12_context(tls_context, suite))


@pytest.mark.parametrize("suite", AEAD_SUITES)
def test_tls12_accepts_the_profiles_aead_suites(start_nginx, tls_context, suite):
    nginx = start_nginx([f"127.0.0.1:{free_port()}"])
    version, negotiated, _, _ = handshake(nginx.https_port, tls12_context(tls_context, suite))
    assert (version, negotiated) == ("TLSv1.2", suite)


def test_tls12_sessions_get_no_ticket_and_resume_from_the_cache(start_nginx, tls_context):
    """No TLS 1.2 session ticket; the session resumes by its ID from nginx's cache instead.
    (TLS 1.3 always resumes with a ticket: without ssl_session_tickets OpenSSL's holds only the
    ID of a session in that cache, with no key in it to steal, and Python cannot tell.)"""
    nginx = start_nginx([f"127.0.0.1:{free_port()}"])
    context = tls12_context(tls_context)
    _, _, session, _ = handshake(nginx.https_port, context)
    assert session.has_ticket is False
    assert session.id
    _, _, again, reused = handshake(nginx.https_port, context, session)
    assert reused
    assert again.id == session.id


@pytest.mark.skipif(TESTSSL is None, reason="testssl.sh is not installed (Debian: testssl.sh)")
def test_testssl_finds_nothing_low_or_worse(module_gunicorn, start_nginx, tmp_path):
    """testssl.sh on nginx from the shipped file, the app behind it: no finding of severity LOW
    or worse but the exempt ones (EXEMPT, the certificate's), no version in the Server banner and
    no session ticket extension (both reported as INFO)."""
    nginx = start_nginx([module_gunicorn.url.removeprefix("http://")])
    report = tmp_path / "testssl.json"
    command = [TESTSSL, "--jsonfile", str(report), "--quiet", "--warnings", "off", "--color", "0"]
    command += ["-n", "none", "--ip", "127.0.0.1", *TESTSSL_CHECKS]
    started = time.monotonic()
    run = subprocess.run(
        [*command, f"127.0.0.1:{nginx.https_port}/healthz"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    elapsed = time.monotonic() - started
    output = run.stdout[-3000:] + run.stderr[-3000:]
    # Exit statuses from 242 up are testssl's own errors (its ERR_* codes): nothing was scanned.
    assert run.returncode < 242, output
    findings = json.loads(report.read_text())
    reported = {finding["id"] for finding in findings}
    assert reported >= EXPECTED_IDS, output
    assert reported & {"HSTS", "HSTS_time"}, output
    severe = [
        f"{finding['id']} {finding['severity']}: {finding['finding']}"
        for finding in findings
        if finding["severity"] in SEVERE
        and not finding["id"].startswith(CERTIFICATE_PREFIX)
        and finding["id"] not in EXEMPT
    ]
    by_id = {finding["id"]: finding["finding"] for finding in findings}
    if by_id["banner_server"] != "nginx":
        severe.append(f"banner_server: {by_id['banner_server']} (not plain nginx)")
    if "session ticket" in by_id["TLS_extensions"]:
        severe.append(f"TLS_extensions: {by_id['TLS_extensions']} (session tickets on)")
    assert severe == [], f"testssl.sh ({elapsed:.0f} s) found:\n" + "\n".join(severe)
