"""The placeholders of the statements a worker prepares (tasks/prepared.py), numbered as PostgreSQL's own."""

from __future__ import annotations

import re

import pytest

from tasks.prepared import numbered


def test_each_placeholder_is_numbered_in_order_and_a_doubled_percent_is_one():
    assert numbered("SELECT %s, %s FROM t WHERE key LIKE 'a%%' AND n = %s") == (
        "SELECT $1, $2 FROM t WHERE key LIKE 'a%' AND n = $3", 3)


def test_a_statement_longer_than_psycopgs_cache_keeps_every_placeholder():
    columns = ", ".join(f"%s AS c{n}" for n in range(80))
    sql = f"SELECT {columns} -- {'x' * 5000}"

    assert numbered(sql) == (f"SELECT {', '.join(f'${n + 1} AS c{n}' for n in range(80))} -- {'x' * 5000}", 80)


@pytest.mark.parametrize("placeholder", ["%(name)s", "%b", "%t"])
def test_another_kind_of_placeholder_is_refused_naming_it(placeholder):
    with pytest.raises(ValueError, match=re.escape(f"not {placeholder[:2]}")):
        numbered(f"SELECT {placeholder}")
