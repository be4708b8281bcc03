"""The floor: a bare Flask app answering with the service's recorded responses.

The design fixes Flask, so the least a request can cost the service is what Flask itself costs
under the same gunicorn: this app sends the bytes the ceiling sends (benchmarks/ceiling.py, the
same CEILING_RESPONSES file) after the same in-memory key check, in one before_request hook, from
one view per operation. http_bench.py measures the service against both.
"""

import hashlib
import json
import os

from flask import Flask, Response, abort, request

with open(os.environ["CEILING_RESPONSES"], encoding="utf-8") as recorded_file:
    RECORDED = json.load(recorded_file)
KEY_HASHES = {bytes.fromhex(key_hash) for key_hash in RECORDED["key_hashes"]}
ANSWERS = {
    name: (int(answer["status"].split()[0]), answer["headers"], answer["body"].encode())
    for name, answer in RECORDED["answers"].items()
}

app = Flask(__name__)


@app.before_request
def check_key():
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or hashlib.sha256(key.encode()).digest() not in KEY_HASHES:
        abort(401)


def answer(name):
    status, headers, body = ANSWERS[name]
    return Response(body, status, headers)


@app.get("/v1/pets")
def list_pets():
    return answer("list")


@app.post("/v1/pets")
def create_pet():
    request.get_data()
    return answer("create")


@app.get("/v1/pets/<pet_id>")
def get_pet(pet_id):
    return answer("get")
