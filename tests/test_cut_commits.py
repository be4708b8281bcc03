"""A connection the server cuts right after a COMMIT completed, as a PostgreSQL stopped by a
switchover may (tests/test_patroni.py met it through PgBouncer): the creation is committed but
its answer lost, so the service answers the JSON 503, never a 500, and the client's retry with
the same Idempotency-Key gets the first answer.

The cut is made by a proxy of the test's own between the app and the test's PostgreSQL: it
passes every message, and once armed sends the next COMMIT's completion followed by the FATAL a
shutting-down server sends, then closes both connections.
"""

import contextlib
import socket
import struct
import threading

import pytest

from animal_store.access import last_used
from animal_store.extensions import db

FATAL = b"SFATAL\0VFATAL\0C57P01\0Mterminating connection due to administrator command\0\0"


class CommitCutter:
    """A loopback TCP proxy to PostgreSQL's `port` that can cut the next COMMIT's connection."""

    def __init__(self, host, port):
        self.server = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.cut = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.server)
            self.sockets += [client, server]
            threading.Thread(target=self.to_server, args=(client, server), daemon=True).start()
            threading.Thread(target=self.to_client, args=(server, client), daemon=True).start()

    def to_server(self, client, server):
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                server.sendall(data)
        self.close(client, server)

    def to_client(self, server, client):
        """Pass the server's messages (a type byte, then their length) on, whole."""
        buffer = b""
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                buffer += data
                passed = b""
                while len(buffer) >= 5 and len(buffer) > struct.unpack("!I", buffer[1:5])[0]:
                    length = struct.unpack("!I", buffer[1:5])[0]
                    message, buffer = buffer[: 1 + length], buffer[1 + length :]
                    if message[:1] + message[5:] == b"CCOMMIT\0" and self.armed.is_set():
                        self.armed.clear()
                        fatal = b"E" + struct.pack("!I", 4 + len(FATAL)) + FATAL
                        client.sendall(passed + message + fatal)
                        self.cut.set()
                        self.close(client, server)
                        return
                    passed += message
                client.sendall(passed)
        self.close(client, server)

    @staticmethod
    def close(*sockets):
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)

    def stop(self):
        self.listener.close()
        for each in self.sockets:
            each.close()


@pytest.fixture
def cutter(app):
    """The proxy in front of the test's PostgreSQL; yields it and the URL through it."""
    with app.app_context():
        url = db.engine.url
    if url.get_backend_name() != "postgresql":
        pytest.skip("cuts a PostgreSQL connection: SQLite has none")
    proxy = CommitCutter(url.host or "127.0.0.1", url.port or 5432)
    yield proxy, url.set(port=proxy.port).update_query_dict({"sslmode": "disable"})
    proxy.stop()


def test_a_connection_cut_after_its_commit_is_a_503_and_the_retry_replays(
    make_app, api_key, count_pets, cutter
):
    cutter, through = cutter
    app = make_app(DATABASE_URL=through.render_as_string(hide_password=False))
    client = app.test_client()
    headers = {"Authorization": f"Bearer {api_key}", "Idempotency-Key": "order-1"}
    body = {"name": "Rex", "categoryId": 1}
    # The key's last-used time written now (by the worker's writer), so the creation's COMMIT is
    # the next one.
    assert client.get("/v1/pets", headers=headers).status_code == 200
    assert last_used.flush(timeout=10)

    cutter.armed.set()
    cut = client.post("/v1/pets", json=body, headers=headers)
    assert cutter.cut.is_set()
    assert (cut.status_code, cut.headers["Retry-After"]) == (503, "5")
    assert cut.get_json()["code"] == "service_unavailable"
    assert count_pets() == 1  # committed: only its answer was lost

    retried = client.post("/v1/pets", json=body, headers=headers)
    assert retried.status_code == 201
    assert retried.headers["Idempotent-Replayed"] == "true"
    assert count_pets() == 1
