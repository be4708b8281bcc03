"""The deployment's own address, on which the service writes its links (Location, Link)."""

from functools import lru_cache
from urllib.parse import quote

from animal_store.current import APP, REQUEST
from animal_store.extensions import settings

# What a URL path may hold unescaped (WHATWG's path segment set, and % for escapes already made).
URL_PATH_SAFE = "!$&'()*+,/:;=@%"


def absolute_url(path: str) -> str:
    """Return the app's `path` (its root path included) as an absolute URL on PUBLIC_URL, or,
    where none is set, on the scheme and host this request reached (nginx's, forwarded)."""
    origin = settings(APP._get_current_object()).PUBLIC_URL
    if origin is None:
        served = REQUEST._get_current_object()
        # Never empty: Werkzeug reads a missing Host as the server's own name, and a malformed
        # one was refused 400 before any view (http/host.py).
        origin = f"{served.scheme}://{served.host}"
    return origin + quoted_path(path)


@lru_cache(maxsize=64)
def quoted_path(path: str) -> str:
    # As request.base_url quotes it, without its round trip through an IRI (a link is a URI)
    # and at a fraction of its cost: a list's path is the same for every page.
    return quote(path, safe=URL_PATH_SAFE)
