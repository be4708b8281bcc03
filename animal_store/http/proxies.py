"""Forwarded headers, honoured only from the proxies a deployment names (TRUSTED_PROXIES)."""

from collections.abc import Iterable
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from flask import Flask
from werkzeug.middleware.proxy_fix import ProxyFix

from animal_store.extensions import settings


class TrustedProxyFix:
    """Werkzeug's ProxyFix for requests whose peer is a trusted proxy; the rest are left as sent.

    Otherwise a client that reaches gunicorn directly would choose the host and scheme of the
    URLs the app builds (Location, Link) and the address that the logs and the rate limit of
    requests without a key see.
    """

    def __init__(self, wsgi_app: WSGIApplication, proxies: Iterable[str], hops: int) -> None:
        self.wsgi_app = wsgi_app
        self.proxies = frozenset(proxies)
        # X-Forwarded-Prefix is not trusted: nginx does not set it, so only a client could.
        self.fixed = ProxyFix(wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        trusted = environ.get("REMOTE_ADDR") in self.proxies
        return (self.fixed if trusted else self.wsgi_app)(environ, start_response)


def trust_proxies(app: Flask) -> None:
    """Honour X-Forwarded-* from TRUSTED_PROXIES, TRUSTED_PROXY_HOPS deep; none by default."""
    config = settings(app)
    if config.TRUSTED_PROXIES:
        # Flask's hints make wsgi_app a method, though its docs wrap it in middleware so (and
        # `unused-ignore`: a release of Flask whose hints allow it changes nothing).
        app.wsgi_app = TrustedProxyFix(  # type: ignore[method-assign, unused-ignore]
            app.wsgi_app, config.TRUSTED_PROXIES, config.TRUSTED_PROXY_HOPS
        )
