"""Many writers at once: 4 gunicorn workers, 16 threads of one client each creating 100 animals
with one key. Every request is answered 201 (the default rate limit lets a bulk client through)
and exactly those 1,600 animals are stored, on SQLite and on PostgreSQL."""

from concurrent.futures import ThreadPoolExecutor

import requests
import sqlalchemy as sa

from animal_store.data.models import PET_STATUSES, Pet
from animal_store.extensions import db

CLIENTS = 16
CREATES_PER_CLIENT = 100


def create_many(url, key, client_number):
    """Create this client's animals; return (status, sent body, answered body) for each."""
    results = []
    with requests.Session() as session:
        session.headers["Authorization"] = f"Bearer {key}"
        for n in range(CREATES_PER_CLIENT):
            body = {
                "name": f"client{client_number}-pet{n}",
                "categoryId": client_number * 1000 + n,
                "status": PET_STATUSES[n % len(PET_STATUSES)],
            }
            response = session.post(url, json=body, timeout=30)
            results.append((response.status_code, body, response.json()))
    return results


def test_many_writers_get_201_and_exactly_their_animals(app, api_key, redis_url, start_gunicorn):
    # One bulk client: 16 threads with one key, the default RATE_LIMIT counted where the workers
    # share it (Redis, as the production settings do). The default never throttles it.
    server = start_gunicorn(workers=4, env={"ANIMAL_STORE_RATELIMIT_STORAGE_URI": redis_url})
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        answers = [
            result
            for results in pool.map(
                create_many,
                [server.url + "/v1/pets"] * CLIENTS,
                [api_key] * CLIENTS,
                range(CLIENTS),
            )
            for result in results
        ]

    statuses = [status for status, _, _ in answers]
    assert statuses == [201] * CLIENTS * CREATES_PER_CLIENT, {
        s: statuses.count(s) for s in set(statuses)
    }
    for _, sent, answered in answers:
        assert answered == {"id": answered["id"], **sent}
    answered_rows = {(a["id"], a["name"], a["categoryId"], a["status"]) for _, _, a in answers}
    assert len(answered_rows) == CLIENTS * CREATES_PER_CLIENT  # every id distinct
    with app.app_context():
        rows = db.session.execute(sa.select(Pet.id, Pet.name, Pet.category_id, Pet.status))
        stored_rows = {tuple(row) for row in rows}
    assert stored_rows == answered_rows
    assert "database is locked" not in server.log()
