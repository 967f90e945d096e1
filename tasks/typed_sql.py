"""Statements that write many rows at once with values Django prepared, where the ORM would send one
statement a row (update()) or spend more CPU building the statement than the database spends running it
(bulk_update()'s CASE per column and row). PostgreSQL only: its callers keep the ORM's way for SQLite.

A value is a query parameter with a cast: in a VALUES list or a SELECT list PostgreSQL would read a quoted
literal as text. A text is cast to text, not varchar(n), which would cut a longer one where the assignment
to the column refuses it, as a plain UPDATE or INSERT does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.models import CharField, Field, Model


def typed_param(field: Field) -> str:
    """A placeholder for one value of `field`, typed as its column."""
    return f"CAST(%s AS {'text' if isinstance(field, CharField) else field.db_type(connection)})"


def update_each(model: type[Model], rows: Sequence[tuple[Any, dict[str, Any]]]) -> int:
    """Give each row (by primary key) its own values in one UPDATE ... FROM (VALUES ...); returns the rows
    changed. Every row sets the same fields; values are prepared as update() prepares them (a sealed field's
    value comes as sealed.Sealed, as update() requires)."""
    if not rows:
        return 0
    names = list(rows[0][1])
    pk = model._meta.pk
    fields = [pk, *(model._meta.get_field(name) for name in names)]
    params: list[Any] = []
    for key, values in rows:
        if list(values) != names:
            raise ValueError(f"update_each: every row sets {names}, not {list(values)}")
        params.append(pk.get_db_prep_value(key, connection))
        params.extend(field.get_db_prep_save(values[field.name], connection) for field in fields[1:])
    qn = connection.ops.quote_name
    table, columns = qn(model._meta.db_table), [qn(field.column) for field in fields]
    row = f"({', '.join(typed_param(field) for field in fields)})"
    sql = (f"UPDATE {table} SET {', '.join(f'{column} = v.{column}' for column in columns[1:])} "
           f"FROM (VALUES {', '.join([row] * len(rows))}) AS v({', '.join(columns)}) "
           f"WHERE {table}.{columns[0]} = v.{columns[0]}")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount
