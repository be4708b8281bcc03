"""X-Forwarded-* headers count only from the proxies TRUSTED_PROXIES names; by default from none."""

import json

import pytest
import requests
from conftest import IN_SQLITE_PASS

pytestmark = IN_SQLITE_PASS

# What a client reaching gunicorn directly could send to choose the URLs and address the app uses.
SPOOFED = {
    "X-Forwarded-Host": "evil.example",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Port": "443",
    "X-Forwarded-For": "203.0.113.9",
}


def first_exchange(server, api_key):
    """Create two animals with the spoofing headers; return the Location, next Link and log line."""
    auth = {"Authorization": f"Bearer {api_key}"} | SPOOFED
    created = requests.post(
        f"{server.url}/v1/pets", json={"name": "Rex", "categoryId": 1}, headers=auth, timeout=10
    )
    requests.post(
        f"{server.url}/v1/pets", json={"name": "Tom", "categoryId": 1}, headers=auth, timeout=10
    )
    page = requests.get(f"{server.url}/v1/pets?limit=1", headers=auth, timeout=10)
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    addresses = {line["remote_addr"] for line in lines if line.get("path") == "/v1/pets"}
    return created.headers["Location"], page.links["next"]["url"], addresses


def test_forwarded_headers_are_ignored_without_a_trusted_proxy(start_gunicorn, api_key):
    server = start_gunicorn(workers=1)
    location, next_page, addresses = first_exchange(server, api_key)
    assert location == f"{server.url}/v1/pets/1"
    assert next_page.startswith(f"{server.url}/v1/pets?")
    assert addresses == {"127.0.0.1"}


@pytest.mark.parametrize("environment", ["production", None])
def test_forwarded_headers_count_from_a_trusted_proxy(
    start_gunicorn, api_key, environment, request
):
    # The production settings name nginx on this machine; an operator may name a proxy too.
    env = (
        request.getfixturevalue("production_env")
        if environment
        else {"ANIMAL_STORE_TRUSTED_PROXIES": '["127.0.0.1"]'}
    )
    server = start_gunicorn(workers=1, env=env)
    location, next_page, addresses = first_exchange(server, api_key)
    assert location == "https://evil.example/v1/pets/1"
    assert next_page.startswith("https://evil.example/v1/pets?")
    assert addresses == {"203.0.113.9"}


def test_a_peer_not_listed_is_not_trusted(make_app, auth):
    client = make_app(TRUSTED_PROXIES=["192.0.2.1"]).test_client()
    created = client.post(
        "/v1/pets",
        json={"name": "Rex", "categoryId": 1},
        headers=auth | SPOOFED,
        environ_base={"REMOTE_ADDR": "198.51.100.4"},
    )
    assert created.headers["Location"] == "http://localhost/v1/pets/1"
