"""What gunicorn's master does for the store, called by config/gunicorn.conf.py's hooks: check the
release and its settings before any worker starts, keep the metrics' directory, and run the
metrics' process beside the workers (observability/master_metrics.py).

The standard library and gunicorn only: the master imports nothing of the app (the release is
checked in a child process). Like the worker class, this module is read anew from disk after a
reload, as serving/worker.py's Worker.setup() has the master forget the package's modules.
"""

import importlib.metadata
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import gunicorn
from gunicorn import glogging

if TYPE_CHECKING:
    from gunicorn.arbiter import Arbiter

# Prometheus metrics summed over the workers (observability/metrics.py, prometheus_client's
# multiprocess mode): each worker writes its figures to files in PROMETHEUS_MULTIPROC_DIR, which
# must be set before anything imports prometheus_client (the master does, in child_exit). A
# directory of this instance's own (systemd's RuntimeDirectory in docs/deploy.rst), emptied at
# start; without one, a fresh temporary directory, removed when the master exits. Which one was
# made is kept in the environment, as the config file is read again on HUP.
TEMPORARY_METRICS_DIR = "GUNICORN_TEMPORARY_METRICS_DIR"
# The instance's metrics on a listener of their own, which no worker's load can block, served by
# a small process the master starts beside its workers (observability/master_metrics.py). Unset:
# only the app's /metrics on the app's port, which waits behind the clients when every worker is
# busy. The process's PID is kept in the environment, as the config file is read again on HUP.
METRICS_BIND = "ANIMAL_STORE_METRICS_BIND"
METRICS_PROCESS = "GUNICORN_METRICS_PROCESS"


def make_metrics_dir() -> None:
    """Give the workers a metrics' directory where the environment names none."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        made = tempfile.mkdtemp(prefix="animal-store-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ[TEMPORARY_METRICS_DIR] = made


def check_boot(server: "Arbiter") -> None:
    """Stop the boot (exit 1) on a release that cannot be imported or a bad setting; give the
    workers an empty metrics' directory."""
    make_metrics_dir()
    # A bad setting stops the boot here, in one line, before any worker starts: in the workers
    # it would be a traceback in each, and gunicorn would halt only once one of them had failed.
    # The check runs in a child process: the master imports nothing of the app, so the workers a
    # reload (HUP) forks import the release on disk, not one the master would hold in memory.
    check = os.fork()
    if check == 0:
        os._exit(check_settings(server))
    if os.waitstatus_to_exitcode(os.waitpid(check, 0)[1]) != 0:
        remove_temporary_metrics_dir()
        sys.exit(1)
    # Figures a previous run left would be added to this one's.
    for leftover in Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).glob("*.db"):
        leftover.unlink()


def check_settings(server: "Arbiter") -> int:
    """Import the release, check the settings as create_app() does and the database's login;
    log what is wrong and return 1, or return 0."""
    log = cast(glogging.Logger, server.log)
    try:
        # Every module the workers import: a release that cannot be imported (a dependency the
        # lock gained but pip did not install) is said here once, not by each worker in turn.
        import animal_store.factory  # noqa: F401
    except BaseException:
        log.exception("The release cannot be imported")
        return 1
    else:
        from animal_store.data.database import check_login
        from animal_store.settings import SettingsError, check_environment

        try:
            config = check_environment()
        except SettingsError as error:
            # The arbiter has its log by the time it calls on_starting. A record a setting: one
            # JSON line each, as `flask` prints one line each.
            for line in error.format_message().splitlines():
                log.error("%s", line)
            return 1
        except BaseException:
            log.exception("The app cannot load its settings")
            return 1
        # A password the database refuses is a wrong setting too, said once here rather than
        # as a 503 for every request of workers that look ready. A database that does not
        # answer is said and ridden out.
        login = check_login(config)
        if login is not None:
            level, message = login
            log.log(level, "%s", message)
            if level == logging.ERROR:
                return 1
    finally:
        # The check's process ends with os._exit, which flushes nothing.
        sys.stdout.flush()
    return 0


def start_metrics(server: "Arbiter") -> None:
    """Start the metrics' process, or stop the boot (exit 1) in one line."""
    # The listening sockets exist and no worker yet: a metrics listener that cannot start stops
    # the boot, in one line, as a bad setting does.
    failure = start_metrics_process(server)
    if failure:
        cast(glogging.Logger, server.log).error("%s", failure)
        remove_temporary_metrics_dir()
        sys.exit(1)


def start_metrics_process(server: "Arbiter") -> str | None:
    """Start the metrics' process if ANIMAL_STORE_METRICS_BIND names its address; return why it
    could not start, or None."""
    bind = os.environ.get(METRICS_BIND)
    if not bind:
        return None
    listeners = [listener.fileno() for listener in server.LISTENERS]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "animal_store.observability.master_metrics",
            f"--bind={bind}",
            f"--master={os.getpid()}",
            *(f"--listener={fd}" for fd in listeners),
        ],
        pass_fds=listeners,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    with process.stdout:
        # Its first line: ready, or why not. Importing prometheus_client takes a moment, more on
        # a loaded machine.
        answered = select.select([process.stdout], [], [], 60)[0]
        line = process.stdout.readline().decode().strip() if answered else ""
    if line == "ready":
        os.environ[METRICS_PROCESS] = str(process.pid)
        cast(glogging.Logger, server.log).info("Serving the metrics on http://%s/metrics", bind)
        return None
    stop_process(process.pid)
    return line or f"The metrics' process did not start on {bind} within 60 s."


def stop_metrics_process() -> None:
    pid = os.environ.pop(METRICS_PROCESS, None)
    if pid:
        stop_process(int(pid))


def stop_process(pid: int) -> None:
    """Stop a child of the master and reap it, so that its port is free when this returns."""
    for stop in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, stop)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                return  # gunicorn reaped it: it had ended
            time.sleep(0.01)


def reload(server: "Arbiter") -> None:
    """Start the metrics' process anew, and say when gunicorn itself needs a restart."""
    # The metrics' process runs the release on disk, as the new workers do.
    stop_metrics_process()
    failure = start_metrics_process(server)
    if failure:
        cast(glogging.Logger, server.log).error("%s", failure)
    # gunicorn itself (and prometheus_client, for child_exit) is the master's own: a new version
    # of it takes a restart (docs/operations.rst, Upgrading).
    installed = importlib.metadata.version("gunicorn")
    if installed != gunicorn.__version__:
        cast(glogging.Logger, server.log).warning(
            "gunicorn %s is installed but %s runs: restart to use it",
            installed,
            gunicorn.__version__,
        )


def exit_master() -> None:
    """Stop the metrics' process and remove the metrics' directory the master made."""
    stop_metrics_process()
    remove_temporary_metrics_dir()


def remove_temporary_metrics_dir() -> None:
    # A master re-executed on USR2 starts from the environment gunicorn itself started with,
    # so it makes a directory of its own: each master removes only the one it made.
    made = os.environ.get(TEMPORARY_METRICS_DIR)
    if made:
        shutil.rmtree(made, ignore_errors=True)
