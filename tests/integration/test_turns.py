"""A worker's turn (tasks/runner.py): when other tasks' steps are due and no other job waits, a
worker that has run a step goes on to the task due longest, taking it from the task table with no
broker round trip and no kick; a job waiting in the cluster's own queue ends the turn; when the turn
ends, one kick for the task due longest hands the rest on, unless somebody took them all. Such a kick
(kicks.DUE_LONGEST) takes whichever task is due longest when it runs, so a task handed on waits its turn."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from tasks import broker, clock, jobs, kicks, leases, operations, runner
from tasks.models import Checkpoint, Task
from tasks.statuses import TaskStatus
from tests.factories import make_task, submit_sleep
from tests.integration.lock_waits import another_waits
from tests.integration.test_pools import call

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
    assert advance_kicks() == [kicks.DUE_LONGEST], "the task it released is carried on by a kick"


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
    assert advance_kicks() == [kicks.DUE_LONGEST], "the kick in slow's step's commit ends the turn"

    monkeypatch.undo()
    OrmQ.objects.all().delete()
    jobs.advance(kicks.DUE_LONGEST)  # the worker that kick reaches runs quick, then goes on to slow
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
    assert advance_kicks() == [kicks.DUE_LONGEST]

    OrmQ.objects.all().delete()
    jobs.advance(kicks.DUE_LONGEST)
    due.refresh_from_db()
    assert due.status == TaskStatus.SUCCEEDED, "the kick reached the task left due"


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

    assert advance_kicks() == [kicks.DUE_LONGEST], "slow's step's kick alone: quick, taken, needs none"


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


def run_step_kicks() -> int:
    """A worker takes each step kick there is now and runs it, as the broker hands them out: how many ran."""
    rows = [row for row in OrmQ.objects.order_by("lock", "pk") if SignedPackage.loads(row.payload)["func"]
            == kicks.JOBS["advance"]]
    for row in rows:
        OrmQ.objects.filter(pk=row.pk).delete()
        jobs.advance(*SignedPackage.loads(row.payload)["args"])
    return len(rows)


def test_a_task_handed_on_waits_behind_the_tasks_due_before_it(acme, alice, settings):
    # A job always waits in the cluster's queue, so each turn runs one step and hands its task on with a kick.
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    first, second = submit_sleep(acme, alice, steps=2), submit_sleep(acme, alice, steps=2)
    OrmQ.objects.all().delete()  # the submission kicks: the kick each step hands on carries both tasks
    kicks.kick("deliver", 0)

    jobs.advance(first.pk)
    assert run_step_kicks() == 1
    assert run_step_kicks() == 1

    # second was due before first was handed on: the kick first's step wrote ran second, not first again.
    assert step_order(first, second) == [(first.pk, 1), (second.pk, 1), (first.pk, 2)]


def test_one_kick_carries_every_task_due_one_step_a_job(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0  # every job runs one step and ends its turn
    tasks = [submit_sleep(acme, alice, steps=2) for _ in range(4)]
    OrmQ.objects.all().delete()
    kicks.kick_steps(1)

    jobs_run = 0
    while (ran := run_step_kicks()) and jobs_run < 20:
        jobs_run += ran

    assert set(Task.objects.filter(pk__in=[t.pk for t in tasks]).values_list("status", flat=True)) == {
        TaskStatus.SUCCEEDED}
    assert jobs_run == 8, "one job a step: none ran for nothing, none was left for the sweeper"
    # In turn, each step at the back of the line.
    assert step_order(*tasks) == [(t.pk, step) for step in (1, 2) for t in tasks]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite has no row locks")
def test_a_kick_for_the_task_due_longest_waits_for_a_due_task_another_transaction_holds(acme, alice):
    # Another transaction holds the row of the one task due (a recorder closing a call of a task already due,
    # say): claim_next skips it, and this kick may be the only one on its way for it.
    task = submit_sleep(acme, alice, steps=1)
    OrmQ.objects.all().delete()
    locked, job_waited = threading.Event(), []

    def hold_the_row_until_the_job_waits_for_it() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                Task.objects.select_for_update().get(pk=task.pk)
                locked.set()

                def fetchone(sql: str, params: list) -> tuple:
                    cursor.execute(sql, params)
                    return cursor.fetchone()

                job_waited.append(another_waits(fetchone, connection.connection.info.backend_pid))
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_row_until_the_job_waits_for_it)
    holder.start()
    assert locked.wait(10)
    assert leases.claim_next(owner="worker:2", now=clock.now()) is None, "skipped while locked"

    jobs.advance(kicks.DUE_LONGEST)
    holder.join(20)

    assert job_waited == [True], "the job waited for the row"
    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED


def test_a_batch_of_steps_made_due_kicks_as_many_workers_as_there_are(acme, alice, settings):
    settings.LONGHAUL_STEP_WORKERS = 3
    settings.LONGHAUL_TASK_CALLS_IN_FLIGHT = 50
    waiting = [make_task(acme, alice, status=TaskStatus.WAITING_TOOL, next_run_at=None, current_step=1)
               for _ in range(5)]
    ops = [call(task, 0) for task in waiting]
    assert len(operations.claim_batch(owner="gw:1", limit=100, now=clock.now())) == 5
    OrmQ.objects.all().delete()

    recorded = operations.record_many([operations.Outcome(op.pk, {"results": []}) for op in ops], owner="gw:1")

    assert recorded == [True] * 5
    assert sorted(leases.due(clock.now()).values_list("pk", flat=True)) == sorted(t.pk for t in waiting)
    assert advance_kicks() == [kicks.DUE_LONGEST] * 3, "three workers: three kicks carry the five steps"
