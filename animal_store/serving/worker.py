"""The store's gunicorn worker: gunicorn's sync worker, with what differs said method by method.

config/gunicorn.conf.py names it (`worker_class`). What it changes, each in the method it
overrides: the answer to a request gunicorn refuses itself (the API's error object, with the
status nginx gives the same request, and an X-Request-ID); the time a worker waits for a
connection, counted as idle, and the requests it counted, written between requests; a body that
stops coming, refused 408 after REQUEST_BODY_TIMEOUT seconds instead of holding the worker; a
body the client sends only once asked (Expect: 100-continue), asked for when the app first reads
it, so that a refusal that needs no body comes instead; a request nginx gave up on while it
waited for a worker, neither run nor answered but counted apart; and how a connection ends: at
once when nothing is left to read, gracefully otherwise.

gunicorn loads this class in its master, and the master must hold nothing of the release, so that
a reload (HUP) puts the release on disk into service (tests/test_releases.py). So this module
imports nothing of the app at its top: a method imports what it needs of the app when it runs, in
the worker, after the fork. And setup(), which gunicorn calls in the master each time it loads the
class (at boot and on every reload), makes the master forget every module of the package it
imported to load it: the workers it forks import the release anew, and the next reload imports
this module anew from disk, so a new release's worker code serves after a reload too.
"""

import select
import socket
import ssl
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.http.body import Body, LengthReader
from gunicorn.workers.sync import SyncWorker

if TYPE_CHECKING:
    from flask import Flask
    from gunicorn.http.body import ChunkedReader, EOFReader
    from gunicorn.http.message import Request

    from animal_store.observability.metrics import RequestMetrics

