"""Version-controlled defaults; config/<env>.py, the environment and test_config override them."""

from datetime import UTC, datetime

# None means the embedded default: a SQLite file in the instance folder.
DATABASE_URL = None
SQLITE_FILENAME = "animal_store.sqlite3"

# Requests whose body is larger are answered 413 (config/nginx.conf allows the same).
MAX_CONTENT_LENGTH = 64 * 1024

# Seconds SQLite waits for another writer before giving up with "database is locked".
SQLITE_BUSY_TIMEOUT = 5.0

SQLALCHEMY_ENGINE_OPTIONS = {"pool_pre_ping": True}

# getPet is deprecated since v1.0.0 shipped and is removed on the spec's sunset date;
# listPets with the status filter replaces it. Drives the Deprecation, Sunset and Link headers.
GET_PET_DEPRECATION = {
    "since": datetime(2026, 11, 22, tzinfo=UTC),
    "sunset": datetime(2030, 12, 5, tzinfo=UTC),
    "successor": "/v1/pets",
}

# Each API key's last-used time is written at most this often, not on every request.
KEY_LAST_USED_RESOLUTION = 60

# The servers listed in the OpenAPI document, each ending in /v1. The spec leaves the addresses
# open: a deployment sets its own (ANIMAL_STORE_OPENAPI_SERVERS='[{"url": ...}]').
OPENAPI_SERVERS = [
    {"url": "https://api.animal-store.example/v1", "description": "Production"},
    {"url": "https://staging.api.animal-store.example/v1", "description": "Staging"},
]
