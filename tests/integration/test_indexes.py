"""The indexes a write pays for. No step's UPDATE of the task row is HOT (its lease and due time are
indexed), so every step writes an entry into each index its task's row is in, and every checkpoint and
event into each of theirs: no index of ours may only repeat the first columns of another, and the task's
foreign keys that are nearly always NULL index only the rows that name someone."""

from __future__ import annotations

import io

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection

from tasks import clock
from tasks.models import Task
from tests.factories import submit_sleep

pytestmark = [pytest.mark.django_db,
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="reads PostgreSQL's catalog")]
OUR_APPS = ("tasks", "chat", "webhooks")
NULL_MOSTLY = ("cancel_requested_by", "pause_requested_by", "delete_requested_by")

# Index a is redundant when index b, on the same table with the same access method, starts with a's columns
# in a's order, directions and operator classes, and neither is partial or on expressions (a unique index
# enforces something, so it is never the redundant one).
REDUNDANT = """
SELECT a.indexrelid::regclass::text, b.indexrelid::regclass::text
FROM pg_index a
JOIN pg_index b ON b.indrelid = a.indrelid AND b.indexrelid <> a.indexrelid
JOIN pg_class ia ON ia.oid = a.indexrelid
JOIN pg_class ib ON ib.oid = b.indexrelid
WHERE a.indrelid::regclass::text = ANY(%s)
  AND NOT a.indisunique AND a.indpred IS NULL AND b.indpred IS NULL
  AND a.indexprs IS NULL AND b.indexprs IS NULL AND ia.relam = ib.relam
  AND a.indnkeyatts <= b.indnkeyatts
  AND (b.indkey::int2[])[0:a.indnkeyatts - 1] = (a.indkey::int2[])[0:a.indnkeyatts - 1]
  AND (b.indclass::oid[])[0:a.indnkeyatts - 1] = (a.indclass::oid[])[0:a.indnkeyatts - 1]
  AND (b.indoption::int2[])[0:a.indnkeyatts - 1] = (a.indoption::int2[])[0:a.indnkeyatts - 1]
ORDER BY 1, 2
"""


def _our_tables() -> list[str]:
    return sorted({model._meta.db_table for app in OUR_APPS for model in apps.get_app_config(app).get_models()})


def test_no_index_of_ours_only_repeats_the_first_columns_of_another():
    with connection.cursor() as cursor:
        cursor.execute(REDUNDANT, [_our_tables()])
        redundant = cursor.fetchall()
    assert redundant == [], f"each (index, the index that starts with its columns): {redundant}"


# Foreign keys (one column) with no index that starts with their column and holds every row that names a parent:
# deleting a parent row (a cascade, SET NULL, PROTECT's check) would read the whole table.
UNINDEXED_FOREIGN_KEYS = """
SELECT c.conrelid::regclass::text, a.attname
FROM pg_constraint c JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
WHERE c.contype = 'f' AND cardinality(c.conkey) = 1 AND c.conrelid::regclass::text = ANY(%s)
  AND NOT EXISTS (
    SELECT 1 FROM pg_index i
    WHERE i.indrelid = c.conrelid AND i.indkey[0] = c.conkey[1] AND i.indexprs IS NULL
      AND (i.indpred IS NULL OR pg_get_expr(i.indpred, i.indrelid) = format('(%%I IS NOT NULL)', a.attname)))
ORDER BY 1, 2
"""


def test_every_foreign_key_of_ours_still_leads_an_index_that_holds_the_rows_naming_a_parent():
    with connection.cursor() as cursor:
        cursor.execute(UNINDEXED_FOREIGN_KEYS, [_our_tables()])
        unindexed = cursor.fetchall()
    assert unindexed == [], f"(table, column) of foreign keys no index serves: {unindexed}"


def test_the_tasks_user_columns_that_are_nearly_always_null_index_only_the_rows_that_name_a_user():
    columns = [Task._meta.get_field(name).column for name in NULL_MOSTLY]
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT a.attname, i.indexrelid::regclass::text, pg_get_expr(i.indpred, i.indrelid)
            FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
            WHERE i.indrelid = %s::regclass AND a.attname = ANY(%s)""", [Task._meta.db_table, columns])
        indexes = cursor.fetchall()
    assert sorted(column for column, _, _ in indexes) == sorted(columns), indexes
    for column, name, predicate in indexes:
        assert predicate == f"({column} IS NOT NULL)", f"{name} indexes every task: {predicate}"


def test_deleting_a_user_who_asked_to_stop_tasks_finds_them_by_those_indexes(acme, alice, bob):
    task = submit_sleep(acme, alice, steps=3)
    Task.objects.filter(pk=task.pk).update(cancel_requested_by=bob, pause_requested_by=bob, delete_requested_by=bob,
                                           cancel_requested_at=clock.now())
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a table this small would be read whole otherwise
        for name in NULL_MOSTLY:
            plan = Task.objects.filter(**{f"{name}__in": [bob.pk]}).explain()
            assert f"task_{name}_idx" in plan, plan

    bob.delete()

    assert Task.objects.filter(pk=task.pk).values(*NULL_MOSTLY).get() == dict.fromkeys(NULL_MOSTLY)


@pytest.mark.parametrize("app, migration", [("tasks", "0028"), ("chat", "0011"), ("webhooks", "0003")])
def test_dropping_those_indexes_leaves_the_foreign_keys_constraints_alone(app, migration):
    """Django would drop and add back each constraint, checking every row again under an exclusive lock of both
    tables while workers wait (tasks/index_ops.py): the migrations drop the indexes and nothing else."""
    out = io.StringIO()
    call_command("sqlmigrate", app, migration, stdout=out)
    statements = [line for line in out.getvalue().splitlines()
                  if line and not line.startswith(("--", "BEGIN", "COMMIT"))]
    assert statements, out.getvalue()
    assert all(line.startswith(("DROP INDEX IF EXISTS", "CREATE INDEX")) for line in statements), statements