PACKAGE = __name__.partition(".")[0]
# The line that says a worker loaded the app and takes requests (docs/operations.rst, Upgrading):
# it names the release the worker imported.
READY = "Worker ready (pid: %s): animal-store %s"
# What gunicorn's parser refuses, answered with the status nginx gives the same request
# (docs/errors.rst); any other refusal of its parser is 400.
REFUSAL_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    # A response header the app made: the app's fault, not the client's. (types-gunicorn 26 has
    # not these two of gunicorn 27's.)
    (http_errors.InvalidResponseHeader, 500),  # type: ignore[attr-defined]
    (http_errors.InvalidResponseHeaderName, 500),  # type: ignore[attr-defined]
    (http_errors.ConfigurationProblem, 500),
    (http_errors.LimitRequestLine, 414),
    (http_errors.LimitRequestHeaders, 431),
    (http_errors.ExpectationFailed, 417),
    (http_errors.UnsupportedTransferCoding, 501),
    (http_errors.ForbiddenProxyRequest, 403),
    (ssl.SSLError, 403),
    (http_errors.ParseException, 400),
)
# What asks a client that sent `Expect: 100-continue` for its body (RFC 9110, section 10.1.1).
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Worker(SyncWorker):
    """gunicorn's sync worker for the store's app (and, without the store's extensions, for any
    WSGI app: benchmarks/ceiling.py runs one)."""

    # The app's request counts (observability/metrics.py), where the app is the store.
    counts: "RequestMetrics | None" = None
    # Seconds a read of a request's body may wait for the client (REQUEST_BODY_TIMEOUT).
    body_timeout: float | None = None

    @classmethod
    def setup(cls) -> None:
        """Make gunicorn's master forget the package's modules, which loading the class imported:
        the master keeps the class, and nothing of the release (the module's docstring)."""
        # And prometheus_client: a master started by release 1.0.0 imported the app in process
        # (its on_starting checked the settings there), whose metrics its registry holds, and the
        # workers it forks would register them again, as duplicates. Any other master imports it
        # only in child_exit, and does so again. (tests/test_releases.py upgrades a 1.0.0 master.)
        forgotten = {PACKAGE, "prometheus_client"}
        for name in [name for name in sys.modules if name.partition(".")[0] in forgotten]:
            del sys.modules[name]

    def load_wsgi(self) -> None:
        super().load_wsgi()
        extensions = getattr(self.wsgi, "extensions", {})
        if "animal_store_metrics" in extensions:
            from animal_store.observability.metrics import request_metrics

            self.counts = request_metrics(cast("Flask", self.wsgi))
        config = getattr(self.wsgi, "config", {})
        self.body_timeout = config.get("REQUEST_BODY_TIMEOUT") or None

    def run(self) -> None:
        from animal_store.version import VERSION

        # Said once the app is loaded, so an operator (or a test) can tell a server whose
        # workers have all started from one whose first worker alone serves.
        self.log.info(READY, self.pid, VERSION, extra={"fields": {"version": VERSION}})
        if "animal_store_rate_limits" in getattr(self.wsgi, "extensions", {}):
            from animal_store.access.rate_limits import warn_if_counted_apart

            # Loud when the rate limits cannot hold: counted in each worker's memory.
            warn_if_counted_apart(cast("Flask", self.wsgi), self.cfg.workers)
        # gunicorn waits for a connection up to half its timeout (15 s); a second at most, so an
        # idle worker's counts are written within two seconds of its last request. A wake-up a
        # second costs nothing measurable.
        self.timeout = min(self.timeout, 1)
        if self.counts is not None:
            self.counts.count_busy_share()
        try:
            super().run()
        finally:
            # A worker that stops (a reload, a restart, max_requests) writes what it counted last.
            if self.counts is not None:
                self.counts.write()

    def notify(self) -> None:
        """Tell the master this worker lives, and write the counts that are due: gunicorn calls
        this between requests and whenever it wakes from waiting for one."""
        super().notify()
        if self.counts is not None:
            self.counts.write_if_due()

    def wait(self, timeout: int) -> Any:
        """Wait for a connection, counting the wait as idle time (between requests a busy
        worker accepts the next one without waiting)."""
        started = time.monotonic()
        try:
            return super().wait(timeout)
        finally:
            if self.counts is not None:
                self.counts.idle(time.monotonic() - started)

    # types-gunicorn 26 has it return a bool; gunicorn 27's returns nothing.
    def handle_request(  # type: ignore[override]
        self, listener: socket.socket, req: "Request", client: socket.socket, addr: Any
    ) -> None:
        if abandoned(req, client):
            # No one would read the answer: the request costs nothing, and counts apart.
            if self.counts is not None:
                self.counts.abandoned()
            client.close()
            return
        # A read of the body that waits longer than this raises TimeoutError in the app, which
        # answers 408 (http/body.py); without it a client that stops sending holds the worker
        # until gunicorn kills it (`timeout`, 30 s) and gets a 500.
        client.settimeout(self.body_timeout)
        # gunicorn 27 sends 100 Continue as soon as it has the request's headers (wsgi.create),
        # before the app runs: the client then sends its whole body, which nothing reads, to get
        # a 401 or a 413 the headers decided. Asked for on the app's first read instead, so that
        # such a refusal is the answer the client waits for, and it sends none of the body.
        # (_expected_100_continue is gunicorn's; types-gunicorn 26 has it not.)
        if req._expected_100_continue and req.body is not None:  # type: ignore[attr-defined]
            req._expected_100_continue = False  # type: ignore[attr-defined]
            req.body = ContinueOnRead(req.body.reader, client)
        super().handle_request(listener, req, client, addr)
        # The answer is written. gunicorn ends the connection gracefully (util.close_graceful):
        # it shuts down its side and waits for the peer's, up to 2 s, so that the kernel sends
        # no reset for bytes the app left unread, which could cut the answer. Where nothing is
        # left unread and nothing more is due, that wait only holds the worker (28% of its time
        # behind nginx, which closes once it has the answer): close at once. gunicorn's own
        # close then finds the socket closed and does nothing.
        if nothing_left_to_read(req, client):
            client.close()

    def handle_error(
        self, req: "Request | None", client: socket.socket, addr: Any, exc: BaseException
    ) -> None:
        """Answer what gunicorn refuses (or an error outside the app) with the error object."""
        from animal_store.errors import raw_error_response
        from animal_store.http.request_id import NEW_IDS, VALID_REQUEST_ID

        request = req or getattr(exc, "req", None)
        status = refusal_status(exc, request)
        # The client's X-Request-ID where gunicorn had parsed the headers and it is one the app
        # takes too (joined, if sent twice), else a new one: the answer and the line say it.
        headers = getattr(request, "headers", ())
        sent = ",".join(value for name, value in headers if name == "X-REQUEST-ID")
        request_id = sent if VALID_REQUEST_ID.fullmatch(sent) else NEW_IDS.new()
        fields = {"fields": {"request_id": request_id}}
        if status == 500:
            uri = getattr(request, "uri", "(no URI read)")
            self.log.exception("Error handling request %s", uri, extra=fields)
        else:
            ip = addr[0] if addr else ""
            self.log.warning("Invalid request from ip=%s: %s", ip, exc, extra=fields)
        try:
            # The catalogue's message, never gunicorn's: that may quote what the client sent.
            util.write_nonblock(client, raw_error_response(status, request_id))
        except OSError:
            self.log.debug("Failed to send error message.")


