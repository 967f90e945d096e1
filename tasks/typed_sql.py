"""Statements that write many rows at once with values Django prepared, where the ORM would send one
statement a row (update()) or spend more CPU building the statement than the database spends running it
(bulk_update()'s CASE per column and row). PostgreSQL only: its callers keep the ORM's way for SQLite.

A value is a query parameter with a cast: in a VALUES list or a SELECT list PostgreSQL would read a quoted
literal as text. A text is cast to text, not varchar(n), which would cut a longer one where the assignment
to the column refuses it, as a plain UPDATE or INSERT does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from django.db import connection
from django.db.models import CharField, Field, Model

from tasks import prepared
from tasks.prepared import database


@cache
def typed_param(field: Field) -> str:
    """A placeholder for one value of `field`, typed as its column. Cached: a column's type does not change while
    the process runs, and a step's commit asks for a placeholder per value it writes (db_type reads the
    `connection` proxy twice each time: about a fortieth of a no-op step's CPU)."""
    return f"CAST(%s AS {'text' if isinstance(field, CharField) else field.db_type(connection)})"


def set_items(model: type[Model], values: dict[str, Any]) -> tuple[list[str], list[Any]] | None:
    """`values` as an UPDATE's SET items, a typed parameter each, and their parameters, prepared as update()
    prepares them (a sealed field's value comes as sealed.Sealed); None when update() would write one as SQL
    of its own (an expression, a model instance, a field's own placeholder), which is the ORM's to compile."""
    db = database()
    qn = db.ops.quote_name
    items, params = [], []
    for name, value in values.items():
        field = model._meta.get_field(name)
        if (hasattr(value, "resolve_expression") or hasattr(value, "prepare_database_save")
                or hasattr(field, "get_placeholder")):
            return None
        prepared = field.get_db_prep_save(value, db)
        if hasattr(prepared, "as_sql"):
            return None
        items.append(f"{qn(field.column)} = {typed_param(field)}")
        params.append(prepared)
    return items, params


def insert_params(model: type[Model], fields: Sequence[Field], rows: Sequence[Model]) -> list[Any]:
    """The parameters of an INSERT of `rows` into `fields`, a row after another, prepared as save() prepares
    them (pre_save, then get_db_prep_save; sealed fields seal). A value that is an expression is refused."""
    db = database()
    params: list[Any] = []
    for row in rows:
        for field in fields:
            value = field.pre_save(row, add=True)
            if hasattr(value, "resolve_expression"):
                raise ValueError(f"{model.__name__}.{field.name}: an expression, not a value")
            params.append(field.get_db_prep_save(value, db))
    return params


def update_each(model: type[Model], rows: Sequence[tuple[Any, dict[str, Any]]]) -> int:
    """Give each row (by primary key) its own values in one UPDATE ... FROM (VALUES ...) (PostgreSQL); returns
    the rows changed. Every row sets the same fields; values are prepared as update() prepares them (a sealed
    field's value comes as sealed.Sealed, as update() requires). Sent numbered (prepared.rowcount): a batch's
    statement has hundreds of parameters."""
    if not rows:
        return 0
    names = list(rows[0][1])
    pk = model._meta.pk
    fields = [pk, *(model._meta.get_field(name) for name in names)]
    db = database()
    params: list[Any] = []
    for key, values in rows:
        if list(values) != names:
            raise ValueError(f"update_each: every row sets {names}, not {list(values)}")
        params.append(pk.get_db_prep_value(key, db))
        params.extend(field.get_db_prep_save(values[field.name], db) for field in fields[1:])
    qn = db.ops.quote_name
    table, columns = qn(model._meta.db_table), [qn(field.column) for field in fields]
    row = f"({', '.join(typed_param(field) for field in fields)})"
    sql = (f"UPDATE {table} SET {', '.join(f'{column} = v.{column}' for column in columns[1:])} "
           f"FROM (VALUES {', '.join([row] * len(rows))}) AS v({', '.join(columns)}) "
           f"WHERE {table}.{columns[0]} = v.{columns[0]}")
    return prepared.rowcount(sql, params)
