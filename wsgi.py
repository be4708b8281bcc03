"""The WSGI entry point for gunicorn: `gunicorn -c config/gunicorn.conf.py wsgi:app`."""

from animal_store import create_app

app = create_app()
