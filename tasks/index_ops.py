"""Migration operations for indexes alone, shared by the apps' migrations."""

from __future__ import annotations

from django.db import migrations


def drop_fk_index(alter: migrations.AlterField, *, table: str, column: str, index: str
                  ) -> migrations.SeparateDatabaseAndState:
    """`alter` (a foreign key made db_index=False) for the models' state; in the database, only its index dropped.

    Django carries out such an AlterField by dropping the foreign key constraint and adding it back, which
    checks every row again under an exclusive lock of both tables (and rebuilds the whole table on SQLite),
    while workers and the web server wait. Dropping the index takes the lock only for the drop itself."""
    return migrations.SeparateDatabaseAndState(
        state_operations=[alter],
        database_operations=[migrations.RunSQL(
            f'DROP INDEX IF EXISTS "{index}"',
            reverse_sql=f'CREATE INDEX IF NOT EXISTS "{index}" ON "{table}" ("{column}")')],
    )
