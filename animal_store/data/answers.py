"""Answers reused instead of recomputed: the bodies that can never change.

An animal never changes once created: the contract has no update and no delete. Nor does a full
page of the list, one after which another animal follows: a page shows only animals that are
settled, with no lower id still to come, on both engines (keyset.py), so an animal added later
always comes after that next one. A page cut short before an animal not yet settled is not
kept. Their JSON bodies are kept per worker, least recently used dropped first, up to
ANSWER_CACHE_BYTES (0: none kept); a hit skips the database and marshmallow.

Only bodies are kept, with a full page the query of its next page's URL (the same for every
client), never anything made from one request's headers: the next-page link (the request's own
scheme and host before that query), the ETag (a hash of body and link) and every other header
are made for each request. The last page of a list, which grows, and 404s, whose animal may
come, are never kept.
"""

import threading
from collections.abc import Hashable
from typing import NamedTuple

from cachetools import LRUCache
from flask import Response, current_app

from animal_store.current import APP
from animal_store.extensions import settings

# Where each process keeps its answers: in the app's extensions, so forgetting them is removing
# them (failover.py).
KEPT = "animal_store_answers"


class Kept(NamedTuple):
    """A kept answer: a tuple, as cheap to make and unpack as one, with its parts named."""

    body: bytes
    # A full page's: the query of its next page's URL; an animal's: None.
    next_page_query: str | None = None


class Answers:
    def __init__(self, size_bytes: int) -> None:
        self.enabled = size_bytes > 0
        self.entries: LRUCache[Hashable, Kept] = LRUCache(
            maxsize=max(size_bytes, 1), getsizeof=lambda entry: len(entry[0])
        )
        # The development server serves each request on a thread of its own.
        self.lock = threading.Lock()

    def get(self, key: Hashable) -> Kept | None:
        with self.lock:
            return self.entries.get(key)

    def put(self, key: Hashable, body: bytes, next_page_query: str | None = None) -> None:
        if self.enabled and len(body) <= self.entries.maxsize:
            with self.lock:
                self.entries[key] = Kept(body, next_page_query)


def answers() -> Answers:
    """This app's answers, made on first use so each process (worker) has its own."""
    kept: Answers | None = APP._get_current_object().extensions.get(KEPT)
    if kept is None:
        kept = current_app.extensions.setdefault(
            KEPT, Answers(settings(current_app).ANSWER_CACHE_BYTES)
        )
    return kept


def json_response(body: bytes) -> Response:
    # The type as it is sent: no mimetype to look a charset up for.
    return APP._get_current_object().response_class(body, content_type="application/json")
