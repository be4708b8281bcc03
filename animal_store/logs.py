"""Structured logs: JSON lines on stdout, one per request at least, each with its request ID."""

import logging
import sys
import time
from datetime import UTC, datetime

import orjson
from flask import g, request
from flask.logging import default_handler

from animal_store.request_id import current_request_id

# The app's access log: one line per request, at INFO ("animal_store" is the app's own logger).
REQUESTS = logging.getLogger("animal_store.request")


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object on one line; gunicorn's logconfig uses it too."""

    def format(self, record):
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = current_request_id()
        if request_id:
            line["request_id"] = request_id
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class StdoutHandler(logging.StreamHandler):
    """Write to sys.stdout as it is at each record, so redirected output receives the lines."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):
        pass


def configure_logging(app) -> None:
    """Send the app's log records to stdout as JSON lines at LOG_LEVEL."""
    logger = logging.getLogger(app.name)
    logger.removeHandler(default_handler)
    if not any(isinstance(handler, StdoutHandler) for handler in logger.handlers):
        handler = StdoutHandler()
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
    logger.setLevel(app.config["LOG_LEVEL"])
    # The one handler above writes each line; the root logger (gunicorn's) would write it twice.
    logger.propagate = False


def start_timer() -> None:
    g.request_started = time.perf_counter()


def log_request(response) -> None:
    """Write the request's line, the app's access log (at INFO)."""
    if REQUESTS.isEnabledFor(logging.INFO):
        REQUESTS.info("request", extra={"fields": request_fields(response)})


def request_fields(response) -> dict:
    started = g.get("request_started")
    api_key = g.get("api_key")
    fields = {
        "method": request.method,
        "path": request.path,
        "status": response.status_code,
        "duration_ms": round((time.perf_counter() - started) * 1000, 2) if started else None,
        "remote_addr": request.remote_addr,
        # Which key, by its name and visible prefix; never the key or the Authorization header.
        "api_key_name": api_key.name if api_key else None,
        "api_key_prefix": g.get("api_key_prefix"),
    }
    if request.query_string:
        fields["query"] = request.query_string.decode("latin-1")
    return fields
