"""The claim of the task due longest reads the due index in the claim's own order (due time, then id) and
stops at its first free row: no sort of the due rows, no bitmap scan over them, whatever their number.

A plan, not a timing: keyed by due time alone, PostgreSQL sorted each claim's due rows by id (a bitmap
scan that read every due row, and every dead index entry the steps before had left, or an incremental
sort), and each step going on from task to task paid for it. The rows are many and the statistics
fresh (ANALYZE), as autovacuum keeps them, so the plan is the one the planner chooses under load."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from copy import copy
from datetime import timedelta

import pytest
from django.db import connection

from tasks import checks, clock, leases
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep

pytestmark = pytest.mark.django_db(transaction=True)
DUE = 2_000
SORTS = {"Sort", "Incremental Sort"}


def nodes(plan: dict) -> Iterator[dict]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def subplan(plan: dict, name: str) -> dict:
    found = [node for node in nodes(plan) if node.get("Subplan Name") == name]
    assert len(found) == 1, f"no single {name} in the plan: {json.dumps(plan, indent=1)}"
    return found[0]


def explained(sql: str, params: list) -> dict:
    """The plan PostgreSQL chooses for `sql`, not carried out (EXPLAIN alone locks and writes nothing)."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        return cursor.fetchone()[0][0]["Plan"]


@pytest.fixture
def many_due(acme, alice) -> None:
    """DUE running tasks nobody holds, due at a few times (ties broken by id), with fresh statistics."""
    template = submit_sleep(acme, alice)
    now = clock.now()
    copies = []
    for n in range(DUE):
        task = copy(template)
        task.pk, task.public_id = None, uuid.uuid4()
        task.status, task.lease_owner, task.next_run_at = TaskStatus.RUNNING, "", now - timedelta(seconds=n % 7)
        copies.append(task)
    Task.objects.bulk_create(copies)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Task._meta.db_table}")


def test_the_claim_reads_the_due_index_in_order_and_sorts_nothing(many_due):
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's")
    picked = subplan(explained(*leases.claim_statement(owner="plan", now=clock.now())), "CTE picked")
    kinds = [node["Node Type"] for node in nodes(picked)]
    assert not SORTS & set(kinds), f"the claim sorts the due rows: {kinds}"
    assert "Bitmap Heap Scan" not in kinds, f"the claim reads every due row: {kinds}"
    scans = [node for node in nodes(picked) if node["Node Type"] == "Index Scan"]
    assert [scan["Index Name"] for scan in scans] == ["task_due_idx"], kinds


def test_a_claim_by_kick_reads_its_one_row(many_due):
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's")
    task_id = Task.objects.filter(status=TaskStatus.RUNNING).values_list("pk", flat=True).first()
    picked = subplan(explained(*leases.claim_statement(owner="plan", now=clock.now(), task_id=task_id)),
                     "CTE picked")
    scans = [node for node in nodes(picked) if "Scan" in node["Node Type"]]
    primary_key = f"{Task._meta.db_table}_pkey"
    assert [(scan["Node Type"], scan["Index Name"]) for scan in scans] == [("Index Scan", primary_key)]


def test_the_claim_still_takes_the_task_due_longest_first(many_due):
    """The order the index is read in is the claim's: the earliest due time, and among equals the lowest id."""
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement claim is PostgreSQL's")
    expected = list(Task.objects.filter(status=TaskStatus.RUNNING).order_by("next_run_at", "pk")
                    .values_list("pk", flat=True)[:3])
    now = clock.now()
    taken = [leases.claim_next(owner=f"w{n}", now=now).pk for n in range(3)]
    assert taken == expected


@pytest.mark.django_db
@pytest.mark.parametrize("off", ["false", "off"])
def test_autovacuum_off_for_a_table_every_step_rewrites_is_warned_about(off):
    """The plans above hold while autovacuum keeps the statistics fresh and clears the dead entries."""
    if connection.vendor != "postgresql":
        assert checks.autovacuum_runs(databases=["default"]) == []
        return
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        server_on = cursor.fetchone()[0] == "on"
    assert bool(checks.autovacuum_runs(databases=["default"])) is not server_on
    assert checks.autovacuum_runs(databases=None) == []  # not asked for a database: reads none
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {Task._meta.db_table} SET (autovacuum_enabled = {off})")  # rolled back after
    warnings = checks.autovacuum_runs(databases=["default"])
    assert [warning.id for warning in warnings] == ["longhaul.W002"]
    assert Task._meta.db_table in warnings[0].msg and "VACUUM (ANALYZE)" in warnings[0].hint
