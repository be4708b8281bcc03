"""The store's gunicorn worker: gunicorn's sync worker, with what differs said method by method.

config/gunicorn.conf.py names it (`worker_class`). What it changes, each in the method it
overrides: the answer to a request gunicorn refuses itself (the API's error object, with the
status nginx gives the same request, and an X-Request-ID); the time a worker waits for a
connection, counted as idle, and the requests it counted, written between requests; deadlines
for a client's whole head (REQUEST_HEADER_TIMEOUT) and whole body (REQUEST_BODY_TIMEOUT), so that
a client that sends nothing, or sends slowly, holds a worker seconds, not until gunicorn kills it
(the connection, class Connection); a chunk size beyond the body's limit refused at once; a body
the client sends only once asked (Expect: 100-continue), asked for when the app first reads it,
so that a refusal that needs no body comes instead; a request nginx gave up on while it waited
for a worker, neither run nor answered but counted apart; and how a connection ends: at once when
nothing is left to read, gracefully otherwise.

gunicorn loads this class in its master, and the master must hold nothing of the release, so that
a reload (HUP) puts the release on disk into service (tests/test_releases.py). So this module
imports nothing of the app at its top: a method imports what it needs of the app when it runs, in
the worker, after the fork. And setup(), which gunicorn calls in the master each time it loads the
class (at boot and on every reload), makes the master forget every module of the package it
imported to load it: the workers it forks import the release anew, and the next reload imports
this module anew from disk, so a new release's worker code serves after a reload too.
"""

import functools
import select
import socket
import ssl
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn, cast

from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.http.body import Body, ChunkedReader, LengthReader
from gunicorn.http.unreader import Unreader
from gunicorn.workers.sync import SyncWorker

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from flask import Flask
    from gunicorn.http.message import Request

    from animal_store.observability.metrics import RequestMetrics

PACKAGE = __name__.partition(".")[0]
# The line that says a worker loaded the app and takes requests (docs/operations.rst, Upgrading):
# it names the release the worker imported.
READY = "Worker ready (pid: %s): animal-store %s"


class HeadTimeout(http_errors.ParseException):
    """A client sent part of its head, and not the rest within REQUEST_HEADER_TIMEOUT: answered
    408 (REFUSAL_STATUS), as nginx's client_header_timeout would."""


# A response header the app made that gunicorn refuses. (types-gunicorn 26 has not these two of
# gunicorn 27's; `unused-ignore`: a release of the stubs that has them changes nothing.)
RESPONSE_HEADER_ERRORS = (http_errors.InvalidResponseHeader, http_errors.InvalidResponseHeaderName)  # type: ignore[attr-defined, unused-ignore]
# What gunicorn's parser refuses, answered with the status nginx gives the same request
# (docs/errors.rst); any other refusal of its parser is 400.
REFUSAL_STATUS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], int], ...] = (
    # A response header the app made: the app's fault, not the client's.
    (RESPONSE_HEADER_ERRORS, 500),
    (http_errors.ConfigurationProblem, 500),
    (http_errors.LimitRequestLine, 414),
    (http_errors.LimitRequestHeaders, 431),
    (http_errors.ExpectationFailed, 417),
    (http_errors.UnsupportedTransferCoding, 501),
    (http_errors.ForbiddenProxyRequest, 403),
    (ssl.SSLError, 403),
    (HeadTimeout, 408),
    (http_errors.ParseException, 400),
)
# What asks a client that sent `Expect: 100-continue` for its body (RFC 9110, section 10.1.1).
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Seconds a worker waits, once it has answered a client that missed a deadline, for the client to
# stop sending, before it closes: time for the answer to be read before a reset could cut it,
# short enough that a slow client holds the worker little past the deadline.
LINGER = 0.5
# The largest chunk size nginx takes (its off_t); a larger one is broken framing, answered 400.
LARGEST_CHUNK = 2**63 - 1
# The socket's own methods, which Connection's call: a super() call costs each read about a
# thousand instructions more.
RECV, SEND, SENDALL = socket.socket.recv, socket.socket.send, socket.socket.sendall


