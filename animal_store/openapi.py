"""The OpenAPI document and its docs page, served under /v1 without an API key.

flask-smorest builds the document (api/document.py) from what each view declares and from the
marshmallow schemas the views load and dump with, so the document cannot drift from the service.
It is turned into JSON once per app, on first use, and then served as bytes.
"""

from pathlib import Path

import click
import flask_swagger_ui
import orjson
from flask import Blueprint, Response, current_app, send_from_directory, url_for
from flask.cli import with_appcontext
from flask_smorest import Api

from animal_store.api import public

DOCS_DIR = Path(__file__).parent / "docs"
# Swagger UI's built files, shipped inside the flask-swagger-ui package (only its files are used).
SWAGGER_UI_DIR = Path(flask_swagger_ui.__file__).parent / "dist"
# Only the docs page's own files and Swagger UI may load: nothing from another host, no inline
# script. Swagger UI sets inline styles and uses data: images.
DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)

# A plain Flask blueprint: served under the layer, but not an operation of the document.
bp = Blueprint("openapi", __name__)


@bp.get("/openapi.json")
@public
def openapi_json() -> Response:
    """Serve the OpenAPI document."""
    return current_app.response_class(openapi_document(), mimetype="application/json")


@bp.get("/docs")
@public
def docs() -> Response:
    """Serve the interactive docs page: Swagger UI on the document, nothing from another host."""
    response = send_docs_file(DOCS_DIR, "docs.html")
    response.headers["Content-Security-Policy"] = DOCS_CSP
    return response


@bp.get("/docs/")
@public
def docs_with_slash() -> Response:
    """Send /v1/docs/ to the page, whose links are relative to /v1/docs."""
    # A bare redirect: Werkzeug's redirect() would add an HTML page that says the same.
    response = current_app.response_class(status=308, headers={"Location": url_for(".docs")})
    del response.headers["Content-Type"]  # no content, no type
    return response


@bp.get("/docs/<path:filename>")
@public
def docs_file(filename: str) -> Response:
    """Serve the docs page's script and style, and Swagger UI's files."""
    directory = DOCS_DIR if (DOCS_DIR / filename).is_file() else SWAGGER_UI_DIR
    return send_docs_file(directory, filename)


def send_docs_file(directory: Path, filename: str) -> Response:
    """Send a file of `directory` with Werkzeug's conditional answers (ETag, Last-Modified, 304,
    ranges), and without the Date header they add: the server writes its own. gunicorn drops an
    app's; the development server (`flask run`, quickstart) sent both."""
    response = send_from_directory(directory, filename)
    response.headers.remove("Date")
    return response


def openapi_document() -> bytes:
    """Return the app's OpenAPI document as JSON, made on first use."""
    cache: dict[str, bytes] = current_app.extensions.setdefault("openapi", {})
    if "document" not in cache:
        api: Api = current_app.extensions["flask-smorest"]["apis"][""]["ext_obj"]
        document = api.spec.to_dict()
        # flask-smorest lists the layer's blueprint ("v1") as a tag, while the operations carry
        # their resource's ("pets"): the document lists the tags its operations have, so the
        # docs page shows no empty group.
        document["tags"] = [
            {"name": tag}
            for tag in dict.fromkeys(
                tag
                for path in document["paths"].values()
                for operation in path.values()
                if isinstance(operation, dict)
                for tag in operation.get("tags", ())
            )
        ]
        # "openapi" first, as people and tools expect to read it.
        cache["document"] = orjson.dumps({"openapi": document.pop("openapi"), **document})
    return cache["document"]


@click.command("openapi")
@with_appcontext
def print_openapi() -> None:
    """Print the OpenAPI document (JSON), for generating clients."""
    click.echo(orjson.dumps(orjson.loads(openapi_document()), option=orjson.OPT_INDENT_2))
