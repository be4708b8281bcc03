"""The steps of docs/deploy.rst (High availability, Overload, steps 2, 3 and 6) and of
docs/operations.rst (A database machine lost) as an operator runs them (issue 49, items 8 and 9).

Each command the docs give is taken from its literal block and run where it can run here: the
sed that makes db2's and db3's etcd.env, on the shipped file; step 2's password on a cluster of
the test's own that logs every statement; the High availability userlist and ALTER ROLE on that
cluster's primary and its standby, the ssh to PgBouncer's machine run locally; the line that
loads /etc/patroni_env.conf, for Patroni's own request code; HAProxy on the shipped file; step
6's certificate and curl against the shipped nginx; the overload key through the CLI and the
API; step 3's file with its other Redis, for the app. Where a step is for machines the test does
not have (the members' REST APIs), the check is of what the step says against the shipped files.
"""

import base64
import http.server
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import start_own_cluster
from nginx_server import NGINX, PROJECT_DIR, Nginx, free_port, stop_process, substitute
from patroni_cluster import HAPROXY
from test_pgbouncer_auth import ROLE_STEP, Shell

from animal_store import create_app, default_settings
from animal_store.data.failover import CONFIRM_EVERY

DOCS = PROJECT_DIR / "docs"
PATRONI_FILES = PROJECT_DIR / "config" / "patroni"
# The commands of Patroni's REST API (patronictl asks a member to act), as against those that
# only read or write etcd (list, edit-config, remove).
REST_COMMANDS = r"switchover|failover|reinit|restart|reload|pause|resume|flush"


@dataclass
class Block:
    """A literal block: its lines in the file (first, after the last), its text unindented."""

    first: int
    end: int
    text: str


def literal_blocks(lines: list[str]) -> list[Block]:
    """Every literal block (the indented lines after a paragraph that ends in "::")."""
    blocks = []
    for number, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        first = number + 1
        while first < len(lines) and not lines[first].strip():
            first += 1
        if first == len(lines):
            break
        indent = len(lines[first]) - len(lines[first].lstrip())
        end = first
        while end < len(lines) and (
            not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) >= indent
        ):
            end += 1
        while not lines[end - 1].strip():
            end -= 1
        blocks.append(Block(first, end, textwrap.dedent("\n".join(lines[first:end])) + "\n"))
    return blocks


def read(name: str) -> list[str]:
    """The lines of docs/`name`."""
    return (DOCS / name).read_text().splitlines()


def section(lines: list[str], title: str) -> list[str]:
    """The lines of the section of `lines` titled `title` (the shallowest, where subsections share
    its name), its subsections included."""
    headings = [
        (number, underline[0])
        for number, (line, underline) in enumerate(itertools.pairwise(lines))
        if line.strip() and re.fullmatch(r"([=\-~^])\1{2,}", underline)
    ]
    levels = list(dict.fromkeys(character for _, character in headings))
    found = [(number, character) for number, character in headings if lines[number] == title]
    # The shallowest of its name: High availability's own "Step by step", not Redis Sentinel's.
    found = [(n, c) for n, c in found if levels.index(c) == min(levels.index(c) for _, c in found)]
    assert len(found) == 1, f"{len(found)} sections titled {title!r}"
    start, character = found[0]
    end = next(
        (
            number
            for number, other in headings
            if number > start and levels.index(other) <= levels.index(character)
        ),
        len(lines),
    )
    return lines[start:end]


def block_with(lines: list[str], *wanted: str) -> str:
    """The one literal block of `lines` that holds each of `wanted`."""
    found = [block.text for block in literal_blocks(lines) if all(w in block.text for w in wanted)]
    assert len(found) == 1, f"{len(found)} literal blocks hold {wanted}"
    return found[0]


def prose(lines: list[str]) -> str:
    """The text of `lines` but their literal blocks, its whitespace one space."""
    inside = {n for block in literal_blocks(lines) for n in range(block.first, block.end)}
    return " ".join(" ".join(line for n, line in enumerate(lines) if n not in inside).split())


