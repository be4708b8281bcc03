"""Putting a release into service, as docs/operations.rst (Upgrading) and docs/deploy.rst say:
behind the shipped nginx and under load, a reload (the unit's ExecReload) has every worker on the
release on disk, fails no request and moves no counter back; and the previous release, built
from git history, is upgraded in place by the documented steps with nothing lost."""

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import requests
import sqlalchemy as sa
from conftest import TEST_DATABASE_URL, copy_release
from nginx_server import NGINX, PROJECT_DIR
from prometheus_client.parser import text_string_to_metric_families
from test_release_steps import upgrade_script

from animal_store.version import VERSION

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: nginx)")

# The unit's reload, exactly as docs/deploy.rst writes it; systemd puts the master's PID for
# $MAINPID.
EXEC_RELOAD = re.search(
    r"^\s*ExecReload=(.+)$", (PROJECT_DIR / "docs" / "deploy.rst").read_text(), re.MULTILINE
).group(1)
# The worker class's ready line, and the next release's (tests the class is loaded anew).
READY = 'READY = "Worker ready (pid: %s): animal-store %s"'
NEXT_READY = (
    'READY = "Worker ready (pid: %s): animal-store %s, by the next release\'s worker class"'
)
# Within this many seconds of the reload every worker runs the new release (the bound).
RELOAD_WITHIN = 10
UNLIMITED = {"ANIMAL_STORE_RATE_LIMIT": "1000000 per minute"}


def reload_as_the_unit_does(master_pid):
    command = shlex.split(EXEC_RELOAD.replace("$MAINPID", str(master_pid)))
    subprocess.run(command, check=True, timeout=10)


def scrape(gunicorn) -> dict:
    """{(name, labels as a sorted tuple): value} of one scrape, straight from gunicorn (nginx
    hides /metrics)."""
    response = requests.get(gunicorn.url + "/metrics", timeout=10)
    response.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def versions_serving(samples) -> set[str]:
    return {
        dict(labels)["version"]
        for (name, labels), value in samples.items()
        if name == "animal_store_build_info" and value == 1
    }


def requests_counted(samples) -> float:
    return sum(v for (name, _), v in samples.items() if name == "animal_store_requests_total")


class Load:
    """Lists and creations through nginx from threads of their own until stopped: the status of
    every answer, and the animals acknowledged."""

    def __init__(self, url, certificate, key, listers=2, creators=2):
        self.url, self.certificate = url, certificate
        self.auth = {"Authorization": f"Bearer {key}"}
        self.statuses: Counter = Counter()
        self.failures: list[str] = []
        self.acknowledged: list[dict] = []
        # Every answer: (when, its status or the client's error, its Retry-After, its JSON).
        self.answers: list[tuple[float, int | str, str | None, object]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self.run, args=(work,))
            for work in [self.list_pets] * listers + [self.create_pet] * creators
        ]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def run(self, work):
        with requests.Session() as session:
            session.trust_env = False
            session.verify = str(self.certificate)
            n = 0
            while not self.stopping.is_set():
                try:
                    response = work(session, n)
                    outcome = response.status_code
                except requests.RequestException as error:
                    response, outcome = None, type(error).__name__
                answer = (time.monotonic(), outcome, *details(response))
                with self.lock:
                    self.answers.append(answer)
                    self.statuses[outcome] += 1
                    if outcome not in (200, 201):
                        self.failures.append(
                            f"{outcome}: {response.text if response is not None else ''}"
                        )
                    elif outcome == 201:
                        self.acknowledged.append(response.json())
                n += 1

    def list_pets(self, session, n):
        return session.get(f"{self.url}/v1/pets?limit=20", headers=self.auth, timeout=30)

    def create_pet(self, session, n):
        body = {"name": f"load-{threading.get_ident()}-{n}", "categoryId": n % 7}
        return session.post(f"{self.url}/v1/pets", json=body, headers=self.auth, timeout=30)

    def answered(self):
        with self.lock:
            return sum(self.statuses.values())

    def wait_for_answers(self, more, timeout=30):
        target, deadline = self.answered() + more, time.monotonic() + timeout
        while self.answered() < target and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.answered() >= target, f"the load stalled: {self.statuses}"