class Worker(SyncWorker):
    """gunicorn's sync worker for the store's app (and, without the store's extensions, for any
    WSGI app: benchmarks/ceiling.py runs one)."""

    # The app's request counts (observability/metrics.py), where the app is the store.
    counts: "RequestMetrics | None" = None
    # Seconds a client has for its whole head, from the accept (REQUEST_HEADER_TIMEOUT), and for
    # its whole body, from the head (REQUEST_BODY_TIMEOUT); None: as long as gunicorn lets a
    # worker live.
    head_timeout: float | None = None
    body_timeout: float | None = None
    # The largest body the app takes (MAX_CONTENT_LENGTH), which a chunk may not go past.
    body_limit: int | None = None

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
        self.head_timeout = config.get("REQUEST_HEADER_TIMEOUT") or None
        self.body_timeout = config.get("REQUEST_BODY_TIMEOUT") or None
        self.body_limit = config.get("MAX_CONTENT_LENGTH")

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
        # The kernel's bounds on a connection's reads and writes, which each connection takes
        # from its listener at the accept: no system call a request for them. A read's is the
        # head's deadline, which holds for the first read, the only one of most requests (the
        # Connection gives each later read what is left); a write's, the body's timeout, as
        # long as any one write may wait for the client.
        for listener in self.sockets:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(self.head_timeout))
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(self.body_timeout))
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

    def accept(self, listener: socket.socket) -> None:
        """Take a connection: gunicorn's, without its two system calls on the new socket that
        Python's accept(2) did already (tests/test_worker.py holds both true): making it blocking
        (Linux's accept gives a blocking socket, and Python takes it so from a listener whose
        timeout is 0) and closed on exec (SOCK_CLOEXEC). Four fcntl(2) a connection, which pay
        for the Connection it becomes."""
        client, addr = listener.accept()
        self.handle(listener, client, addr)

    def handle(self, listener: socket.socket, client: socket.socket, addr: Any) -> None:
        """Serve a connection whose reads end at its deadlines (class Connection): the head's
        first, from now."""
        connection = Connection.adopt(client, socket_kind(listener))
        # (The kernel's bound on its first read is the head's already: run().)
        connection.bound(self.head_timeout, late=HeadTimeout, kernel_bound=True)
        super().handle(listener, connection, addr)

    # types-gunicorn 26 has it return a bool; gunicorn 27's returns nothing (and `unused-ignore`:
    # a release of the stubs that says so changes nothing).
    def handle_request(  # type: ignore[override, unused-ignore]
        self, listener: socket.socket, req: "Request", client: socket.socket, addr: Any
    ) -> None:
        if abandoned(req, client):
            # No one would read the answer: the request costs nothing, and counts apart.
            if self.counts is not None:
                self.counts.abandoned()
            client.close()
            return
        if isinstance(client, Connection) and not empty(req):
            # The body's deadline, from the end of the head: a read past it raises TimeoutError
            # in the app, which answers 408 (http/body.py).
            client.bound(self.body_timeout, late=TimeoutError)
        if req.body is not None and isinstance(req.body.reader, ChunkedReader) and self.body_limit:
            # (Nothing of the body is read yet: gunicorn's reader parses only as the app reads.)
            req.body = Body(BoundedChunks(req, req.unreader, self.body_limit))
        super().handle_request(listener, req, client, addr)
        if isinstance(client, Connection):
            client.unbound()
            if client.timed_out:
                # It had its 408; its slow bytes may go on coming, which gunicorn's graceful
                # end would wait for up to 2 s.
                util.close_graceful(client, timeout=LINGER)
                return
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
        from animal_store.errors import HEAD_TIMEOUT, raw_error_response
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
            late = isinstance(exc, HeadTimeout)
            answer = HEAD_TIMEOUT(seconds=f"{self.head_timeout:g}") if late else status
            util.write_nonblock(client, raw_error_response(answer, request_id))
        except OSError:
            self.log.debug("Failed to send error message.")
        if isinstance(exc, HeadTimeout):
            # As after a body's 408 (handle_request): not gunicorn's 2 s for its slow bytes.
            util.close_graceful(client, timeout=LINGER)


