"""The WSGI entry point for gunicorn: `gunicorn -c config/gunicorn.conf.py wsgi:app`."""

from werkzeug.middleware.proxy_fix import ProxyFix

from animal_store import create_app

app = create_app()

# nginx (config/nginx.conf) sets X-Forwarded-For/-Proto/-Host/-Port, one hop each: trusting exactly
# that many hops makes remote_addr the client's and the URLs the app builds (Location, Link)
# public https ones, while a client cannot spoof them. X-Forwarded-Prefix is not trusted: nginx
# does not set it (the app lives at the root of its host), so only a client could.
hops = app.config["TRUSTED_PROXY_HOPS"]
if hops:
    app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops)
