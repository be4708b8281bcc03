"""Staging settings, loaded when ANIMAL_STORE_ENV=staging.

Secrets come from the environment; a missing one stops the boot instead of falling back to SQLite.
"""

import os

DATABASE_URL = os.environ["DATABASE_URL"]