class ContinueOnRead(Body):
    """The body of a request whose client waits for 100 Continue before it sends the body: sent
    on the first read, when the app wants the body. An app that answers without reading it (a
    request without a key, a Content-Length over MAX_CONTENT_LENGTH) never asks for it."""

    def __init__(
        self, reader: "ChunkedReader | LengthReader | EOFReader", client: socket.socket
    ) -> None:
        super().__init__(reader)
        self.client = client
        self.asked = False

    def read(self, size: int | None = None) -> bytes:
        self.ask()
        return super().read(size)

    def readline(self, size: int | None = None) -> bytes:
        self.ask()
        return super().readline(size)

    def ask(self) -> None:
        if not self.asked:
            self.asked = True
            self.client.sendall(CONTINUE)


def refusal_status(exc: BaseException, request: "Request | None") -> int:
    """Return the status of the answer to a request gunicorn refused, as nginx answers it.

    gunicorn answers a Transfer-Encoding it knows and does not decode (`gzip`, `identity`) or
    chunked not alone with 400, nginx with 501, as it does an unknown coding: every path answers
    501 (docs/errors.rst). In an HTTP/1.0 request, where no coding belongs, both say 400.
    """
    if (
        isinstance(exc, http_errors.InvalidHeader)
        and exc.hdr == "TRANSFER-ENCODING"
        and request is not None
        and request.version is not None
        and request.version >= (1, 1)
    ):
        return 501
    for refused, status in REFUSAL_STATUS:
        if isinstance(exc, refused):
            return status
    return 500


def abandoned(req: "Request", client: socket.socket) -> bool:
    """Whether nginx gave up on the request before a worker took it: under a surge the requests it
    passes on wait in the listening socket, and a client that goes meanwhile (nginx logs 499; or
    nginx's proxy_read_timeout passes) has nginx close its connection to gunicorn, which the
    worker then finds closed by its peer. Its answer would reach no one, and a 503 for having
    waited too long would count as the service's error.

    poll(2)'s POLLRDHUP says the peer closed whatever is left unread (a POST's body, where a peek
    would read the body's first byte). Only a request nginx passed on (the X-Request-Start it
    stamps on each, config/nginx.conf) is taken for gone: nginx never shuts down its side of a
    connection whose answer it awaits, while a client that reaches gunicorn directly may, after
    its request, and is answered."""
    if not any(name == "X-REQUEST-START" for name, _ in req.headers):
        return False  # (asked first: a look at the headers costs less than a system call)
    poller = select.poll()
    poller.register(client, select.POLLRDHUP)  # POLLHUP and POLLERR (a reset) come unasked
    return bool(poller.poll(0))


def nothing_left_to_read(req: "Request", client: socket.socket) -> bool:
    """Whether closing now can cut no answer: the body was read to its end (none, for a GET), or
    reading it failed (a client that stopped sending it has had its 408), and the kernel holds
    nothing more from the client, so that closing sends no reset; on plain TCP. An unread body, a
    chunked one, bytes sent after the request and TLS (whose socket cannot peek) keep the graceful
    end."""
    body = req.body
    if body is None or isinstance(client, ssl.SSLSocket):
        return False
    reader = body.reader
    read_whole = isinstance(reader, LengthReader) and reader.length == 0
    # (Body.failed is gunicorn 27's; types-gunicorn 26 has it not.)
    if not (read_whole or body.failed):  # type: ignore[attr-defined]
        return False
    # Non-blocking: with a timeout set, Python would wait for something to read first.
    client.setblocking(False)
    try:
        waiting = client.recv(1, socket.MSG_PEEK)
    except OSError:
        return True  # nothing waiting (EAGAIN), or the connection is gone already
    # b"": the client has closed its side, and nothing more can come.
    return waiting == b""
