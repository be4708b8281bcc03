"""Conditional GET: an ETag on a view's 200 answers, and 304 when If-None-Match matches it."""

import hashlib
from functools import wraps

from flask import make_response, request

from animal_store.api import Header, declare_parameter, declare_response

ETAG = Header(
    "ETag",
    "A strong tag of this answer; send it back in `If-None-Match` to get 304 while the answer "
    "is unchanged.",
    {"type": "string"},
    required=True,
)
IF_NONE_MATCH = {
    "in": "header",
    "name": "If-None-Match",
    "required": False,
    "schema": {"type": "string"},
    "description": "ETags of answers the client holds (RFC 9110); a match gets 304 with no body.",
}


def entity_tag(response) -> str:
    # A hash of everything a client keeps from the response: the body and, for a list page, the
    # link to the next page (which appears when animals are added after a full last page). Any
    # change to either changes the tag, so a client never keeps a stale copy.
    digest = hashlib.blake2b(digest_size=16)
    digest.update(response.get_data())
    digest.update(b"\nLink: " + response.headers.get("Link", "").encode())
    return digest.hexdigest()


def conditional(view):
    """Tag the view's 200 answers with a strong ETag and answer a matching If-None-Match with 304.

    If-None-Match uses the weak comparison (RFC 9110 13.1.2): a listed tag matches with or
    without its W/ prefix, and `*` matches any current representation. Werkzeug's pieces, but not
    its Response.make_conditional: that adds a Date header, and gunicorn writes one of its own, so
    the answer would carry two.
    """

    @wraps(view)
    def tagged_view(*args, **kwargs):
        response = make_response(view(*args, **kwargs))
        if response.status_code != 200:
            return response
        tag = entity_tag(response)
        response.set_etag(tag)
        if request.if_none_match.contains_weak(tag):
            # Werkzeug sends a 304 without body or Content-Type; ETag and the other headers stay.
            response.status_code = 304
            response.set_data(b"")
        return response

    declare_parameter(tagged_view, IF_NONE_MATCH)
    declare_response(tagged_view, 200, {"headers": {"ETag": ETAG}})
    not_modified = {"description": "Unchanged since the `If-None-Match` tag: no body."}
    declare_response(tagged_view, 304, {**not_modified, "headers": {"ETag": ETAG}})
    return tagged_view