def details(response):
    """An answer's Retry-After and its JSON (None for a body that is none)."""
    if response is None:
        return None, None
    try:
        body = response.json()
    except ValueError:
        body = None
    return response.headers.get("Retry-After"), body


def walk(url, certificate, key):
    """Every animal, page by page through Link rel="next", in order."""
    seen, next_url = [], f"{url}/v1/pets?limit=100"
    while next_url:
        page = requests.get(
            next_url, headers={"Authorization": f"Bearer {key}"}, verify=certificate, timeout=30
        )
        assert page.status_code == 200, page.text
        seen += page.json()
        next_url = page.links.get("next", {}).get("url")
    return seen


def wait_for_versions(gunicorn, expected, scrapes, timeout=RELOAD_WITHIN):
    """Scrape until the live workers run exactly `expected`; return the seconds it took. Every
    scrape's request count is kept in `scrapes`, to show none went backwards."""
    started = time.monotonic()
    while True:
        samples = scrape(gunicorn)
        scrapes.append(requests_counted(samples))
        if versions_serving(samples) == expected:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, versions_serving(samples)
        time.sleep(0.1)


def ready_lines(gunicorn, version):
    return re.findall(
        rf"Worker ready \(pid: \d+\): animal-store {re.escape(version)}\b", gunicorn.log()
    )


def test_a_reload_puts_the_release_on_disk_into_service(
    tmp_path, database_url, make_key, start_gunicorn, start_nginx, certificate, production_env
):
    release = copy_release(tmp_path / "release")
    gunicorn = start_gunicorn(workers=2, env=production_env | UNLIMITED, directory=release)
    nginx = start_nginx([gunicorn.url.removeprefix("http://")])
    key, scrapes = make_key(), []
    assert versions_serving(scrape(gunicorn)) == {VERSION}

    with Load(nginx.url, certificate[0], key) as load:
        load.wait_for_answers(200)
        # The next release, visibly another: a version of its own in the package's root, and
        # worker code of its own in the class gunicorn's master loads (serving/worker.py).
        next_version = f"{VERSION}+next"
        version_file = release / "animal_store" / "version.py"
        version_file.write_text(version_file.read_text().replace(VERSION, next_version))
        worker_file = release / "animal_store" / "serving" / "worker.py"
        worker_code = worker_file.read_text()
        assert READY in worker_code
        worker_file.write_text(worker_code.replace(READY, NEXT_READY))
        reload_as_the_unit_does(gunicorn.process.pid)
        took = wait_for_versions(gunicorn, {next_version}, scrapes)
        load.wait_for_answers(200)

    assert load.failures == [], load.statuses
    assert load.statuses[201] > 0
    assert load.statuses[200] > 0
    assert scrapes == sorted(scrapes), "a counter went backwards"
    print(f"reload: {dict(load.statuses)} answers, new release serving {took:.2f}s after HUP")
    assert len(ready_lines(gunicorn, next_version)) == 2
    # Both workers forked after the reload ran the new release's worker class.
    assert gunicorn.log().count("by the next release's worker class") == 2
    walked = walk(nginx.url, str(certificate[0]), key)
    assert [pet["id"] for pet in walked] == sorted(pet["id"] for pet in load.acknowledged)


# The release this one follows, named in the changelog with its commit.
PREVIOUS_RELEASE = re.search(
    r"^1\.0\.0 \(commit ([0-9a-f]{40})\)$",
    (PROJECT_DIR / "CHANGELOG.rst").read_text(),
    re.MULTILINE,
)


def git(*args, cwd=PROJECT_DIR):
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


@pytest.fixture
def own_database():
    """A PostgreSQL database of the test's own beside the suite's, dropped afterwards: it starts
    empty, for the previous release's migrations."""
    if not TEST_DATABASE_URL:
        pytest.skip("the upgrade is tested on PostgreSQL: set TEST_DATABASE_URL")
    url = sa.make_url(TEST_DATABASE_URL).set(drivername="postgresql+psycopg")
    name = f"{url.database}_upgrade"
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield url.set(database=name).render_as_string(hide_password=False)
    with engine.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