def bash(commands: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run `commands` in bash, stopping at the first that fails; return what they printed."""
    result = subprocess.run(
        ["bash", "-e", "-c", commands],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"{commands}\n{result.stdout}{result.stderr}"
    return result.stdout


def assignments(text: str) -> dict[str, str]:
    """The NAME=value lines of an environment file, as the shell reads them."""
    found = {}
    for line in text.splitlines():
        if re.match(r"[A-Z_]+=", line):
            name, _, value = line.partition("=")
            found[name] = shlex.split(value)[0] if value else ""
    return found


HIGH_AVAILABILITY = section(read("deploy.rst"), "High availability")
STEP_BY_STEP = section(HIGH_AVAILABILITY, "Step by step")
HA_PGBOUNCER = section(HIGH_AVAILABILITY, "PgBouncer follows the primary, through HAProxy")


# etcd (item 8): the sed the guide gives makes db2's and db3's etcd.env from db1's.


def test_the_documented_sed_changes_a_members_own_addresses_and_keeps_etcds_cluster(tmp_path):
    step = block_with(STEP_BY_STEP, "config/patroni/etcd.env >>/etc/default/etcd", "sed ")
    db1 = re.search(r"^cat \S+etcd\.env >>/etc/default/etcd$", step, re.MULTILINE)
    db2 = re.search(r"^sed .*?>>/etc/default/etcd$", step, re.MULTILINE | re.DOTALL)
    assert db1, step
    assert db2, step
    # "on db3: db3 and 10.0.0.7", the comment above the sed says.
    assert "# on db2 (on db3: db3 and 10.0.0.7)" in step
    db3 = db2[0].replace("db2", "db3").replace("10.0.0.6", "10.0.0.7")
    commands = "\n".join(
        command.replace("/srv/animal-store/", f"{PROJECT_DIR}/").replace(
            "/etc/default/etcd", str(tmp_path / name)
        )
        for name, command in [("db1", db1[0]), ("db2", db2[0]), ("db3", db3)]
    )
    bash(commands)

    shipped_text = (PATRONI_FILES / "etcd.env").read_text()
    shipped = assignments(shipped_text)
    cluster = dict(member.split("=") for member in shipped["ETCD_INITIAL_CLUSTER"].split(","))
    assert sorted(cluster) == ["db1", "db2", "db3"]
    own_lines = {
        "ETCD_NAME",
        "ETCD_LISTEN_PEER_URLS",
        "ETCD_LISTEN_CLIENT_URLS",
        "ETCD_INITIAL_ADVERTISE_PEER_URLS",
        "ETCD_ADVERTISE_CLIENT_URLS",
    }
    for name, peer_url in cluster.items():
        text = (tmp_path / name).read_text()
        # The comments as shipped: only settings change.
        assert [line for line in text.splitlines() if line.startswith("#")] == [
            line for line in shipped_text.splitlines() if line.startswith("#")
        ]
        member = assignments(text)
        address = re.fullmatch(r"http://([\d.]+):2380", peer_url)[1]
        others = [
            re.search(r"[\d.]+(?=:2380)", url)[0] for other, url in cluster.items() if other != name
        ]
        assert member["ETCD_NAME"] == name
        # What etcd checks at its start: the member's own peer URL is its entry in the cluster.
        assert member["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == peer_url
        assert member["ETCD_INITIAL_CLUSTER"] == shipped["ETCD_INITIAL_CLUSTER"]
        for setting in own_lines - {"ETCD_NAME"}:
            assert address in member[setting], (name, setting, member[setting])
            assert not any(other in member[setting] for other in others), (name, setting)
        assert {k: v for k, v in member.items() if k not in own_lines} == {
            k: v for k, v in shipped.items() if k not in own_lines
        }


# patronictl (item 8): the commands that go through a member's REST API need its password.


def environment_loader() -> str:
    """The line that loads /etc/patroni_env.conf into root's shell, as step 3 gives it."""
    block = block_with(STEP_BY_STEP, ". /etc/patroni_env.conf")
    assert block.count("\n") == 1, block
    return block.strip()


@pytest.mark.parametrize("name", ["deploy.rst", "operations.rst"])
def test_patronictl_acts_through_the_rest_api_only_with_the_environment_loaded(name):
    """Each patronictl command that goes through a member's REST API (shown as run, with -c)
    follows the loader of /etc/patroni_env.conf in its own literal block, or, where the prose
    gives it, in the block before it: the shell the reader has open. Without it switchover says
    401 and exits 0."""
    loader = environment_loader()
    lines = read(name)
    blocks = literal_blocks(lines)
    shown = 0
    for number, line in enumerate(lines):
        for command in re.finditer(rf"patronictl -c \S+ (?:{REST_COMMANDS})\b", line):
            shown += 1
            own = [block for block in blocks if block.first <= number < block.end]
            if own:
                before = "\n".join([*lines[own[0].first : number], line[: command.start()]])
            else:
                before = [block for block in blocks if block.end <= number][-1].text
            assert loader in before, f"docs/{name}:{number + 1}: {line.strip()}"
    assert shown or name == "deploy.rst"


class AuthorizationRecorder(http.server.BaseHTTPRequestHandler):
    """Patroni's REST API as far as patronictl's request goes: it notes the Authorization
    header each POST brings, and answers 200."""

    def do_POST(self):
        self.server.authorizations.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args):
        pass


