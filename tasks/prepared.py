"""A cursor for the few statements a worker sends at every step, which PostgreSQL then plans
once per connection instead of at every call.

Django binds every parameter on the client and prepares nothing (its psycopg backend sets
prepare_threshold to None, so that transaction-mode connection poolers work). For the claim
most of the server's time is planning (0.7 ms of 0.85 ms here); prepared, it is a lookup.
Longhaul's workers hold persistent connections of their own, so a prepared statement lives
as long as the connection that made it; a pooler that hands a connection to another client
between transactions needs protocol-level prepared statements (PgBouncer 1.21 and later).

Statements prepared here must name their columns rather than select `*`: a prepared plan
whose result changes shape (a column added by a migration) fails instead of re-planning.
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.db import connection
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper

# Django sets prepare_threshold to None, which turns preparing off for the whole connection, even a statement's
# own prepare=True. A threshold no count reaches turns it back on for prepare=True alone: Django's cursors bind
# on the client and never prepare.
_ONLY_WHEN_ASKED = 2**31 - 1


class _PreparingCursor(psycopg.Cursor):
    """Server-side binding (a prepared statement needs it), prepared at its first execute."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> _PreparingCursor:
        return super().execute(query, params, prepare=True, binary=binary)


class _LoggedCursor(CursorDebugWrapper):
    """Django's query log (DEBUG, tests) reads a statement's text back from psycopg, which has none for a
    prepared one: it logs the statement with its parameters bound, as Django's own cursors send it."""

    def execute(self, sql: str, params: Any = None) -> Any:
        with self.debug_sql(self.db.ops.compose_sql(sql, params), params):
            return CursorWrapper.execute(self, sql, params)


def cursor() -> CursorWrapper:
    """PostgreSQL only. Through Django's cursor wrapper, so the query log, execute wrappers and
    error translation see these statements as any other."""
    assert connection.vendor == "postgresql", "prepared statements are PostgreSQL's"
    connection.ensure_connection()
    connection.validate_thread_sharing()
    if connection.connection.prepare_threshold is None:
        connection.connection.prepare_threshold = _ONLY_WHEN_ASKED
    raw = _PreparingCursor(connection.connection)
    return _LoggedCursor(raw, connection) if connection.queries_logged else connection.make_cursor(raw)
