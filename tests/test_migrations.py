"""The shipped migrations build exactly the schema the models describe, on SQLite and PostgreSQL."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from animal_store.extensions import db


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