class Deployment:
    """A checkout of a release with a virtualenv of its own, as docs/deploy.rst makes one, in a
    temporary directory; its commands run as the deploy guide runs them, from the checkout."""

    def __init__(self, directory, commit, database):
        self.directory, self.database = directory, database
        self.python = str(directory / ".venv" / "bin" / "python")
        self.environment = {
            **os.environ,
            "ANIMAL_STORE_ENV": "production",
            "DATABASE_URL": database,
        }
        git("clone", "--quiet", "--no-checkout", str(PROJECT_DIR), str(directory))
        git("checkout", "--quiet", commit, cwd=directory)
        subprocess.run([sys.executable, "-m", "venv", directory / ".venv"], check=True)
        # The previous release's requirements at the versions of today's lock: it had no lock.
        self.shell(f".venv/bin/pip install --require-hashes -r {PROJECT_DIR}/requirements.txt")
        self.shell(".venv/bin/pip install --no-deps -e .")

    def shell(self, command):
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=self.directory,
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
        return result.stdout

    def flask(self, *args):
        return self.shell(shlex.join([".venv/bin/flask", "--app", "animal_store", *args]))

    def upgrade(self, commit, master_pid):
        """Run docs/operations.rst's block of steps: the test's user owns the checkout and gives
        the environment, and systemd's reload is the unit's ExecReload."""
        script = upgrade_script(self.directory, commit)
        script = re.sub(r"^ *(chown|set -a) .*\n", "", script, flags=re.MULTILINE)
        script = script.replace("runuser -u animal-store -- ", "").replace(
            "systemctl reload animal-store",
            EXEC_RELOAD.replace("$MAINPID", str(master_pid)),
        )
        self.shell(script)


def test_the_previous_release_is_upgraded_in_place_under_load(
    tmp_path, own_database, start_gunicorn, start_nginx, certificate, production_env
):
    if PREVIOUS_RELEASE is None:
        raise AssertionError("CHANGELOG.rst names no commit for 1.0.0")
    previous = PREVIOUS_RELEASE.group(1)
    if subprocess.run(
        ["git", "cat-file", "-e", f"{previous}^{{commit}}"], cwd=PROJECT_DIR
    ).returncode:
        pytest.skip(f"the history holds no commit {previous} (a shallow clone?)")
    current = git("rev-parse", "HEAD")
    # The previous release deployed: its schema, its first key, its gunicorn behind nginx.
    deployment = Deployment(tmp_path / "srv", previous, own_database)
    deployment.flask("db", "upgrade")
    key = deployment.flask("keys", "create", "upgrade").split()[-1]
    gunicorn = start_gunicorn(
        workers=2,
        env=production_env | UNLIMITED,
        database=own_database,
        directory=deployment.directory,
        python=deployment.python,
    )
    nginx = start_nginx([gunicorn.url.removeprefix("http://")])
    assert versions_serving(scrape(gunicorn)) == set()  # 1.0.0 did not say

    scrapes = []
    with Load(nginx.url, certificate[0], key) as load:
        load.wait_for_answers(200)
        deployment.upgrade(current, gunicorn.process.pid)
        took = wait_for_versions(gunicorn, {VERSION}, scrapes)
        load.wait_for_answers(200)

    assert load.failures == [], load.statuses
    assert scrapes == sorted(scrapes), "a counter went backwards"
    print(f"upgrade: {dict(load.statuses)} answers, {VERSION} serving {took:.2f}s after HUP")
    assert len(ready_lines(gunicorn, VERSION)) == 2
    walked = walk(nginx.url, str(certificate[0]), key)
    # Nothing acknowledged lost, nothing else there, each once and in order.
    assert [pet["id"] for pet in walked] == sorted(pet["id"] for pet in load.acknowledged)
    assert {pet["id"]: pet for pet in walked} == {pet["id"]: pet for pet in load.acknowledged}
