"""The Host header: one Werkzeug cannot read is a malformed request."""

import re

from animal_store import errors
from animal_store.current import REQUEST

# A Host every Werkzeug reads as it is (its own pattern, werkzeug.sansio.utils, takes more: IPv6,
# and ports up to 65535): a name or an IPv4 address, and a port below 10000.
PLAIN_HOST = re.compile(r"[A-Za-z0-9.-]+(?::[1-9][0-9]{0,3})?", re.ASCII)


def refuse_malformed_host() -> None:
    """Answer 400 to a request whose Host Werkzeug finds malformed (`a@evil.example`, `bad/host`),
    as RFC 9112 (3.2) asks: Werkzeug reads it as no host at all, which a link would carry as
    `https:///v1/...`. A request without Host (HTTP/1.0) has the server's own name instead."""
    served = REQUEST._get_current_object()
    sent = served.environ.get("HTTP_HOST")
    # (A plain one is told at a third of the cost of Werkzeug's reading, on every request.)
    if (sent is None or PLAIN_HOST.fullmatch(sent) is None) and not served.host:
        raise errors.BAD_REQUEST()
