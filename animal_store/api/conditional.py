"""Conditional GET: an ETag on a view's 200 answers, and 304 when If-None-Match matches it."""

import hashlib
import threading
from collections.abc import Callable
from functools import wraps
from typing import Any

from cachetools import LRUCache
from flask import Response, make_response, request

from animal_store.api import Header, declare_parameter, declare_response
from animal_store.current import REQUEST

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


class Tags:
    """The tags of answers sent lately, by body and Link, least recently used dropped first.

    A kept answer (answers.py) is the same bytes object each time, whose hash Python computes
    once: its tag is then looked up, not computed again. At most ENTRIES tags, of bodies up to
    LARGEST bytes, so what it holds besides the kept answers stays small.
    """

    ENTRIES = 1024
    LARGEST = 16 * 1024

    def __init__(self) -> None:
        self.entries: LRUCache[tuple[bytes, str], str] = LRUCache(self.ENTRIES)
        self.lock = threading.Lock()  # the development server serves on threads

    def get(self, body: bytes, link: str) -> str:
        key = (body, link)
        with self.lock:
            tag = self.entries.get(key)
        if tag is None:
            tag = entity_tag(body, link)
            if len(body) <= self.LARGEST:
                with self.lock:
                    self.entries[key] = tag
        return tag


def entity_tag(body: bytes, link: str) -> str:
    # A hash of everything a client keeps from the response: the body and, for a list page, the
    # link to the next page (which appears when animals are added after a full last page). Any
    # change to either changes the tag, so a client never keeps a stale copy.
    digest = hashlib.blake2b(digest_size=16)
    digest.update(body)
    digest.update(b"\nLink: " + link.encode())
    return digest.hexdigest()


TAGS = Tags()


def conditional(view: Callable[..., Any]) -> Callable[..., Response]:
    """Tag the view's 200 answers with a strong ETag and answer a matching If-None-Match with 304.

    If-None-Match uses the weak comparison (RFC 9110 13.1.2): a listed tag matches with or
    without its W/ prefix, and `*` matches any current representation. Werkzeug's pieces, but not
    its Response.make_conditional: that adds a Date header, which the server writes itself
    (gunicorn drops an app's, the development server would send both).
    """

    @wraps(view)
    def tagged_view(*args: Any, **kwargs: Any) -> Response:
        answer = view(*args, **kwargs)
        response = answer if isinstance(answer, Response) else make_response(answer)
        if response.status_code != 200:
            return response
        tag = TAGS.get(response.get_data(), response.headers.get("Link", ""))
        # Added, with the quotes set_etag would give it: no answer has one before this.
        response.headers.add("ETag", f'"{tag}"')
        # Parsed only when sent; most requests send none.
        if (
            "HTTP_IF_NONE_MATCH" in REQUEST._get_current_object().environ
            and request.if_none_match.contains_weak(tag)
        ):
            # Werkzeug sends a 304 without body or Content-Type; ETag and the other headers stay.
            response.status_code = 304
            response.set_data(b"")
        return response

    declare_parameter(tagged_view, IF_NONE_MATCH)
    declare_response(tagged_view, 200, {"headers": {"ETag": ETAG}})
    not_modified = {"description": "Unchanged since the `If-None-Match` tag: no body."}
    declare_response(tagged_view, 304, {**not_modified, "headers": {"ETag": ETAG}})
    return tagged_view
