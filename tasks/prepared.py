"""The few statements a worker sends at every step (and at every task's end), as statements
PostgreSQL plans once per connection instead of at every call.

Django binds every parameter on the client and prepares nothing (its psycopg backend sets
prepare_threshold to None, so that transaction-mode connection poolers work). For the claim
most of the server's time is planning (0.7 ms of 0.85 ms here); prepared, it is a lookup.
Longhaul's workers hold persistent connections of their own, so a prepared statement lives
as long as the connection that made it; a pooler that hands a connection to another client
between transactions needs protocol-level prepared statements (PgBouncer 1.21 and later).

Statements prepared here name their columns rather than select `*`, so a column added by a
migration leaves their results as they were. A migration that changes the type of a column
they return makes PostgreSQL refuse the plan it kept: `fetchone` then starts a new connection.

They are written with Django's %s placeholders and sent with PostgreSQL's own ($1, $2, ...), numbered
once per statement (`numbered`): psycopg reads the text of a statement for its placeholders at every
execute once it is longer than 4,096 bytes or has more than 50 parameters, and the claim (6.8 kB) and
a step's commit are.

A batch's statement, whose text changes with its rows' count (a VALUES row each), is sent the same way but
not prepared (`rowcount`): prepared, it would be kept once per count. Through Django's cursor, psycopg read
a recorder's UPDATE of 50 calls (460 parameters) for its placeholders at every execute: 1.5 to 3.1 ms of
CPU a statement here, against 0.44 ms numbered once.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, TypeVar

import psycopg
from django.db import DEFAULT_DB_ALIAS, NotSupportedError, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper

# Preparing is on for a statement of ours alone, for the time of its execute: with the connection's threshold
# left at None, psycopg neither counts nor keeps Django's own statements (the text of each, values included).
_ONLY_WHEN_ASKED = 2**31 - 1
_RESULT_CHANGED = "cached plan must not change result type"
T = TypeVar("T")


class _NumberedCursor(psycopg.RawCursor):
    """Server-side binding, unprepared; the statement is sent as `numbered` writes it, which psycopg's raw
    cursor passes on as it is."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> _NumberedCursor:
        return super().execute(_numbered_for(query, params), params, prepare=False, binary=binary)


class _PreparingCursor(psycopg.RawCursor):
    """Server-side binding (a prepared statement needs it), prepared at its first execute; the statement is
    sent as `numbered` writes it, which psycopg's raw cursor passes on as it is."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> _PreparingCursor:
        sql = _numbered_for(query, params)
        threshold, self.connection.prepare_threshold = self.connection.prepare_threshold, _ONLY_WHEN_ASKED
        try:
            return super().execute(sql, params, prepare=True, binary=binary)
        finally:
            self.connection.prepare_threshold = threshold


def _numbered_for(query: str, params: Any) -> str:
    """`query` as `numbered` writes it, once its placeholders are as many as `params`: psycopg's raw cursor counts
    nothing, and PostgreSQL takes typed values past the last one."""
    sql, placeholders = numbered(query)
    if len(params or ()) != placeholders:
        raise psycopg.ProgrammingError(f"the statement has {placeholders} placeholders but "
                                       f"{len(params or ())} parameters were passed")
    return sql


_PLACEHOLDER = re.compile(r"%(.)", re.DOTALL)


# The claims, the probe, the shapes of a step's commit (its rows' counts), and of a recorder's batch (its calls' and
# its tasks' counts, 50 at most each).
@lru_cache(maxsize=256)
def numbered(sql: str) -> tuple[str, int]:
    """`sql`, written with Django's %s placeholders (and %% for a %), with PostgreSQL's $1, $2, ... instead;
    and how many placeholders it has."""
    count = itertools.count(1)

    def placeholder(found: re.Match[str]) -> str:
        if found[1] == "s":
            return f"${next(count)}"
        if found[1] == "%":
            return "%"
        raise ValueError(f"a prepared statement takes %s placeholders alone, not %{found[1]}: {sql[:200]}")

    text = _PLACEHOLDER.sub(placeholder, sql)
    return text, next(count) - 1


class _LoggedCursor(CursorDebugWrapper):
    """Django's query log (DEBUG, tests) reads a statement's text back from psycopg, which has none for a
    prepared one: it logs the statement with its parameters bound, as Django's own cursors send it."""

    def execute(self, sql: str, params: Any = None) -> Any:
        with self.debug_sql(self.db.ops.compose_sql(sql, params), params):
            return CursorWrapper.execute(self, sql, params)


def fetchone(sql: str, params: Sequence[Any]) -> tuple | None:
    """The first row of `sql`, prepared (PostgreSQL only)."""
    return _prepared(_fetchone, sql, params)


def rows(sql: str, params: Sequence[Any]) -> list[tuple]:
    """Every row of `sql`, prepared (PostgreSQL only): for a statement whose text does not change with its values
    (a list of them passed as one array, `= ANY(%s)`); `fetchall` sends one whose text does, unprepared. psycopg
    keeps one prepared statement a set of parameter types: an array of ids is smallint[], integer[] or bigint[] by
    its largest, so at most three."""
    return _prepared(_rows, sql, params)


def _prepared(read: Callable[[str, Sequence[Any]], T], sql: str, params: Sequence[Any]) -> T:
    try:
        return read(sql, params)
    except NotSupportedError as exc:
        if _RESULT_CHANGED not in str(exc) or connection.in_atomic_block:
            raise  # (in a transaction, its rollback drops the connection's prepared statements)
        connection.close()  # the next connection prepares the statement again, with the new column type
        return read(sql, params)


def execute(sql: str, params: Sequence[Any]) -> None:
    """`sql` (a statement that returns no rows, so no column type of its result can change under it), prepared
    (PostgreSQL only)."""
    with _cursor() as cursor:
        cursor.execute(sql, params)


def rowcount(sql: str, params: Sequence[Any]) -> int:
    """`sql` numbered and bound on the server, not prepared (PostgreSQL only); the rows it changed."""
    with _cursor(_NumberedCursor) as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def fetchall(sql: str, params: Sequence[Any]) -> list[tuple]:
    """`sql` numbered and bound on the server, not prepared (PostgreSQL only); its rows."""
    with _cursor(_NumberedCursor) as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _fetchone(sql: str, params: Sequence[Any]) -> tuple | None:
    with _cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


def _rows(sql: str, params: Sequence[Any]) -> list[tuple]:
    with _cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def database() -> BaseDatabaseWrapper:
    """The default database itself, for preparing many values or statements: `connection` is a proxy that looks
    the database up (in a context-local) at every attribute read, and a field reads it once or more for each value
    it prepares (a research step's commit prepares about a hundred; the look-ups were a tenth of its worker's
    time)."""
    return connections[DEFAULT_DB_ALIAS]


def _cursor(kind: type[psycopg.RawCursor] = _PreparingCursor) -> CursorWrapper:
    """Made as Django makes its own (BaseDatabaseWrapper._cursor): the health check a job's start asked for
    (CONN_HEALTH_CHECKS), then through Django's cursor wrapper, so the query log, execute wrappers and error
    translation see these statements as any other."""
    db = database()
    assert db.vendor == "postgresql", "numbered placeholders are PostgreSQL's"
    db.close_if_health_check_failed()
    db.ensure_connection()
    db.validate_thread_sharing()
    with db.wrap_database_errors:
        raw = kind(db.connection)
    return _LoggedCursor(raw, db) if db.queries_logged else db.make_cursor(raw)
