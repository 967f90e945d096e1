"""A worker's turn (tasks/runner.py): when other tasks' steps are due and no other job waits, a
worker that has run a step goes on to the task due longest, taking it from the task table with no
broker round trip and no kick; a job waiting in the cluster's own queue ends the turn; when the turn
ends, one kick for the released task due longest hands the rest on, unless somebody took them all."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from tasks import broker, clock, jobs, kicks, leases, runner
from tasks.models import Checkpoint, Task
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep

pytestmark = pytest.mark.django_db(transaction=True)


def advance_kicks() -> list[int]:
    return sorted(SignedPackage.loads(row.payload)["args"][0] for row in OrmQ.objects.all()
                  if SignedPackage.loads(row.payload)["func"] == "tasks.jobs.advance")


def step_order(*tasks: Task) -> list[tuple[int, int]]:
    return list(Checkpoint.objects.filter(task__in=tasks).order_by("at", "pk").values_list("task_id", "step"))


def test_a_worker_goes_on_to_the_task_due_longest_without_a_kick(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    first, second = submit_sleep(acme, alice, steps=3), submit_sleep(acme, alice, steps=3)
    OrmQ.objects.all().delete()  # their submission kicks: this one job is the only worker

    jobs.advance(first.pk)

    for task in (first, second):
        task.refresh_from_db()
        assert task.status == TaskStatus.SUCCEEDED
    # Each step put its task at the back of the line: the two took turns, neither ran on while the other was due.
    assert step_order(first, second) == [(first.pk, 1), (second.pk, 1), (first.pk, 2), (second.pk, 2),
                                         (first.pk, 3), (second.pk, 3)]
    assert advance_kicks() == [], "a task the worker went on to needs no kick"


def test_a_job_waiting_in_the_clusters_queue_ends_the_turn_with_a_kick(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    first, second = submit_sleep(acme, alice, steps=3), submit_sleep(acme, alice, steps=3)
    OrmQ.objects.all().delete()
    kicks.kick("deliver", 0)  # a job of the cluster's own queue waits: the worker must go back to the broker

    jobs.advance(first.pk)

    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.current_step, first.lease_owner) == (1, "")
    assert second.current_step == 0, "a worker with another job waiting does not go on to other tasks"
    assert advance_kicks() == [first.pk], "the task it released is kicked"


def test_the_step_kicks_beside_the_queue_do_not_end_a_turn(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    first, second = submit_sleep(acme, alice, steps=2), submit_sleep(acme, alice, steps=2)
    # Both submission kicks stay: hints for tasks due in the table, which the worker takes from there.
    assert {row.key for row in OrmQ.objects.all()} == {broker.steps_key(django_settings.Q_CLUSTER["name"])}

    jobs.advance(first.pk)

    assert set(Task.objects.filter(pk__in=[first.pk, second.pk]).values_list("status", flat=True)) == {
        TaskStatus.SUCCEEDED}


def slice_ends_during_the_step_of(task: Task, monkeypatch) -> None:
    """The turn's time slice runs out while `task`'s step runs (the moment a worker holds it), and stays out."""
    over = []

    def lasts(turn: runner.Turn) -> bool:
        if not over and Task.objects.filter(pk=task.pk).exclude(lease_owner="").exists():
            over.append(True)
        return not over

    monkeypatch.setattr(runner.Turn, "lasts", lasts)


def test_the_kick_that_ends_a_turn_carries_on_the_tasks_it_released(acme, alice, settings, monkeypatch):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    quick = submit_sleep(acme, alice, steps=3)
    slow = submit_sleep(acme, alice, steps=3)
    OrmQ.objects.all().delete()
    slice_ends_during_the_step_of(slow, monkeypatch)

    jobs.advance(quick.pk)  # quick's step, then slow's (quick released without a kick), then the slice is over

    quick.refresh_from_db()
    slow.refresh_from_db()
    assert (quick.current_step, slow.current_step) == (1, 1)
    assert quick.lease_owner == slow.lease_owner == ""
    assert advance_kicks() == [slow.pk], "slow's own kick, in its step's commit, ends the turn"

    monkeypatch.undo()
    OrmQ.objects.all().delete()
    jobs.advance(slow.pk)  # the worker that kick reaches goes on to quick too
    assert set(Task.objects.filter(pk__in=[quick.pk, slow.pk]).values_list("status", flat=True)) == {
        TaskStatus.SUCCEEDED}


def test_a_turn_that_ends_without_a_kick_kicks_the_task_due_longest(acme, alice, settings):
    # Its task ends and a job waits, so no step of this turn hands on a kick, while another task is due,
    # held by nobody and kicked by nobody (released by another worker's turn, say).
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    ending = submit_sleep(acme, alice, steps=1)
    due = submit_sleep(acme, alice, steps=2)
    OrmQ.objects.all().delete()
    kicks.kick("deliver", 0)

    jobs.advance(ending.pk)

    ending.refresh_from_db()
    due.refresh_from_db()
    assert (ending.status, due.current_step) == (TaskStatus.SUCCEEDED, 0)
    assert advance_kicks() == [due.pk]


def test_a_released_task_somebody_took_meanwhile_is_not_kicked(acme, alice, settings, monkeypatch):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    quick = submit_sleep(acme, alice, steps=3)
    slow = submit_sleep(acme, alice, steps=3)
    OrmQ.objects.all().delete()
    slice_ends_during_the_step_of(slow, monkeypatch)
    original = leases.claim_next

    def and_another_worker_takes_quick(*, owner: str, now):
        taken = original(owner=owner, now=now)
        # Meanwhile another worker claims the task this one released: its turn must not kick it.
        assert leases.claim(quick.pk, owner="worker:2", now=clock.now()) is not None
        return taken

    monkeypatch.setattr(leases, "claim_next", and_another_worker_takes_quick)
    jobs.advance(quick.pk)

    assert advance_kicks() == [slow.pk]


def test_a_kick_for_a_task_somebody_else_took_takes_the_task_due_longest(acme, alice):
    first, second = submit_sleep(acme, alice, steps=1), submit_sleep(acme, alice, steps=1)
    OrmQ.objects.all().delete()
    assert leases.claim(first.pk, owner="worker:2", now=clock.now()) is not None

    jobs.advance(first.pk)  # held by worker:2: this worker takes `second`, due and held by nobody

    second.refresh_from_db()
    assert second.status == TaskStatus.SUCCEEDED
    first.refresh_from_db()
    assert (first.status, first.lease_owner) == (TaskStatus.RUNNING, "worker:2")


def test_a_task_between_steps_is_claimed_in_one_statement_and_moves_its_fence(acme, alice):
    task = submit_sleep(acme, alice, steps=3)
    first = leases.claim(task.pk, owner="worker:1", now=clock.now())
    Task.objects.filter(pk=task.pk).update(lease_owner="", lease_expires_at=None, current_step=1, attempts=0)
    before = Task.objects.get(pk=task.pk)

    with CaptureQueriesContext(connection) as queries:
        taken = leases.claim_next(owner="worker:2", now=clock.now())

    assert taken is not None and taken.pk == task.pk
    assert len(queries.captured_queries) == (1 if connection.vendor == "postgresql" else 4)
    row = Task.objects.get(pk=task.pk)
    assert (row.lease_owner, row.fencing_token, row.version, row.attempts) == (
        "worker:2", first.fencing_token + 1, before.version + 1, 1)
    assert (taken.lease_owner, taken.fencing_token, taken.version, taken.input) == (
        row.lease_owner, row.fencing_token, row.version, row.input)
    assert leases.claim_next(owner="worker:3", now=clock.now()) is None, "held now"


def test_a_kicked_task_between_steps_is_claimed_in_one_statement(acme, alice):
    task = submit_sleep(acme, alice, steps=3)
    first = leases.claim(task.pk, owner="worker:1", now=clock.now())
    Task.objects.filter(pk=task.pk).update(lease_owner="", lease_expires_at=None, current_step=1, attempts=0)
    other = submit_sleep(acme, alice, steps=3)
    Task.objects.filter(pk=other.pk).update(next_run_at=clock.now() - timedelta(minutes=1))  # due longer, not asked

    with CaptureQueriesContext(connection) as queries:
        taken = leases.claim(task.pk, owner="worker:2", now=clock.now())

    assert taken is not None and taken.pk == task.pk
    assert len(queries.captured_queries) == (1 if connection.vendor == "postgresql" else 4)
    row = Task.objects.get(pk=task.pk)
    assert (row.lease_owner, row.fencing_token, row.attempts) == ("worker:2", first.fencing_token + 1, 1)
    assert Task.objects.get(pk=other.pk).lease_owner == ""
    assert leases.claim(task.pk, owner="worker:3", now=clock.now()) is None, "held now"


def test_a_retry_due_is_claimed_with_its_event_by_the_full_claim(acme, alice):
    task = submit_sleep(acme, alice, steps=3)
    Task.objects.filter(pk=task.pk).update(status=TaskStatus.RETRY_WAIT, current_step=1, retries=1)

    taken = leases.claim_next(owner="worker:2", now=clock.now())

    assert taken is not None and taken.status == TaskStatus.RUNNING
    assert task.events.filter(kind="retrying").exists()
