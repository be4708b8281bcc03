"""The parser of what views take (webargs'), with the API's answers and a memo of queries."""

import threading

from cachetools import LRUCache
from flask import request
from webargs.flaskparser import FlaskParser

from animal_store import errors
from animal_store.body import json_object_body


class ArgumentsParser(FlaskParser):
    """webargs' parser with the API's answers: 400 validation_error, and the JSON body rules."""

    DEFAULT_VALIDATION_STATUS = 400
    LOCATION_NAMES = {"query": "query parameter", "json": "request body", "headers": "header"}
    # Query strings whose arguments a worker remembers, least recently used dropped first.
    KNOWN_QUERIES = 1024

    def __init__(self):
        super().__init__()
        self.queries = LRUCache(self.KNOWN_QUERIES)
        # The development server serves each request on a thread of its own.
        self.lock = threading.Lock()

    def parse(self, argmap, req=None, *, location=None, **kwargs):
        """Parse as webargs does; a query's arguments, a function of its text alone, only the
        first time a worker sees that text (a walk's pages and a client's polls repeat theirs)."""
        if location != "query":
            return super().parse(argmap, req, location=location, **kwargs)
        key = (id(argmap), (req or request).query_string)  # a schema lives as long as its view
        with self.lock:
            parsed = self.queries.get(key)
        if parsed is None:  # not remembered, or refused: a 400 is never remembered
            parsed = super().parse(argmap, req, location=location, **kwargs)
            with self.lock:
                self.queries[key] = parsed
        return dict(parsed)  # the view's own copy

    def load_querystring(self, req, schema):
        # The query as Werkzeug parsed it, whose get() is a parameter's first value: what a
        # schema of single-valued fields reads, without webargs' per-request proxy around it.
        return req.args

    def load_json(self, req, schema):
        return json_object_body()

    def handle_error(self, error, req, schema, *, error_status_code, error_headers):
        # webargs files the messages under the location they come from.
        ((location, messages),) = error.messages.items()
        raise errors.VALIDATION_ERROR(
            errors=messages,
            where=self.LOCATION_NAMES[location],
            fields=", ".join(sorted(messages)),
        )
