"""Every migration's PostgreSQL SQL passes squawk, the linter for PostgreSQL migrations: a
statement that holds a lock on a busy table for a scan or an index build, or that takes away what
running code uses, fails here before it ships.

The SQL is what `flask --app animal_store db upgrade --sql <down>:<up>` prints, one migration at
a time: offline mode only renders it, so no database is needed, on either pass of the suite.
squawk does not see inside DO blocks and function bodies (PL/pgSQL).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from flask_migrate import upgrade

from animal_store import MIGRATIONS_DIR, create_app

# Offline mode takes the dialect from the URL and never connects (nothing answers on port 1).
OFFLINE_URL = "postgresql://offline@127.0.0.1:1/offline"
# The venv's own (pip install -e '.[test]' brings squawk-cli), else one on PATH.
SQUAWK = shutil.which("squawk", path=Path(sys.executable).parent) or shutil.which("squawk")
pytestmark = pytest.mark.skipif(SQUAWK is None, reason="squawk is not installed (squawk-cli)")

# Off for every migration. squawk refuses a name that is no rule of its own (exit 2, "invalid
# rule name"), so a typo here fails every test instead of excluding nothing.
EXCLUDED = {
    "require-statement-timeout": "`flask db upgrade` runs on the app's engine, which sets "
    "statement_timeout to DATABASE_STATEMENT_TIMEOUT (always above 0) at connect "
    "(settings.engine_options); behind PgBouncer the role has it (docs/deploy.rst)",
    "require-lock-timeout": "that statement_timeout bounds the wait for a lock too (PostgreSQL's "
    "docs: a lock_timeout as long is pointless), so a migration queued for a lock holds up the "
    "requests behind it no longer than a request's own statement may run",
    "prefer-text-field": "the models declare their strings' lengths (String(n)), and the "
    "migrations must build what the models say (test_migrations.py); a later change of length "
    "is the one that locks, and changing-column-type flags it",
}
# Findings in released migrations, which must not change: accepted for that migration alone, so
# that a new one is held to the rule (an index on an existing table: op.create_index(...,
# postgresql_concurrently=True, if_not_exists=True) in op.get_context().autocommit_block()).
RELEASED = {
    "0002": {
        "require-concurrent-index-creation": "ix_pets_status_id blocked writes to pets while "
        "it was built",
        "prefer-bigint-over-smallint": "response_status holds an HTTP status, 100 to 599",
    },
    "0004": {
        "disallowed-unique-constraint": "api_keys has a row per API key, and the column was "
        "added just before, all NULL",
        "constraint-missing-not-valid": "the same UNIQUE constraint, which cannot be NOT VALID",
    },
    "0006": {
        "ban-drop-function": "every instance is stopped while it runs (docs/operations.rst, "
        "Database): no code that calls keyset_pending_from is running",
    },
    "0007": {
        "adding-not-nullable-field": "idempotency_records is scanned under an ACCESS EXCLUSIVE "
        "lock, after the UPDATE of every row, in the same transaction",
        "disallowed-unique-constraint": "the new key's index is built under that lock",
        "constraint-missing-not-valid": "the same UNIQUE constraint, which cannot be NOT VALID",
        "ban-drop-constraint": "replaced in the same transaction by the constraint of the same "
        "name with target_hash: the change this migration is for",
    },
    "0008": {
        "ban-drop-function": "every instance is stopped while it runs (docs/operations.rst, "
        "Database): no code that calls keyset_take_id or keyset_in_flight is running",
        "ban-drop-column": "order_xid too: only the code from before 0008 wrote it",
    },
}
MIGRATIONS = list(reversed(list(ScriptDirectory(MIGRATIONS_DIR).walk_revisions())))


def bytea_literal(_type, _dialect):
    # SQLAlchemy renders a bytes literal as text, which fails on 0007's SHA-256 (not UTF-8): the
    # offline SQL of 0007 cannot be made without PostgreSQL's hex literal.
    return lambda value: f"'\\x{value.hex()}'::bytea"


@pytest.mark.parametrize("migration", MIGRATIONS, ids=lambda migration: migration.revision)
def test_migration_passes_squawk(migration, monkeypatch, capsys):
    monkeypatch.setattr(sa.LargeBinary, "literal_processor", bytea_literal)
    with create_app({"DATABASE_URL": OFFLINE_URL}).app_context():
        upgrade(revision=f"{migration.down_revision or 'base'}:{migration.revision}", sql=True)
    sql = capsys.readouterr().out
    excluded = EXCLUDED | RELEASED.get(migration.revision, {})
    result = subprocess.run(
        [
            SQUAWK,
            "--reporter=gcc",
            f"--stdin-filepath={migration.revision}.sql",
            f"--exclude={','.join(excluded)}",
        ],
        input=sql,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # The SQL numbered from 0, as squawk's gcc reporter counts lines.
    numbered = "\n".join(f"{n:4} {line}" for n, line in enumerate(sql.splitlines()))
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n{numbered}"