# What patronictl does to send a member a command: load the configuration (the file and the
# environment's PATRONI_* variables) and send through Patroni's own request class.
PATRONICTL_REQUEST = """
import sys
from patroni.ctl import load_config
from patroni.request import PatroniRequest
PatroniRequest(load_config(sys.argv[1], None)).request("POST", sys.argv[2])
"""


@pytest.mark.skipif(shutil.which("patronictl") is None, reason="needs patroni (Debian: patroni)")
def test_the_environment_loaded_as_documented_gives_patronictl_the_rest_apis_password(tmp_path):
    step = block_with(STEP_BY_STEP, "cat >/etc/patroni_env.conf <<'ENV'")
    step = step.replace("/srv/animal-store/", f"{PROJECT_DIR}/").replace("/etc/", f"{tmp_path}/")
    (tmp_path / "patroni").mkdir()
    bash(step)
    written = assignments((tmp_path / "patroni_env.conf").read_text())
    credentials = f"{written['PATRONI_RESTAPI_USERNAME']}:{written['PATRONI_RESTAPI_PASSWORD']}"
    expected = "Basic " + base64.b64encode(credentials.encode()).decode()

    # patronictl's interpreter, as its first line names it.
    python = Path(shutil.which("patronictl")).read_text().splitlines()[0].removeprefix("#!")
    server = http.server.HTTPServer(("127.0.0.1", 0), AuthorizationRecorder)
    server.authorizations = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        request = (
            f"{python} -c {shlex.quote(PATRONICTL_REQUEST)} {tmp_path}/patroni/config.yml "
            f"http://127.0.0.1:{server.server_port}/switchover"
        )
        loader = environment_loader().replace("/etc/", f"{tmp_path}/")
        bash(f"{loader}\n{request}", env={"PATH": "/usr/bin:/bin"})
        bash(request, env={"PATH": "/usr/bin:/bin"})  # a shell without it
    finally:
        server.shutdown()
        server.server_close()
    assert server.authorizations == [expected, None]


# Step 2's password and the High availability userlist (item 8), on a cluster of the test's own.


