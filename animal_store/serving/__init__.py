"""What runs the app under gunicorn: the store's worker class, and what gunicorn's master does
for the store (the release and settings checked at boot, the metrics' process). Above the factory,
as it runs the app: nothing imports it, gunicorn loads it by name (config/gunicorn.conf.py)."""
