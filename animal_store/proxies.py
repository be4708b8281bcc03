"""Forwarded headers, honoured only from the proxies a deployment names (TRUSTED_PROXIES)."""

from werkzeug.middleware.proxy_fix import ProxyFix


class TrustedProxyFix:
    """Werkzeug's ProxyFix for requests whose peer is a trusted proxy; the rest are left as sent.

    Otherwise a client that reaches gunicorn directly would choose the host and scheme of the
    URLs the app builds (Location, Link) and the address that the logs and the rate limit of
    requests without a key see.
    """

    def __init__(self, wsgi_app, proxies, hops: int):
        self.wsgi_app = wsgi_app
        self.proxies = frozenset(proxies)
        # X-Forwarded-Prefix is not trusted: nginx does not set it, so only a client could.
        self.fixed = ProxyFix(wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops)

    def __call__(self, environ, start_response):
        trusted = environ.get("REMOTE_ADDR") in self.proxies
        return (self.fixed if trusted else self.wsgi_app)(environ, start_response)


def trust_proxies(app) -> None:
    """Honour X-Forwarded-* from TRUSTED_PROXIES, TRUSTED_PROXY_HOPS deep; none by default."""
    if app.config["TRUSTED_PROXIES"]:
        app.wsgi_app = TrustedProxyFix(
            app.wsgi_app, app.config["TRUSTED_PROXIES"], app.config["TRUSTED_PROXY_HOPS"]
        )
