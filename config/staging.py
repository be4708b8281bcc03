"""Staging settings, loaded when ANIMAL_STORE_ENV=staging.

Secrets come from the environment; a missing one stops the boot instead of falling back to SQLite.
"""

import os

DATABASE_URL = os.environ["DATABASE_URL"]

# nginx on this machine (config/nginx.conf, docs/deploy.rst) is the proxy whose X-Forwarded-*
# headers count; list the address of any other proxy in front of this instance.
TRUSTED_PROXIES = ["127.0.0.1", "::1"]
