"""Staging settings, loaded when ANIMAL_STORE_ENV=staging.

Secrets come from the environment; a missing one stops the boot instead of falling back to SQLite.
"""

import os

DATABASE_URL = os.environ["DATABASE_URL"]

# nginx on this machine (config/nginx.conf, docs/deploy.rst) is the proxy whose X-Forwarded-*
# headers count; list the address of any other proxy in front of this instance.
TRUSTED_PROXIES = ["127.0.0.1", "::1"]

# Rate limits counted in the machine's Redis, shared by every worker (docs/deploy.rst installs
# it); instances on several machines name one Redis they all reach instead, with
# ANIMAL_STORE_RATELIMIT_STORAGE_URI, which overrides this as it does every setting.
RATELIMIT_STORAGE_URI = "redis://127.0.0.1:6379/0"
