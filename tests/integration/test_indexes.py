"""The indexes a write pays for. No step's UPDATE of the task row is HOT (its lease and due time are
indexed), so every step writes an entry into each index its task's row is in, and every checkpoint and
event into each of theirs: no index of ours may only repeat the first columns of another, and the task's
foreign keys that are nearly always NULL index only the rows that name someone."""

from __future__ import annotations

import pytest
from django.apps import apps
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


def test_no_index_of_ours_only_repeats_the_first_columns_of_another():
    tables = sorted({model._meta.db_table for app in OUR_APPS for model in apps.get_app_config(app).get_models()})
    with connection.cursor() as cursor:
        cursor.execute(REDUNDANT, [tables])
        redundant = cursor.fetchall()
    assert redundant == [], f"each (index, the index that starts with its columns): {redundant}"


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
