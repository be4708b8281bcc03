"""The docs page in a real browser: headless Chromium against a live gunicorn, with nothing loaded
from another host, and "try it out" working with a key."""

from urllib.parse import urlsplit

import requests
from conftest import IN_SQLITE_PASS
from playwright.sync_api import expect

pytestmark = IN_SQLITE_PASS


def test_docs_page_shows_the_operations_and_tries_one_offline(
    start_gunicorn, api_key, make_pet, page
):
    make_pet(name="Rex")
    server = start_gunicorn(workers=1)

    # Swagger UI shows each operation of the served document as a block, by its tag and id, with
    # its method, and marked when deprecated.
    document = requests.get(f"{server.url}/v1/openapi.json", timeout=10).json()
    documented = {
        f"operations-{operation['tags'][0]}-{operation['operationId']}": (
            method.upper(),
            operation.get("deprecated", False),
        )
        for path in document["paths"].values()
        for method, operation in path.items()
        if method != "parameters"
    }
    page.goto(f"{server.url}/v1/docs")
    operations = page.locator(".opblock")
    expect(operations).to_have_count(len(documented), timeout=20_000)
    shown = {
        block.get_attribute("id"): (
            block.locator(".opblock-summary-method").inner_text(),
            "opblock-deprecated" in block.get_attribute("class").split(),
        )
        for block in operations.all()
    }
    assert shown == documented

    page.locator("button.authorize").first.click()
    page.locator(".modal-ux input").fill(api_key)
    page.locator(".modal-ux button.authorize").click()
    page.locator(".modal-ux button.btn-done").click()

    page.locator("#operations-pets-listPets .opblock-summary").click()
    page.locator("#operations-pets-listPets button.try-out__btn").click()
    page.locator("#operations-pets-listPets button.execute").click()
    live_response = page.locator("#operations-pets-listPets .live-responses-table .response")
    expect(live_response.locator(".response-col_status")).to_have_text("200", timeout=20_000)
    expect(live_response.locator(".response-col_description")).to_contain_text('"name": "Rex"')

    server_host = urlsplit(server.url).netloc
    assert {urlsplit(url).netloc for url in page.requested_urls} == {server_host}
    assert f"{server.url}/v1/pets?limit=20" in page.requested_urls
    assert page.console_errors == []
