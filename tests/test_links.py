"""The links the service writes (Location, Link) are on the deployment's own address, never on a
Host a client made up; a Host Werkzeug cannot read is a malformed request."""

import json
import socket

import pytest

PUBLIC_URL = "https://api.animal-store.example"
# Hosts a client may name: any of them, and the links stay on PUBLIC_URL.
# (Those with IPv6 or a port of five digits are read by Werkzeug, past http/host.py's quick look.)
CLIENT_HOSTS = [
    "evil.example",
    "evil.example:8443",
    "localhost",
    "127.0.0.1:5000",
    "[::1]:8000",
    "evil.example:65535",
]
# Hosts Werkzeug cannot read, which it would take for no host at all.
MALFORMED_HOSTS = [
    "a@evil.example",
    "bad/host",
    "evil.example:99999",
    "evil.example:65536",
    "evil.example:0",
    "evil.example:port",
    " ",
]


@pytest.fixture
def public_client(make_app):
    return make_app(PUBLIC_URL=PUBLIC_URL).test_client()


@pytest.mark.parametrize("host", CLIENT_HOSTS)
def test_links_are_on_the_public_url_whatever_the_host(public_client, auth, host):
    headers = {**auth, "Host": host}
    for n in range(2):
        created = public_client.post(
            "/v1/pets", json={"name": "Rex", "categoryId": n}, headers=headers
        )
        assert created.headers["Location"] == f"{PUBLIC_URL}/v1/pets/{created.json['id']}"
    page = public_client.get("/v1/pets?limit=1", headers=headers)
    assert page.headers["Link"].startswith(f"<{PUBLIC_URL}/v1/pets?limit=1&cursor=")


def test_without_a_public_url_links_are_on_the_host_reached(client, auth):
    created = client.post(
        "/v1/pets", json={"name": "Rex", "categoryId": 1}, headers={**auth, "Host": "a.example"}
    )
    assert created.headers["Location"] == f"http://a.example/v1/pets/{created.json['id']}"


@pytest.mark.parametrize("public_url", [None, PUBLIC_URL])
@pytest.mark.parametrize("host", MALFORMED_HOSTS)
def test_a_malformed_host_is_a_400_error_object(make_app, api_key, public_url, host):
    client = make_app(PUBLIC_URL=public_url).test_client()
    for headers in ({}, {"Authorization": f"Bearer {api_key}"}):  # before the key is asked for
        response = client.post(
            "/v1/pets", json={"name": "Rex", "categoryId": 1}, headers={**headers, "Host": host}
        )
        assert response.status_code == 400
        assert response.json == {
            "code": "bad_request",
            "message": "The request is malformed.",
            "status": 400,
        }
        assert "Location" not in response.headers


def test_an_http_1_0_request_without_host_has_the_servers_own_name(start_gunicorn, api_key):
    """Straight to gunicorn, as a client on its address could: the link names gunicorn's own
    address, never an empty host (https:///v1/pets...)."""
    gunicorn = start_gunicorn(workers=1)
    body = json.dumps({"name": "Rex", "categoryId": 1}).encode()
    request = (
        "POST /v1/pets HTTP/1.0\r\n"
        f"Authorization: Bearer {api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", gunicorn.port), timeout=10) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 201 ")
    location = f"Location: http://127.0.0.1:{gunicorn.port}/v1/pets/{json.loads(content)['id']}"
    assert location.encode() in head.split(b"\r\n")
