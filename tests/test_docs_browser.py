"""The docs page in a real browser: headless Chromium against a live gunicorn, with nothing loaded
from another host, and "try it out" working with a key."""

import re
from urllib.parse import urlsplit

from playwright.sync_api import expect


def test_docs_page_shows_the_operations_and_tries_one_offline(
    start_gunicorn, api_key, make_pet, page
):
    make_pet(name="Rex")
    server = start_gunicorn(workers=1)

    page.goto(f"{server.url}/v1/docs")
    operations = page.locator(".opblock")
    expect(operations).to_have_count(3, timeout=20_000)
    assert {
        (block.locator(".opblock-summary-method").inner_text(), block.get_attribute("id"))
        for block in operations.all()
    } == {
        ("GET", "operations-pets-listPets"),
        ("POST", "operations-pets-createPet"),
        ("GET", "operations-pets-getPet"),
    }
    expect(page.locator("#operations-pets-getPet")).to_have_class(re.compile("opblock-deprecated"))

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
