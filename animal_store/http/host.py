"""The Host header: one Werkzeug cannot read is a malformed request."""

from flask import request

from animal_store import errors


def refuse_malformed_host() -> None:
    """Answer 400 to a request whose Host Werkzeug finds malformed (`a@evil.example`, `bad/host`),
    as RFC 9112 (3.2) asks: Werkzeug reads it as no host at all, which a link would carry as
    `https:///v1/...`. A request without Host (HTTP/1.0) has the server's own name instead."""
    if not request.host:
        raise errors.BAD_REQUEST()
