"""The shipped migrations build exactly the schema the models describe, on SQLite and PostgreSQL."""

import hashlib
from datetime import UTC, datetime, timedelta

import orjson
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from animal_store.extensions import db
from animal_store.idempotency import target_hash


def test_migrations_match_the_models(app):
    with app.app_context(), db.engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), db.metadata)
    assert differences == []


def test_ids_are_64_bit(app, client, auth):
    # The largest int64 must fit as an id on both backends (SQLite rowid, PostgreSQL BIGINT).
    with app.app_context():
        if db.engine.dialect.name == "postgresql":
            statement = "ALTER SEQUENCE pets_id_seq RESTART WITH 9223372036854775807"
        else:  # SQLite hands out the next rowid after the largest one.
            statement = (
                "INSERT INTO pets (id, name, category_id) VALUES (9223372036854775806, 'x', 1)"
            )
        db.session.execute(db.text(statement))
        db.session.commit()
    response = client.post("/v1/pets", json={"name": "Bigger", "categoryId": 1}, headers=auth)
    assert response.get_json()["id"] == 2**63 - 1
    assert client.get(f"/v1/pets/{2**63 - 1}", headers=auth).get_json()["name"] == "Bigger"
    # Walks reach it too (on PostgreSQL, the last id taken is the largest there is).
    listed = client.get("/v1/pets", headers=auth)
    assert listed.get_json()[-1]["id"] == 2**63 - 1


def test_downgrade_and_upgrade_round_trip(app):
    from flask_migrate import downgrade, upgrade

    with app.app_context():
        downgrade(revision="base")
        assert "pets" not in db.inspect(db.engine).get_table_names()
        upgrade()
        assert {"pets", "api_keys"} <= set(db.inspect(db.engine).get_table_names())


def test_keyset_and_idempotency_migration_goes_down_and_up(app):
    from flask_migrate import downgrade, upgrade

    def schema():
        inspector = db.inspect(db.engine)
        return (
            "idempotency_records" in inspector.get_table_names(),
            "ix_pets_status_id" in {index["name"] for index in inspector.get_indexes("pets")},
        )

    with app.app_context():
        assert schema() == (True, True)
        downgrade(revision="0001")
        assert schema() == (False, False)
        upgrade()
        assert schema() == (True, True)


def stored_record(api_key_id, key, body):
    """An answered idempotency record as the tables before migration 0007 held it."""
    now = datetime.now(UTC)
    return {
        "api_key_id": api_key_id,
        "key": key,
        "fingerprint": hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).digest(),
        "claim": "0" * 32,
        "claimed_at": now,
        "expires_at": now + timedelta(days=1),
        "response_status": 201,
        "response_body": orjson.dumps({"id": 41, **body}),
        "response_location": "http://localhost/v1/pets/41",
    }


def test_idempotency_records_stored_before_0007_still_replay(app, client, auth):
    from flask_migrate import downgrade, upgrade

    body = {"name": "Rex", "categoryId": 1}
    with app.app_context():
        downgrade(revision="0006")
        records = sa.Table("idempotency_records", sa.MetaData(), autoload_with=db.engine)
        assert "target_hash" not in records.c
        with db.engine.begin() as connection:
            api_key_id = connection.scalar(sa.text("SELECT id FROM api_keys"))
            connection.execute(records.insert().values(stored_record(api_key_id, "old", body)))
        upgrade()
    headers = auth | {"Idempotency-Key": "old"}
    again = client.post("/v1/pets", json=body, headers=headers)
    assert (again.status_code, again.headers["Idempotent-Replayed"]) == (201, "true")
    assert again.get_json() == {"id": 41, "name": "Rex", "categoryId": 1}
    reused = client.post("/v1/pets", json=body | {"name": "Tom"}, headers=headers)
    assert reused.get_json()["code"] == "idempotency_key_reused"


def test_0007_goes_down_keeping_the_pets_records_only(app, client, auth):
    from flask_migrate import downgrade, upgrade

    body, headers = {"name": "Rex", "categoryId": 1}, auth | {"Idempotency-Key": "both"}
    assert client.post("/v1/pets", json=body, headers=headers).status_code == 201
    with app.app_context():
        # The same key used on another path: a record of its own, which 0006 cannot hold.
        with db.engine.begin() as connection:
            connection.execute(
                sa.text(
                    "INSERT INTO idempotency_records (api_key_id, target_hash, key, fingerprint,"
                    " claim, claimed_at, expires_at) SELECT api_key_id, :other, key, fingerprint,"
                    " claim, claimed_at, expires_at FROM idempotency_records"
                ),
                {"other": target_hash("POST", "/v1/elsewhere")},
            )
            assert connection.scalar(sa.text("SELECT count(*) FROM idempotency_records")) == 2
        downgrade(revision="0006")
        with db.engine.connect() as connection:
            assert connection.scalar(sa.text("SELECT count(*) FROM idempotency_records")) == 1
        upgrade()
    again = client.post("/v1/pets", json=body, headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true"


def test_0005_to_0008_take_over_a_populated_table(app, client, auth, make_pet):
    """From an identity to version 3 (0005 and on), and from version 2 to 3 (0008): the rows keep
    their ids, every walk shows them, and creations go on after them, on either engine."""
    from flask_migrate import downgrade, upgrade

    def insert(connection):
        return connection.scalar(
            sa.text("INSERT INTO pets (name, category_id) VALUES ('Old', 1) RETURNING id")
        )

    def ids():
        response = client.get("/v1/pets?limit=100", headers=auth)
        assert response.status_code == 200
        return [pet["id"] for pet in response.get_json()]

    made = [make_pet(), make_pet(), make_pet()]
    with app.app_context():
        downgrade(revision="0004")
        with db.engine.begin() as connection:
            made.append(insert(connection))
        upgrade()
    # No id taken since 0005 set where the sequence goes on: the rows up to it are settled.
    assert ids() == made == [1, 2, 3, 4]
    with app.app_context():
        downgrade(revision="0007")
        with db.engine.begin() as connection:
            made.append(insert(connection))
        upgrade()
        assert "order_xid" not in {c["name"] for c in db.inspect(db.engine).get_columns("pets")}
    assert ids() == made == [1, 2, 3, 4, 5]
    created = client.post("/v1/pets", json={"name": "New", "categoryId": 1}, headers=auth)
    assert created.get_json()["id"] == 6
    assert ids() == [*made, 6]
