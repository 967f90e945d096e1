"""A JSON column's stored value, read and written past the sealing (tasks/sealed.py), in SQL that PostgreSQL
and SQLite both take: what a test needs to see a value sealed, or to tamper with it."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import connection


def read(table: str, column: str, pks: Sequence[int]) -> dict[int, str]:
    """Each row's stored text, by id."""
    placeholders = ", ".join(["%s"] * len(pks))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, CAST({column} AS TEXT) FROM {table} WHERE id IN ({placeholders})", list(pks))
        return dict(cursor.fetchall())


def write(table: str, column: str, pk: int, stored: str) -> None:
    """Store `stored` (JSON text) as the row's value, as it is: nothing sealed, nothing checked."""
    value = "CAST(%s AS jsonb)" if connection.vendor == "postgresql" else "%s"
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {column} = {value} WHERE id = %s", [stored, pk])
