"""ORM reads whose SQL is built once per process, then sent again with new values in their places.

A gateway claim asks the same few questions each time, with a different `now` and pool: which pools have
calls due, and which of a pool's calls to start. Django builds such a statement anew at each call, and for
these (the claimable CASE over a join, three arms of a UNION, two windows) building costs more than running:
3.5 ms of CPU to build which pools have calls due, 0.5 ms for PostgreSQL to run it. The claims run on a
thread that shares the interpreter with the gateway job's event loop and its recorder, so under load each
millisecond of building is a millisecond the calls requested wait on top.

`@compiled_once` keeps the ORM as the one place a question is written: the first call builds the QuerySet
with a stand-in for each argument (a value of the same type nobody would pass), compiles it, and notes where
each stand-in's value landed among the statement's parameters; every call then sends that SQL with its own
values in those places, and converts the rows' values as the ORM would (a count to an int, JSON decoded).
So an argument must reach the SQL as a parameter of its own, unchanged (`now`, not `now - lease`). That is
checked when the statement is compiled, twice, with two sets of stand-ins: the SQL must come out the same,
and the parameters that differ must be the stand-ins' and all of them. A read that fails the check raises
there, rather than send a statement that would answer another question.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, ParamSpec, overload

from django.db import connection
from django.db.models import QuerySet

P = ParamSpec("P")
Row = tuple[Any, ...]


def _stand_in(name: str, value: Any, n: int) -> Any:
    """A value of `value`'s type that no caller passes; `n` tells stand-ins apart. An integer stays within a
    small integer's range: Django drops a comparison with a value its column cannot hold."""
    if isinstance(value, datetime):
        return datetime(1999, 12, 31, 23, 59, 59, 900_000 + n, tzinfo=timezone.utc)
    if isinstance(value, bool):
        raise TypeError(f"{name}: a flag changes the statement's shape; build one statement for each value")
    if isinstance(value, int):
        return 31_000 + n
    if isinstance(value, str):
        return f"\x1fstand-in {n} for {name}"
    raise TypeError(f"{name}: {type(value).__name__} is not a value a compiled read can take")


def _adapted(value: Any) -> Any:
    """`value` as Django passes it to the database driver (SQLite takes a datetime as text)."""
    return connection.ops.adapt_datetimefield_value(value) if isinstance(value, datetime) else value


# Per column of a row (by position): the ORM's converters of its value, and the expression they convert for.
Converters = list[tuple[int, tuple[list[Callable[..., Any]], Any]]]


class _Statement:
    def __init__(self, sql: str, params: list[Any], places: dict[str, list[int]], converters: Converters) -> None:
        self.sql, self.params, self.places, self.converters = sql, params, places, converters

    @classmethod
    def compile(cls, build: Callable[..., QuerySet], values: dict[str, Any], shape: dict[str, Any]) -> _Statement:
        """Compiled twice, with two sets of stand-ins: the SQL must be the same, and the parameters that differ
        must be the stand-ins' and all of them (a constant equal to a stand-in by chance, or a value that
        shapes the statement, would show)."""
        names = sorted(values)
        first, second = ({name: _stand_in(name, values[name], 2 * n + k) for n, name in enumerate(names)}
                         for k in (0, 1))
        (sql, params, converters), (other_sql, other_params, _) = (cls._sql(build, stand_ins | shape)
                                                                   for stand_ins in (first, second))
        places = {name: [i for i, p in enumerate(params) if p == _adapted(first[name])] for name in names}
        for name, found in places.items():
            if not found:
                raise TypeError(f"{build.__qualname__}: {name} does not reach the SQL as a parameter of its own")
        expected = list(params)
        for name, found in places.items():
            for i in found:
                expected[i] = _adapted(second[name])
        if other_sql != sql or other_params != expected:
            raise TypeError(f"{build.__qualname__}: its statement changes with its values beyond their parameters")
        return cls(sql, params, places, converters)

    @staticmethod
    def _sql(build: Callable[..., QuerySet], stand_ins: dict[str, Any]) -> tuple[str, list[Any], Converters]:
        compiler = build(**stand_ins).query.get_compiler(using=connection.alias)
        sql, params = compiler.as_sql()
        converters = compiler.get_converters([col for col, _, _ in compiler.select])
        return sql, list(params), list(converters.items())

    def fetchall(self, values: dict[str, Any]) -> list[Row]:
        params = list(self.params)
        for name, found in self.places.items():
            for i in found:
                params[i] = _adapted(values[name])
        with connection.cursor() as cursor:
            cursor.execute(self.sql, params)
            rows = cursor.fetchall()
        if not self.converters:
            return rows
        return [self._converted(row) for row in rows]

    def _converted(self, row: Row) -> Row:
        """As SQLCompiler.apply_converters converts a row, with this thread's connection."""
        values = list(row)
        for position, (converters, expression) in self.converters:
            for convert in converters:
                values[position] = convert(values[position], expression, connection)
        return tuple(values)


@overload
def compiled_once(build: Callable[P, QuerySet]) -> Callable[P, list[Row]]: ...


@overload
def compiled_once(*, shaped_by: tuple[str, ...]) -> Callable[[Callable[P, QuerySet]], Callable[P, list[Row]]]: ...


def compiled_once(build: Callable[P, QuerySet] | None = None, *, shaped_by: tuple[str, ...] = ()) -> Any:
    """`build(**values)`, a QuerySet of values_list rows, run as its statement compiled once per process and
    database vendor; returns its rows. Arguments by keyword only.

    `shaped_by` names arguments that shape the statement rather than fill a parameter (a slice's LIMIT):
    they are passed to `build` as they are, and each value of theirs gets a statement of its own. Keep
    them to a few values a process uses, such as a batch size."""
    if isinstance(shaped_by, str):
        raise TypeError(f"shaped_by takes a tuple of argument names, not the string {shaped_by!r}")
    if build is None:
        return functools.partial(compiled_once, shaped_by=shaped_by)
    statements: dict[tuple[Any, ...], _Statement] = {}

    @functools.wraps(build)
    def run(*args: P.args, **values: P.kwargs) -> list[Row]:
        if args:
            raise TypeError(f"{build.__qualname__}: arguments by keyword only")
        missing = sorted(set(shaped_by) - values.keys())
        if missing:
            raise TypeError(f"{build.__qualname__}: called without {missing}")
        shape = {name: values.pop(name) for name in shaped_by}
        # By type too: True and 1 are equal, and would share a statement.
        key = (connection.vendor, *((type(value), value) for value in shape.values()))
        statement = statements.get(key)
        if statement is None:
            statement = statements[key] = _Statement.compile(build, values, shape)
        if values.keys() != statement.places.keys():
            raise TypeError(f"{build.__qualname__}: called with {sorted(values | shape)}, "
                            f"compiled for {sorted(statement.places.keys() | shape.keys())}")
        return statement.fetchall(values)

    return run
