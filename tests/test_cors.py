"""Browsers: CORS for the origins CORS_ORIGINS lists and for no other, and OPTIONS without a key."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from conftest import IN_SQLITE_PASS
from declared import LAYER_PATHS, sample_url

pytestmark = IN_SQLITE_PASS

SHOP = "https://shop.example"
ASKED_HEADERS = "authorization, content-type, idempotency-key, if-none-match"
PREFLIGHT = {
    "Origin": SHOP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": ASKED_HEADERS,
}
# Methods a page never needs listed: OPTIONS is the preflight itself, and HEAD, CORS-safelisted,
# is allowed whatever the answer lists (the Fetch standard).
NOT_LISTED = {"HEAD", "OPTIONS"}
EXPOSED = {
    "Location",
    "Link",
    "ETag",
    "Deprecation",
    "Sunset",
    "Retry-After",
    "RateLimit-Limit",
    "RateLimit-Remaining",
    "RateLimit-Reset",
    "X-Request-ID",
}


@pytest.fixture
def app(make_app):
    return make_app(CORS_ORIGINS=[SHOP])


def cors_headers(response):
    return {name for name, _ in response.headers.items() if name.startswith("Access-Control-")}


def header_set(value):
    return {item.strip().lower() for item in value.split(",")}


@pytest.mark.parametrize(
    ("rule", "method"),
    [(rule, method) for rule, methods in LAYER_PATHS.items() for method in methods - NOT_LISTED],
)
def test_preflight_from_a_listed_origin_says_what_the_page_may_send(client, rule, method):
    # A browser may send each method the path's routes declare.
    response = client.options(
        sample_url(rule), headers=PREFLIGHT | {"Access-Control-Request-Method": method}
    )
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Origin"] == SHOP
    assert header_set(response.headers["Access-Control-Allow-Headers"]) == header_set(ASKED_HEADERS)
    assert method.lower() in header_set(response.headers["Access-Control-Allow-Methods"])
    assert response.headers["Access-Control-Max-Age"] == "600"
    assert "Origin" in response.headers["Vary"]


def test_answer_to_a_listed_origin_exposes_the_api_headers(client, auth, make_pet):
    make_pet()
    response = client.get("/v1/pets", headers=auth | {"Origin": SHOP})
    assert response.status_code == 200
    assert response.headers["Access-Control-Allow-Origin"] == SHOP
    exposed = header_set(response.headers["Access-Control-Expose-Headers"])
    assert {name.lower() for name in EXPOSED} <= exposed
    assert "Origin" in response.headers["Vary"]


@pytest.mark.parametrize("origin", ["https://evil.example", "http://shop.example", None])
def test_other_origins_get_no_cors_headers(client, auth, origin):
    origin_header = {"Origin": origin} if origin else {}
    asking = {name: value for name, value in PREFLIGHT.items() if name != "Origin"}
    preflight = client.options("/v1/pets", headers=asking | origin_header)
    answer = client.get("/v1/pets", headers=auth | origin_header)
    assert answer.status_code == 200
    assert cors_headers(preflight) | cors_headers(answer) == set()


def test_no_origin_is_listed_by_default(make_app, auth):
    client = make_app().test_client()
    assert cors_headers(client.options("/v1/pets", headers=PREFLIGHT)) == set()
    assert cors_headers(client.get("/v1/pets", headers=auth | {"Origin": SHOP})) == set()


@pytest.mark.parametrize("rule", LAYER_PATHS)
def test_options_needs_no_key_and_answers_allow(client, rule):
    response = client.options(sample_url(rule))
    assert response.status_code == 204
    assert header_set(response.headers["Allow"]) == {method.lower() for method in LAYER_PATHS[rule]}
    assert response.data == b""
    assert "WWW-Authenticate" not in response.headers
    assert "RateLimit-Limit" not in response.headers


@pytest.fixture
def shop_page():
    """A shop's page on an origin of its own: another loopback port than the API's."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>shop</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


# What the shop's page runs: a creation (which needs a preflight: a key, JSON, an
# Idempotency-Key) and a list, reading the headers the API exposes.
SHOP_SCRIPT = """async ([api, key]) => {
    try {
        const created = await fetch(api + "/v1/pets", {
            method: "POST",
            headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json",
                      "Idempotency-Key": "browser-1"},
            body: JSON.stringify({name: "Rex", categoryId: 1}),
        });
        const listed = await fetch(api + "/v1/pets", {headers: {"Authorization": "Bearer " + key}});
        return {status: created.status, location: created.headers.get("Location"),
                requestId: listed.headers.get("X-Request-ID"), pets: await listed.json()};
    } catch (error) {
        return {error: error.name};
    }
}"""


def test_browser_page_on_a_listed_origin_uses_the_api(start_gunicorn, api_key, shop_page, page):
    server = start_gunicorn(workers=1, env={"ANIMAL_STORE_CORS_ORIGINS": json.dumps([shop_page])})
    page.goto(shop_page)
    result = page.evaluate(SHOP_SCRIPT, [server.url, api_key])
    assert result["status"] == 201
    assert result["location"] == f"{server.url}/v1/pets/1"
    assert result["requestId"]
    assert [pet["name"] for pet in result["pets"]] == ["Rex"]


def test_browser_page_on_an_unlisted_origin_is_refused(
    start_gunicorn, api_key, shop_page, page, count_pets
):
    server = start_gunicorn(
        workers=1, env={"ANIMAL_STORE_CORS_ORIGINS": '["https://shop.example"]'}
    )
    page.goto(shop_page)
    assert page.evaluate(SHOP_SCRIPT, [server.url, api_key]) == {"error": "TypeError"}
    # The preflight failed, so the creation was never sent.
    assert count_pets() == 0


def test_preflight_through_gunicorn(start_gunicorn):
    server = start_gunicorn(workers=1, env={"ANIMAL_STORE_CORS_ORIGINS": json.dumps([SHOP])})
    response = requests.options(f"{server.url}/v1/pets", headers=PREFLIGHT, timeout=10)
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Origin"] == SHOP