class Connection(socket.socket):
    """A client's connection, whose reads end at a deadline: its whole head within
    REQUEST_HEADER_TIMEOUT of the accept, its whole body within REQUEST_BODY_TIMEOUT of the head.

    gunicorn's reads of a client wait as long as the client sends nothing: a client that sent
    nothing, or a byte a second of its head or of its body, held a sync worker until gunicorn
    killed it (30 s, a 500), and as many such clients as workers stopped the instance. A bound
    on each read would not do: a byte a second never waits long. The deadline bounds the whole.

    A read past the head's deadline raises HeadTimeout (answered 408), or closes the connection
    quietly if nothing came at all (an idle connection, which nginx closes so too); past the
    body's, TimeoutError, which the app answers 408.

    And the 100 Continue gunicorn 27 sends as soon as it has the head (wsgi.create), before the
    app runs, is held until the app first reads the body: the client then sends no body to get a
    401 or a 413 that the headers decided. (tests/test_worker.py fails if an upgrade sends it
    another way.)
    """

    deadline: float | None = None
    late: type[Exception] = TimeoutError
    received = 0
    bound_read = False
    timed_out = False
    continue_held = False

    @classmethod
    def adopt(cls, client: socket.socket, kind: tuple[int, int, int]) -> "Connection":
        """Return `client` as a Connection: the same socket, which `client` lets go. `kind`: its
        family, type and protocol, as its listener's (socket_kind())."""
        return cls(*kind, fileno=client.detach())

    def bound(
        self, seconds: float | None, late: type[Exception], kernel_bound: bool = False
    ) -> None:
        """Make the reads from now on end `seconds` from now, raising `late`; None: unbounded.
        `kernel_bound`: the kernel's bound on the next read is `seconds` already."""
        if seconds is None:
            self.deadline = None
            return
        self.deadline = time.monotonic() + seconds
        self.late = late
        # The kernel's bound on the next read, which the deadline leaves whole (each read after
        # it is given what is left): not Python's timeout, with which every read and write
        # would first poll(2).
        if not kernel_bound:
            self.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))
        self.bound_read = True

    def unbound(self) -> None:
        """End the deadlines and the held 100 Continue: the request is answered. (The kernel's
        bound may stay: what reads the socket after, to end the connection, does not block.)"""
        self.deadline = None
        self.continue_held = False

    def recv(self, bufsize: int, flags: int = 0, /) -> bytes:
        if self.continue_held and not flags & socket.MSG_PEEK:
            self.continue_held = False
            SENDALL(self, CONTINUE)
        deadline = self.deadline
        if deadline is None:
            return RECV(self, bufsize, flags)
        while True:
            if self.bound_read:
                self.bound_read = False
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.missed()
                self.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(left))
            try:
                data = RECV(self, bufsize, flags)
            except BlockingIOError:
                continue  # the kernel's bound passed: so has the deadline, but for rounding
            self.received += len(data)
            return data

    def missed(self) -> NoReturn:
        """Raise what missing the deadline means."""
        self.timed_out = True
        self.deadline = None
        if self.late is HeadTimeout and not self.received:
            # Nothing came: closed quietly, as gunicorn does a client that closed first.
            self.close()
            raise http_errors.NoMoreData()
        raise self.late()

    def send(self, data: "ReadableBuffer", flags: int = 0, /) -> int:
        if data == CONTINUE:
            self.continue_held = True
            return len(CONTINUE)
        return SEND(self, data, flags)


class BoundedChunks(ChunkedReader):
    """gunicorn's reader of a chunked body, refusing a chunk as soon as its size says it takes the
    body past the app's limit, as nginx does: gunicorn would read on, and wait, for bytes the app
    never takes. A size beyond nginx's largest (an overflow) is broken framing, answered 400; one
    within it, 413."""

    def __init__(self, req: "Request", unreader: Unreader, limit: int) -> None:
        super().__init__(req, unreader)
        self.left = limit

    def parse_chunk_size(
        self, unreader: Unreader, data: bytes | None = None
    ) -> tuple[int, bytes | None]:
        size, rest = super().parse_chunk_size(unreader, data)
        if size > LARGEST_CHUNK:
            raise http_errors.InvalidChunkSize(b"")
        self.left -= size
        if self.left < 0:
            from werkzeug.exceptions import RequestEntityTooLarge

            raise RequestEntityTooLarge()
        return size, rest


@functools.lru_cache(maxsize=8)
def socket_kind(listener: socket.socket) -> tuple[int, int, int]:
    """Return the family, type and protocol of the connections `listener` accepts, as numbers:
    once for each listener (the socket's properties make enums of them, a microsecond a
    connection)."""
    return int(listener.family), int(listener.type), listener.proto


@functools.lru_cache(maxsize=8)  # the deadlines' own, made once
def timeval(seconds: float | None) -> bytes:
    """Return `seconds` as SO_RCVTIMEO and SO_SNDTIMEO take them: None is no bound, anything else
    a microsecond at least (0 would be no bound)."""
    microseconds = 0 if seconds is None else max(round(seconds * 1_000_000), 1)
    return struct.pack("ll", *divmod(microseconds, 1_000_000))


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


def empty(req: "Request") -> bool:
    """Whether the request says it has no body (a GET's, or Content-Length: 0)."""
    return (
        req.body is not None
        and isinstance(req.body.reader, LengthReader)
        and not req.body.reader.length
    )


def nothing_left_to_read(req: "Request", client: socket.socket) -> bool:
    """Whether closing now can cut no answer: the body was read to its end (none, for a GET), and
    the kernel holds nothing more from the client, so that closing sends no reset; on plain TCP.
    An unread body, a chunked one, broken framing, bytes sent after the request and TLS (whose
    socket cannot peek) keep the graceful end."""
    body = req.body
    if body is None or isinstance(client, ssl.SSLSocket):
        return False
    reader = body.reader
    if not (isinstance(reader, LengthReader) and reader.length == 0):
        return False
    # Non-blocking: with a timeout set, Python would wait for something to read first.
    client.setblocking(False)
    try:
        waiting = client.recv(1, socket.MSG_PEEK)
    except OSError:
        return True  # nothing waiting (EAGAIN), or the connection is gone already
    # b"": the client has closed its side, and nothing more can come.
    return waiting == b""
