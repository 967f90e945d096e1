"""Each liveness rule (tasks/liveness.py): a staged row that breaks it is found, repaired by the
sweeper with an alert naming the row and the rule, and found no more. Rows that move are not found."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction

from tasks import clock, liveness, sweeper
from tasks.models import Alert, Operation, Task
from tasks.statuses import NotificationStatus, OperationStatus, TaskStatus
from tests.factories import make_task

S = TaskStatus
N = NotificationStatus
pytestmark = pytest.mark.django_db


def rules(now=None) -> list[tuple[str, int]]:
    return sorted((v.rule, v.row_id) for v in liveness.find_violations(now or clock.now()))


def repaired(now=None) -> list[tuple[str, int | None]]:
    sweeper.run_once(now=now or clock.now())
    return sorted(Alert.objects.filter(kind=Alert.Kind.LIVENESS).values_list("rule", "task_id"))


def operation(task: Task, *, status: str, step: int = 0, **fields) -> Operation:
    now = clock.now()
    return Operation.objects.create(task=task, key=f"{task.pk}:{step}:r0", step=step, n=0, kind="model",
                                    name="plan", args={"q": 1}, args_digest="d", status=status, fencing_token=1,
                                    created_at=fields.pop("created_at", now), **fields)


def test_tasks_that_move_or_wait_for_a_person_break_no_rule(acme, alice):
    now = clock.now()
    make_task(acme, alice, status=S.RUNNING)  # due now
    make_task(acme, alice, status=S.RUNNING, next_run_at=None, lease_owner="w:1",
              lease_expires_at=now + timedelta(seconds=30))  # held
    waiting = make_task(acme, alice, status=S.WAITING_TOOL, next_run_at=None, current_step=1, waiting_reason="tool")
    operation(waiting, status=OperationStatus.PENDING)  # its call will make it due
    for status in (S.WAITING_INPUT, S.PAUSED, S.PARTIAL, S.SUCCEEDED):
        make_task(acme, alice, status=status)
    acme.max_running = 2
    acme.save()
    make_task(acme, alice, status=S.QUEUED)  # behind a full quota
    assert rules() == []
    assert repaired() == []


def test_a_task_waiting_for_calls_that_all_finished_is_made_due(acme, alice):
    task = make_task(acme, alice, status=S.RUNNING, next_run_at=None, current_step=1, waiting_reason="model")
    operation(task, status=OperationStatus.SUCCEEDED)
    assert rules() == [("operations_done_unnoticed", task.pk)]
    assert repaired() == [("operations_done_unnoticed", task.pk)]
    task.refresh_from_db()
    assert task.next_run_at is not None and task.waiting_reason == ""
    assert task.events.filter(kind="repaired").count() == 1
    assert rules() == []


def test_an_ignored_cancel_request_stops_the_task(acme, alice, settings):
    past = clock.now() - timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS + 1)
    task = make_task(acme, alice, status=S.WAITING_INPUT, cancel_requested_at=past)
    assert rules() == [("stop_request_ignored", task.pk)]
    assert repaired() == [("stop_request_ignored", task.pk)]
    task.refresh_from_db()
    assert task.status == S.CANCELLED


def test_an_operation_that_outlived_its_task_is_closed(acme, alice, settings):
    task = make_task(acme, alice, status=S.CANCELLED)
    expired = clock.now() - timedelta(seconds=1)
    op = operation(task, status=OperationStatus.STARTED, lease_owner="gateway:1", lease_expires_at=expired)
    assert rules() == [("operation_orphaned", op.pk)]
    assert repaired() == [("operation_orphaned", task.pk)]
    op.refresh_from_db()
    assert (op.status, op.error_class) == (OperationStatus.FAILED, "cancelled")


def test_a_task_that_ends_closes_the_calls_nobody_took(acme, alice):
    from django.db import transaction

    from tasks import transitions

    task = make_task(acme, alice, status=S.RUNNING, next_run_at=None, current_step=1, waiting_reason="model")
    op = operation(task, status=OperationStatus.PENDING)
    with transaction.atomic():
        assert transitions.cancel(task, now=clock.now())
    op.refresh_from_db()
    assert op.status == OperationStatus.FAILED
    assert rules() == []


def test_a_notification_waiting_with_nothing_to_deliver_it_is_made_pending(acme, alice):
    from chat.models import Thread

    thread = Thread.objects.create(tenant=acme, owner=alice)
    stuck = make_task(acme, alice, status=S.SUCCEEDED, thread=thread, event_version=1,
                      notification_status=N.RETRY, next_notification_at=None)
    untold = make_task(acme, alice, status=S.SUCCEEDED, thread=thread, event_version=2, notified_version=1,
                       notification_status=N.DELIVERED)
    assert rules() == sorted([("notification_not_due", stuck.pk), ("notification_untold", untold.pk)])
    assert repaired() == sorted([("notification_not_due", stuck.pk), ("notification_untold", untold.pk)])
    assert set(Task.objects.filter(pk__in=[stuck.pk, untold.pk]).values_list("notification_status", flat=True)) \
        == {N.PENDING}
    assert rules() == []


def waiting_for_finished_calls(tenant, owner, count: int) -> list[int]:
    """Tasks that break rule operations_done_unnoticed, in id order."""
    ids = []
    for _ in range(count):
        task = make_task(tenant, owner, status=S.RUNNING, next_run_at=None, current_step=1, waiting_reason="model")
        operation(task, status=OperationStatus.SUCCEEDED)
        ids.append(task.pk)
    return ids


def test_a_rule_over_every_task_waiting_on_a_call_reads_one_slice_a_pass(acme, alice, settings):
    # Ten thousand tasks waiting on remote jobs must not make every pass read them all: each pass reads the
    # next slice, and every such task is looked at within ceil(rows / slice) passes.
    settings.LONGHAUL_LIVENESS_SLICE = 2
    stranded = waiting_for_finished_calls(acme, alice, 5)
    passes = [sorted(t.pk for t in liveness.waits_for_nothing(limit=100)) for _ in range(4)]
    assert passes == [stranded[0:2], stranded[2:4], stranded[4:5], stranded[0:2]]


def test_an_orphaned_call_is_found_in_its_slice(acme, alice, settings):
    settings.LONGHAUL_LIVENESS_SLICE = 1
    old = clock.now() - timedelta(hours=1)
    waiting = make_task(acme, alice, status=S.WAITING_TOOL, next_run_at=None, current_step=1, waiting_reason="tool")
    operation(waiting, status=OperationStatus.PENDING, created_at=old)  # its task waits for it: no orphan
    ended = make_task(acme, alice, status=S.SUCCEEDED)
    orphan = operation(ended, status=OperationStatus.PENDING, created_at=old)
    found = [[op.pk for op in liveness.orphaned_operations(clock.now(), 100)] for _ in range(3)]
    assert found == [[], [orphan.pk], []]


def test_a_slice_with_more_to_repair_than_a_pass_takes_goes_on_from_the_last_one_taken(acme, alice, settings):
    settings.LONGHAUL_LIVENESS_SLICE = 10
    stranded = waiting_for_finished_calls(acme, alice, 5)
    passes = [sorted(t.pk for t in liveness.waits_for_nothing(limit=2)) for _ in range(3)]
    assert passes == [stranded[0:2], stranded[2:4], stranded[4:5]]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="planner settings are PostgreSQL's")
def test_a_rule_joins_its_slice_row_by_row_and_leaves_the_planner_as_it_found_it(acme, alice, settings):
    # The rule turns PostgreSQL's hash and merge joins off for its slice's query only: a caller's transaction
    # that goes on plans its own statements as before, with what it had set itself.
    settings.LONGHAUL_LIVENESS_SLICE = 2
    stranded = waiting_for_finished_calls(acme, alice, 3)

    def planner() -> tuple[str, str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('enable_hashjoin'), current_setting('enable_mergejoin')")
            return cursor.fetchone()

    during: list[tuple[str, str]] = []

    def seen_by_the_slice_query(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if "EXISTS" in sql and not during:  # the rule's own query (the slice's tasks without unfinished calls)
            during.append(planner())
        return result

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_mergejoin = off")  # the caller's own choice, kept
        with connection.execute_wrapper(seen_by_the_slice_query):
            assert sorted(t.pk for t in liveness.waits_for_nothing(limit=100)) == stranded[0:2]
        assert during == [("off", "off")]
        assert planner() == ("on", "off")
        assert [op.pk for op in liveness.orphaned_operations(clock.now(), 100)] == []
        assert planner() == ("on", "off")
