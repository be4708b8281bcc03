"""Headers every response carries so browsers and caches do not misuse what the API sends."""

from collections.abc import Callable

from flask import Response, request


def security_headers(private: Callable[[], bool]) -> Callable[[Response], None]:
    """Return the step adding the headers to an answer; `private()` tells the answers meant for
    one key holder."""

    def add_security_headers(response: Response) -> None:
        # Browsers must not guess a type: an error echoing input is JSON, never HTML or script.
        # Added: nothing else sets it, and a set would search the headers for it first.
        response.headers.add("X-Content-Type-Options", "nosniff")
        if private() or "HTTP_AUTHORIZATION" in request.environ:
            # No shared or disk cache may keep an answer meant for one key's holder. One with an
            # ETag may stay in the client's own cache, revalidated each time (If-None-Match).
            if "ETag" in response.headers:
                response.headers["Cache-Control"] = "private, no-cache"
            else:
                response.headers["Cache-Control"] = "no-store"

    return add_security_headers
