"""The ceiling: a raw WSGI callable answering with the service's recorded responses.

http_bench.py records the service's list page, getPet and 201 answers (body and headers) into the
JSON file named by CEILING_RESPONSES, and the API key hashes it accepts; this app sends those
bytes back after the same in-memory key check the service's cache makes (SHA-256 of the bearer
key, looked up in a set). No framework, no database: what gunicorn can do at best.
"""

import hashlib
import json
import os

with open(os.environ["CEILING_RESPONSES"], encoding="utf-8") as recorded_file:
    RECORDED = json.load(recorded_file)
KEY_HASHES = {bytes.fromhex(key_hash) for key_hash in RECORDED["key_hashes"]}
ANSWERS = {
    name: (answer["status"], answer["headers"], answer["body"].encode())
    for name, answer in RECORDED["answers"].items()
}
UNAUTHORIZED = ("401 UNAUTHORIZED", [("Content-Type", "application/json")], b'{"status":401}')


def app(environ, start_response):
    scheme, _, key = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() != "bearer" or hashlib.sha256(key.encode()).digest() not in KEY_HASHES:
        status, headers, body = UNAUTHORIZED
    elif environ["REQUEST_METHOD"] == "POST":
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        status, headers, body = ANSWERS["create"]
    elif environ["PATH_INFO"] == "/v1/pets":
        status, headers, body = ANSWERS["list"]
    else:
        status, headers, body = ANSWERS["get"]
    start_response(status, [*headers, ("Content-Length", str(len(body)))])
    return [body]
