"""The instance's metrics on a listener of their own (ANIMAL_STORE_METRICS_BIND), served by a
small process beside gunicorn's master, which no worker's load can block: with every worker busy,
a scrape of the app's /metrics waits in the listening socket's queue behind the clients, times
out, and reads as an instance down.

gunicorn's master starts it (config/gunicorn.conf.py), hands it the instance's listening sockets,
and stops it when it stops. It answers each scrape with the workers' figures, summed from their
multiprocess files (read from their mmaps, never waiting on a worker), and adds what only the
kernel can tell: how many connections wait in the listening sockets' queues, now and at most
since the last scrape (read every SAMPLE_EVERY), their backlog, and the connections dropped
because a queue was full. A process of its own, rather than a thread of the master: the workers
the master forks hold no copy of its socket, and a reload starts it anew on the release on disk.

    python -m animal_store.observability.master_metrics \
        --bind HOST:PORT --master PID --listener FD ...

The standard library and prometheus_client only: it never imports the app.
"""

import argparse
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# How often the queues are read: a burst that fills and drains between two scrapes is still
# seen, at a few microseconds a read.
SAMPLE_EVERY = 0.005
# struct tcp_info (linux/tcp.h): eight one-byte fields, then rto, ato, snd_mss, rcv_mss, and
# unacked and sacked, which a listening socket uses for its accept queue's length and its backlog.
TCP_INFO_HEAD = struct.Struct("8B6I")
READY = b"ready\n"


def parse_bind(text: str) -> tuple[str, int]:
    """Return (host, port) of host:port (127.0.0.1:9101, [::1]:9101), or raise ValueError saying
    what is expected."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"ANIMAL_STORE_METRICS_BIND is {text!r}: expected host:port, such as "
            "127.0.0.1:9101 or [::1]:9101."
        )
    return host, int(port)


def queue_of(listener: socket.socket) -> tuple[int, int] | None:
    """(connections waiting to be accepted, backlog) of a TCP listening socket; None for a Unix
    socket, whose queue the kernel does not give this way."""
    try:
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_HEAD.size)
    except OSError:
        return None
    fields = TCP_INFO_HEAD.unpack(info)
    return fields[12], fields[13]


def listen_overflows() -> int:
    """TcpExt ListenOverflows: connections dropped because a listening socket's queue was full,
    over every socket of the network namespace."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split(), strict=True))["ListenOverflows"])
    return 0


def name_of(listener: socket.socket) -> str:
    address = listener.getsockname()
    if isinstance(address, tuple):
        host, port = address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"unix:{address}"


class ListenQueues:
    """The queues of the instance's listening sockets, with their highest since the last scrape."""

    def __init__(self, listeners: list[socket.socket]) -> None:
        self.listeners = {name_of(listener): listener for listener in listeners}
        self.highest: dict[str, int] = {}
        self.lock = threading.Lock()

    def sample(self) -> dict[str, tuple[int, int]]:
        queues = {}
        for name, listener in self.listeners.items():
            queue = queue_of(listener)
            if queue is not None:
                queues[name] = queue
        with self.lock:
            for name, (queued, _backlog) in queues.items():
                self.highest[name] = max(self.highest.get(name, 0), queued)
        return queues

    def collect(self) -> Iterator[Metric]:
        queues = self.sample()
        with self.lock:
            highest, self.highest = self.highest, {}
        now = GaugeMetricFamily(
            "animal_store_listen_queue_connections",
            "Connections waiting in gunicorn's listening socket for a free worker.",
            labels=["listener"],
        )
        most = GaugeMetricFamily(
            "animal_store_listen_queue_connections_max",
            "The most connections that waited there at once since the last scrape.",
            labels=["listener"],
        )
        backlog = GaugeMetricFamily(
            "animal_store_listen_queue_backlog",
            "The connections the listening socket's queue holds: gunicorn's backlog, capped by "
            "net.core.somaxconn. Beyond it the kernel drops them.",
            labels=["listener"],
        )
        for name, (queued, size) in queues.items():
            now.add_metric([name], queued)
            most.add_metric([name], max(highest.get(name, 0), queued))
            backlog.add_metric([name], size)
        yield from (now, most, backlog)
        yield CounterMetricFamily(
            "animal_store_listen_queue_overflows",
            "Connections the kernel dropped because a listening socket's queue was full, over "
            "every socket of the machine (its network namespace): TcpExt ListenOverflows.",
            value=listen_overflows(),
        )


class InstanceProcesses:
    """process_* figures of the whole gunicorn instance (its master and every child) summed,
    which prometheus_client's own process collector cannot give in multiprocess mode."""

    def __init__(self, master: int) -> None:
        self.master = master

    def collect(self) -> Iterator[Metric]:
        pids = [self.master, *children(self.master)]
        cpu = memory = fds = 0.0
        page_size, ticks = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                cpu += (int(stat[11]) + int(stat[12])) / ticks
                memory += int(stat[21]) * page_size
                fds += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                continue  # a worker that just exited
        yield CounterMetricFamily(
            "process_cpu_seconds", "User and system CPU of the instance's processes.", value=cpu
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory of the instance's processes.", memory
        )
        yield GaugeMetricFamily("process_open_fds", "Open file descriptors of the instance.", fds)
        yield GaugeMetricFamily(
            "animal_store_processes",
            "gunicorn's master and its children: the workers, and the metrics' process if any.",
            len(pids),
        )


def children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m animal_store.observability.master_metrics")
    parser.add_argument("--bind", required=True, help="host:port to serve /metrics on")
    parser.add_argument("--master", type=int, required=True, help="gunicorn master's PID")
    parser.add_argument(
        "--listener", type=int, action="append", default=[], help="a listening socket's fd"
    )
    options = parser.parse_args(argv)
    queues = ListenQueues([socket.socket(fileno=fd) for fd in options.listener])
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(InstanceProcesses(options.master))
    registry.register(queues)
    # One line for the master, which waits for it before it starts the workers: READY, or why
    # not, which the master logs.
    try:
        host, port = parse_bind(options.bind)
        start_http_server(port, host, registry)
    except ValueError as error:
        print(error, flush=True)
        sys.exit(1)
    except OSError as error:
        print(f"Cannot serve the metrics on {options.bind}: {error.strerror}.", flush=True)
        sys.exit(1)
    sys.stdout.buffer.write(READY)
    sys.stdout.close()
    # Gone with the master, however it ended: nothing else would free the port.
    while os.getppid() == options.master:
        queues.sample()
        time.sleep(SAMPLE_EVERY)


if __name__ == "__main__":
    main()