@pytest.fixture(scope="module")
def documented_role():
    """A primary that wants passwords and logs every statement, with step 2 run on it as
    written; then a standby of it. Yield (primary, standby, the directory of /root's files)."""
    primary = start_own_cluster(passwords=True, replication="async")
    directory = Path(tempfile.mkdtemp(prefix="animal-documented-steps-"))
    directory.chmod(0o777)
    standby = None
    try:
        primary.sql("ALTER SYSTEM SET log_statement = 'all';\nSELECT pg_reload_conf();")
        deadline = time.monotonic() + 10
        while primary.sql("SHOW log_statement").strip() != "all":  # a new session's
            assert time.monotonic() < deadline, "log_statement is not 'all' after the reload"
            time.sleep(0.05)
        Shell(primary, directory).run(ROLE_STEP)
        standby = primary.standby()
        yield primary, standby, directory
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_step_2_sets_a_password_with_no_terminal_and_no_line_of_the_log(documented_role):
    primary, _, directory = documented_role
    password = (directory / "store-password").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{48}", password)  # the docs: nothing to percent-encode
    # Run again (the role exists: CREATE ROLE fails, and so does createdb), as pasted.
    again = Shell(primary, directory).paste(ROLE_STEP)
    assert "already exists" in again.stderr
    assert (directory / "store-password").read_text().strip() == password
    stored = primary.sql("SELECT rolpassword FROM pg_authid WHERE rolname = 'store'")
    assert stored.startswith("SCRAM-SHA-256$")
    # The role logs in with the file's password, by SCRAM over TCP, to its database.
    login = subprocess.run(
        ["psql", "-Atc", "SELECT current_user, current_database()"],
        env={
            "PGHOST": "127.0.0.1",
            "PGPORT": str(primary.port),
            "PGUSER": "store",
            "PGDATABASE": "store",
            "PGPASSWORD": password,
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert login.stdout.strip() == "store|store", login.stderr
    log = primary.log()
    assert "statement: SHOW log_statement" in log  # every statement is logged
    assert 'ERROR:  role "store" already exists' in log  # the second run's, without it
    assert password not in log


def test_the_userlist_and_statement_timeout_run_on_the_leader_for_pgbouncers_machine(
    documented_role,
):
    primary, standby, directory = documented_role
    said = prose(HA_PGBOUNCER)
    assert re.search(r"the userlist's query and the ``ALTER ROLE`` run on the leader", said)
    step = block_with(HA_PGBOUNCER, "FROM pg_authid", "ALTER ROLE store")
    # What the leader sends, PgBouncer's machine writes: ssh runs the quoted command there.
    sent = re.subn(r"ssh root@<the PgBouncer machine> ('[^']*')", r"bash -c \1", step)
    assert sent[1] == 1, step
    assert "'cat >/etc/pgbouncer/userlist.txt'" in step

    refused = Shell(standby, directory).paste(sent[0], "-e", "-o", "pipefail")
    assert refused.returncode != 0
    assert "cannot execute ALTER ROLE in a read-only transaction" in refused.stderr

    Shell(primary, directory).run(sent[0])
    userlist = (directory / "userlist.txt").read_text()
    secret = primary.sql("SELECT rolpassword FROM pg_authid WHERE rolname = 'store'").strip()
    assert userlist == f'"store" "{secret}"\n'
    settings = primary.sql(
        "SELECT setconfig FROM pg_db_role_setting WHERE setrole = 'store'::regrole"
    )
    assert settings.strip() == "{statement_timeout=4s}"


# HAProxy (item 8): the shipped file logs nowhere but its standard error.


class PatroniPrimary(http.server.BaseHTTPRequestHandler):
    """Patroni's REST API on the leader, as HAProxy's check sees it: 200 to GET /primary."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args):
        pass


@pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (Debian: haproxy)")
def test_shipped_haproxy_cfg_runs_with_no_alert(tmp_path):
    """The shipped file, with one server whose Patroni says primary and two that refuse: the
    two are marked down, which HAProxy says; with Debian's `log /dev/log` and no /dev/log in
    the chroot (here an empty directory of the test's), it says an ALERT too."""
    source = PATRONI_FILES / "haproxy.cfg"
    text = source.read_text()
    # Not run as root, HAProxy keeps no chroot, and a machine with a /dev/log of its own (the
    # journal's) would take a `log /dev/log` without a word: the run below could not tell.
    assert not [line for line in text.splitlines() if line.split()[:1] == ["log"]]
    check = subprocess.run(
        [HAPROXY, "-c", "-f", str(source)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check
    assert "ALERT" not in check.stdout + check.stderr, check

    primary = http.server.HTTPServer(("127.0.0.1", 0), PatroniPrimary)
    threading.Thread(target=primary.serve_forever, daemon=True).start()
    port = free_port()
    text = substitute(r"bind 127\.0\.0\.1:5000$", f"bind 127.0.0.1:{port}", text, 1, source)
    checks = [primary.server_port, free_port(), free_port()]
    for number, check_port in enumerate(checks, start=1):
        text = substitute(
            rf"^    server db{number} \S+ check port 8008$",
            f"    server db{number} 127.0.0.1:{free_port()} check port {check_port}",
            text,
            1,
            source,
        )
    if os.geteuid() == 0:  # an empty directory to go into, as the chroot a unit lacks
        chroot = tmp_path / "chroot"
        chroot.mkdir()
        text = substitute(r"^    chroot /var/lib/haproxy$", f"    chroot {chroot}", text, 1, source)
    else:  # only root may change user or chroot
        text = substitute(r"^    (user|group|chroot) .*\n", "", text, 3, source)
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    output = tmp_path / "haproxy.log"
    with output.open("wb") as log:
        process = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not all(
            f"postgres_primary/{name} is DOWN" in output.read_text() for name in ("db2", "db3")
        ):
            assert process.poll() is None, output.read_text()
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(0.1)
    finally:
        stop_process(process, timeout=10)
        primary.shutdown()
        primary.server_close()
    said = output.read_text()
    assert "postgres_primary/db1 is DOWN" not in said
    assert "[ALERT]" not in said, said


# What to watch (item 8): each member's /health and the leader's /patroni, not `list` alone.


def test_what_to_watch_reads_every_members_health_and_the_leaders_replication():
    watch = section(HIGH_AVAILABILITY, "What to watch")
    loop = block_with(watch, "/health")
    hosts = re.search(r"^for host in ([\d. ]+); do$", loop, re.MULTILINE)
    servers = re.findall(
        r"^    server db\d ([\d.]+):5432 check port (\d+)$",
        (PATRONI_FILES / "haproxy.cfg").read_text(),
        re.MULTILINE,
    )
    listen = re.search(
        r"^  listen: [\d.]+:(\d+)$", (PATRONI_FILES / "patroni.yml").read_text(), re.MULTILINE
    )
    assert hosts, loop
    assert len(servers) == 3
    assert listen
    assert hosts[1].split() == [address for address, _ in servers]
    assert {port for _, port in servers} == {listen[1]}
    assert f'"http://$host:{listen[1]}/health"' in loop
    assert re.search(rf"^curl -s http://<the leader>:{listen[1]}/patroni$", loop, re.MULTILINE)
    said = prose(watch)
    assert "So ``list`` says who leads, not who is alive." in said
    # Operations' lost machine shows `list` too, and sends the reader to /health.
    lost = section(read("operations.rst"), "A database machine lost")
    assert "patronictl -c /etc/patroni/config.yml list" in block_with(lost, "config.yml list")
    assert "Each member's ``GET /health`` says whether it runs now" in prose(lost)


# Reads during a failover (item 8): one figure, the code's.


def test_reads_during_a_failover_are_said_one_way_as_the_code_bounds_them():
    """Every place that says how long a worker answers reads from what it kept once its
    database is lost gives one figure, a second, the code's CONFIRM_EVERY (measured:
    tests/test_deadlines.py); none says they are answered throughout."""
    assert CONFIRM_EVERY == 1.0  # "at most a second"
    ha = prose(HIGH_AVAILABILITY)
    for name in ("deploy.rst", "operations.rst", "api.rst"):
        text = " ".join((DOCS / name).read_text().split())
        assert not re.search(r"answered throughout|throughout a failover", text), name
    # Each sentence that bounds how long a worker answers from what it kept.
    bounds = re.findall(r"[^.]*\bkept\b[^.]*?\bat most ([^.,;(]+)", ha)
    assert len(bounds) >= 3, bounds
    assert all(bound.startswith("a second") for bound in bounds), bounds
    lost_machine = re.search(r"\*\*A lost machine\*\*.*?(?= - \*\*)", ha)[0]
    assert "for at most a second after its database stops answering" in lost_machine
    assert "then reads too are the JSON 503" in lost_machine
    # Operations' outage of the keys' cache says the same of PostgreSQL.
    keys = prose(section(read("operations.rst"), "API keys"))
    assert "on PostgreSQL for at most a second after the database stopped answering" in keys


# Overload (item 9): the figures' key, and how to make one.


def test_overload_tells_to_load_with_a_key_whose_limit_is_raised(make_app):
    overload = section(read("deploy.rst"), "Overload")
    step = block_with(overload, "keys create", "--rate-limit", "keys revoke")
    create, revoke = (shlex.split(line) for line in step.splitlines())
    assert create[:3] == revoke[:3] == [".venv/bin/flask", "--app", "animal_store"]
    limit = create[create.index("--rate-limit") + 1]
    bench = (PROJECT_DIR / "benchmarks" / "http_bench.py").read_text()
    assert f'BENCH_LIMIT = "{limit}"' in bench  # the figures' key, as the docs say
    assert default_settings.RATE_LIMIT == "6000 per minute"  # a step-4 key's, as they say

    app = make_app(KEY_CACHE_SECONDS=0)
    runner, client = app.test_cli_runner(), app.test_client()
    made = runner.invoke(args=create[3:])
    assert made.exit_code == 0, made.output
    headers = {"Authorization": f"Bearer {made.output.splitlines()[-1]}"}
    answer = client.get("/v1/pets", headers=headers)
    assert (answer.status_code, answer.headers["RateLimit-Limit"]) == (200, limit.split()[0])
    assert runner.invoke(args=revoke[3:]).exit_code == 0
    assert client.get("/v1/pets", headers=headers).status_code == 401


# Step 6 and step 3 (item 9): curl and the self-signed certificate; another Redis.


def numbered_step(start: str) -> list[str]:
    """The lines of the single machine's step of docs/deploy.rst that begins with `start`."""
    lines = read("deploy.rst")
    first = next(n for n, line in enumerate(lines) if line.startswith(start))
    end = next(n for n in range(first + 1, len(lines)) if lines[n][:1] not in ("", " "))
    return lines[first:end]


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)")
@pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("openssl")), reason="needs curl and openssl"
)
def test_step_6s_curl_reaches_nginx_with_step_6s_self_signed_certificate(tmp_path):
    """Step 6's certificate made by its openssl command for a <host> that is a name, nginx on
    the shipped site with it, and step 6's curl (the name resolved to the loopback, as DNS
    would): answered over TLS (502: no instance behind this nginx; the handshake is what -k
    is for), and without -k refused as the docs quote; --cacert with the certificate checks it
    instead."""
    step = numbered_step("6. nginx:")
    host = "store.test"
    for folder in ("certs", "private"):
        (tmp_path / folder).mkdir()
    making = block_with(step, "openssl req -x509")
    bash(making.replace("<host>", host).replace("/etc/ssl/", f"{tmp_path}/"))
    certificate = tmp_path / "certs" / "animal-store.pem"
    key = tmp_path / "private" / "animal-store.key"
    upstream = f"127.0.0.1:{free_port()}"
    nginx = Nginx(tmp_path / "nginx", [upstream], certificate, key).wait_until_serving()
    try:
        shown = [line for line in block_with(step, "curl ").splitlines() if "curl " in line]
        assert len(shown) == 1, shown
        command = shlex.split(shown[0], comments=True)
        assert command[-1] == "https://<host>/readyz", command
        url = f"https://{host}:{nginx.https_port}/readyz"
        resolve = ["--resolve", f"{host}:{nginx.https_port}:127.0.0.1"]

        def curl(*options):
            return subprocess.run(
                ["curl", *options, *resolve, url], capture_output=True, text=True, timeout=30
            )

        as_shown = curl(*command[1:-1])
        assert as_shown.returncode == 0, as_shown.stderr
        assert as_shown.stdout.startswith("HTTP/2 502"), as_shown.stdout
        said = prose(step)
        refusal = re.search(r"\(without it: ``(curl: \(60\) [^`]*)``\)", said)
        cacert = re.search(r"``--cacert (\S+)`` instead checks", said)
        assert refusal, said
        assert cacert, said
        without = curl(*[option for option in command[1:-1] if option != "-ik"], "-i")
        assert without.returncode == 60, without.stderr
        assert refusal[1] in without.stderr.splitlines()  # below curl's progress meter
        checked = curl("-i", "--cacert", cacert[1].replace("/etc/ssl/", f"{tmp_path}/"))
        assert checked.returncode == 0, checked.stderr
    finally:
        nginx.stop()


def test_step_3_points_the_rate_limits_at_another_redis(tmp_path, monkeypatch):
    """Step 3's file, with the line the step says to add for another Redis, loaded as step 4
    loads it: the app counts in that Redis, not production.py's."""
    step = numbered_step("3. Settings and secrets.")
    environment = tmp_path / "animal-store.env"
    bash(block_with(step, "cat >/etc/animal-store.env").replace("/etc/", f"{tmp_path}/"))
    added = block_with(step, "ANIMAL_STORE_RATELIMIT_STORAGE_URI=")
    environment.write_text(environment.read_text() + added)
    loader = block_with(numbered_step("4. Schema"), "db upgrade").splitlines()[0]
    assert loader == "set -a && . /etc/animal-store.env && set +a", loader
    dump = "import json, os; print(json.dumps(dict(os.environ)))"
    loaded = bash(
        f"{loader.replace('/etc/', f'{tmp_path}/')}\n{shlex.quote(sys.executable)} -c '{dump}'",
        env={"PATH": "/usr/bin:/bin"},
    )
    for name in list(os.environ):
        if name == "DATABASE_URL" or name.startswith("ANIMAL_STORE_"):
            monkeypatch.delenv(name)
    for name, value in json.loads(loaded).items():
        if name == "DATABASE_URL" or name.startswith("ANIMAL_STORE_"):
            monkeypatch.setenv(name, value)
    uri = assignments(added)["ANIMAL_STORE_RATELIMIT_STORAGE_URI"]
    assert uri == "redis://10.0.0.9:6379/0"
    app = create_app()
    assert app.config["RATELIMIT_STORAGE_URI"] == uri
    connecting = app.extensions["animal_store_rate_limits"].redis.connection_pool.connection_kwargs
    assert (connecting["host"], connecting["port"], connecting["db"]) == ("10.0.0.9", 6379, 0)
