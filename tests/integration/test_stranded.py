"""Regression tests for the issue "Nothing is ever stranded": each path here once left a task,
a notification or a chat run with no way forward. Each failed on the code before the fix."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import time_machine
from django.db import connection, transaction  # noqa: F401 (connection: read by a skipif condition)

from tasks import actions, clock, jobs, leases, liveness, notifications, operations, runner, sweeper
from tasks.gateway.providers.offline import plan_subquestions
from tasks.gateway.transport import gateway_client
from tasks.models import Alert, Checkpoint, Operation, Task
from tasks.statuses import NotificationStatus, OperationStatus, TaskStatus
from tests.factories import submit_sleep
from tests.integration.chatting import run_queued
from tests.integration.test_research import QUESTION as RESEARCH_QUESTION
from tests.integration.test_research import run_to_end
from tests.integration.test_research import submit as submit_research

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _one_step_per_advance(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


def finish_call(op: Operation) -> bool:
    """The gateway job that claimed `op` runs it with the real offline provider and records it."""
    async def run() -> None:
        async with gateway_client(100) as client:
            await operations._run_one(op, owner="gateway:1", client=client)

    asyncio.run(run())
    op.refresh_from_db()
    return op.status == OperationStatus.SUCCEEDED


def test_a_task_stopped_by_its_model_call_budget_resumes_with_more_and_succeeds(acme, alice):
    # The plan and one extract per sub-question fit; the draft does not.
    calls = 1 + len(plan_subquestions(RESEARCH_QUESTION, 3))
    task = run_to_end(submit_research(acme, alice, budget={"max_model_calls": calls}))
    assert task.status == S.PARTIAL, (task.status, task.error_message)
    steps_before = task.current_step
    assert Checkpoint.objects.filter(task=task).count() == steps_before, "every checkpoint is a counted step"

    actions.resume(task, user=alice, budget={"max_model_calls": 200})
    task = run_to_end(task)

    assert task.status == S.SUCCEEDED, (task.status, task.error_class, task.error_message)
    assert task.result_version == 2, "the partial result was superseded by the full one"
    steps = list(Checkpoint.objects.filter(task=task).order_by("step").values_list("step", flat=True))
    assert steps == list(range(1, task.current_step + 1))


def resumed_while_its_call_runs(acme, alice) -> tuple[Task, Operation]:
    """A research task whose plan call a gateway job has claimed, paused and resumed: due, its call out."""
    task = submit_research(acme, alice)
    jobs.advance(task.pk)  # step 0 requests the plan: the task waits for the model
    task.refresh_from_db()
    assert task.waiting_reason == "model"
    [op] = Operation.objects.filter(task=task)
    claimed = operations.claim_batch(owner="gateway:1", limit=10, now=clock.now())
    assert [o.pk for o in claimed] == [op.pk]

    actions.request_pause(task, user=alice)
    task.refresh_from_db()
    assert task.status == S.PAUSED
    actions.resume(task, user=alice)
    task.refresh_from_db()
    assert task.status == S.RUNNING and task.next_run_at is not None
    return task, op


def moves_on(task: Task) -> None:
    task.refresh_from_db()
    due = task.next_run_at is not None and task.lease_owner == ""
    assert due or task.current_step > 1, (task.status, task.waiting_reason, task.next_run_at, task.lease_owner)
    task = run_to_end(task)
    assert task.status == S.SUCCEEDED, (task.status, task.error_message)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the claim reads the calls on PostgreSQL alone")
def test_a_resumed_task_whose_calls_finished_after_its_claim_read_them_is_due_again(acme, alice, monkeypatch):
    """The call finishes between the claim, which read it still running (and cleared waiting_reason), and
    the runner's wait for it: the task must still move on."""
    task, op = resumed_while_its_call_runs(acme, alice)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None and held.resume is not None
    assert operations.read_outcomes(held.resume.calls)[1], "the claim read the call still out"
    assert finish_call(op)  # the competing write, between the read and the wait
    original, waited = runner._wait_again, []
    monkeypatch.setattr(runner, "_wait_again", lambda *args: waited.append(original(*args)) or waited[-1])

    runner.run(held, owner="worker:1")

    assert waited == [False], "the runner looked again, under the row's lock, and found the call finished"
    moves_on(task)


def test_a_resumed_task_whose_calls_finished_after_the_runner_read_them_is_due_again(acme, alice, monkeypatch):
    """As above, where the runner reads the calls itself (a claim that brought none: SQLite's, a takeover, or
    one whose reads were older than the row it took)."""
    task, op = resumed_while_its_call_runs(acme, alice)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    held.resume = None
    original = operations.outcomes_and_wait
    raced = []

    def unfinished_then_the_call_finishes(task_id, step):
        found, waits = original(task_id, step)
        if waits and not raced:
            raced.append(finish_call(op))
        return found, waits

    monkeypatch.setattr(operations, "outcomes_and_wait", unfinished_then_the_call_finishes)
    runner.run(held, owner="worker:1")
    monkeypatch.setattr(operations, "outcomes_and_wait", original)
    assert raced == [True]

    moves_on(task)


# --- the notification outbox and chat runs ------------------------------------------


@pytest.fixture
def root_user(db):
    from django.contrib.auth.models import User

    return User.objects.create_superuser("root", password="root-password-1")


@pytest.fixture
def thread(acme, alice):
    from chat.models import Thread

    return Thread.objects.create(tenant=acme, owner=alice, title="work")


def finished_in(thread, acme, alice) -> Task:
    task = submit_sleep(acme, alice, steps=1, thread_id=thread.pk)
    for _ in range(10):
        task.refresh_from_db()
        if task.status == S.SUCCEEDED:
            return task
        jobs.advance(task.pk)
    raise AssertionError(task.status)


def note_newer_event(task: Task, name: str) -> None:
    with transaction.atomic():
        Task.objects.filter(pk=task.pk).update(name=name)
        task.refresh_from_db()
        assert notifications.note(task, event="succeeded", now=clock.now())


def broken_notifier(delivery):
    raise ConnectionError("chat is down")


def test_a_newer_event_gets_its_own_delivery_attempts(acme, alice, thread, settings):
    settings.LONGHAUL_NOTIFIER = "tests.integration.test_stranded.broken_notifier"
    task = finished_in(thread, acme, alice)
    start = clock.now()
    outcomes = []
    for n in range(4):
        with time_machine.travel(start + timedelta(hours=n + 1), tick=False):
            outcomes.append(notifications.deliver(task.pk))
    assert outcomes == ["retry"] * 4
    note_newer_event(task, "renamed")
    task.refresh_from_db()
    assert task.notification_attempt_count == 0, "the newer version starts with no failures"
    with time_machine.travel(start + timedelta(hours=6), tick=False):
        assert notifications.deliver(task.pk) == "retry", "not dead-lettered by the older version's failures"


def fail_notification_run(task: Task) -> None:
    """The notification run starts and fails (its agent raised)."""
    from chat import runs
    from chat.models import Run

    run = Run.objects.filter(task_id=task.pk, status=Run.Status.PENDING).get()
    claimed = runs.claim(run.pk, owner="w:1", now=clock.now())
    runs.fail(claimed, owner="w:1", error="RuntimeError: the model is down", now=clock.now())


def test_a_revived_dead_letter_starts_a_new_run_and_is_delivered(acme, alice, thread, root_user):
    from chat.models import Message, Run

    task = finished_in(thread, acme, alice)
    start = clock.now()
    for n in range(notifications.MAX_FAILURES):
        with time_machine.travel(start + timedelta(hours=n + 1), tick=False):
            assert notifications.deliver(task.pk) == "dispatched"
            fail_notification_run(task)
    task.refresh_from_db()
    assert task.notification_status == NotificationStatus.DEAD_LETTER
    runs_before = Run.objects.count()

    actions.retry_notification(task, user=root_user)
    assert notifications.deliver(task.pk) == "dispatched"
    assert Run.objects.count() == runs_before + 1, "a new run, not the failed one found again by its key"
    run_queued()
    task.refresh_from_db()
    assert (task.notification_status, task.notified_version) == (NotificationStatus.DELIVERED, 1)
    assert Message.objects.filter(thread=thread, role="assistant", run__task_id=task.pk,
                                  run__status=Run.Status.SUCCEEDED).count() == 1


def test_a_dispatched_notification_whose_run_vanished_is_swept_and_delivered(acme, alice, thread):
    from chat.models import Run

    task = finished_in(thread, acme, alice)
    assert notifications.deliver(task.pk) == "dispatched"
    Run.objects.filter(task_id=task.pk).delete()  # the run is gone (an operator deleted it, say)
    later = clock.now() + notifications.DISPATCH_WATCH + timedelta(seconds=1)
    with time_machine.travel(later, tick=False):
        assert [v.rule for v in liveness.find_violations(clock.now())] == ["notification_run_lost"]
        sweeper.run_once(now=clock.now())
        assert liveness.find_violations(clock.now()) == []
    with time_machine.travel(later + timedelta(minutes=10), tick=False):
        sweeper.run_once(now=clock.now())
        run_queued()
    task.refresh_from_db()
    assert task.notification_status == NotificationStatus.DELIVERED
    assert Alert.objects.get(kind=Alert.Kind.LIVENESS).rule == "notification_run_lost"


def test_a_chat_run_whose_workers_keep_dying_ends_interrupted_and_frees_its_thread(acme, alice, thread, settings):
    from chat import runs
    from chat.models import Message, Run

    chat_run, _ = runs.start_run(thread, kind=Run.Kind.CHAT, user_text="hello", hidden=False, key=None)
    task = finished_in(thread, acme, alice)
    assert notifications.deliver(task.pk) == "busy"
    at = clock.now()
    for n in range(settings.LONGHAUL_MAX_ATTEMPTS):
        assert runs.claim(chat_run.pk, owner=f"dies:{n}", now=at) is not None  # ... and the worker dies
        at += timedelta(seconds=runs.lease_seconds() + 1)
    assert runs.claim(chat_run.pk, owner="next:1", now=at) is None
    chat_run.refresh_from_db()
    assert chat_run.status == Run.Status.INTERRUPTED
    assert Message.objects.filter(run=chat_run, role="assistant").count() == 1, "the thread is told"
    assert Alert.objects.filter(kind=Alert.Kind.POISON, tenant=acme).count() == 1
    with time_machine.travel(at, tick=False):
        run_queued()
    task.refresh_from_db()
    assert task.notification_status == NotificationStatus.DELIVERED, "the freed thread took the notification"


def test_a_thread_busy_past_the_ceiling_counts_as_a_failed_delivery(acme, alice, thread, settings):
    from chat import runs
    from chat.models import Run

    settings.LONGHAUL_NOTIFY_MAX_DEFERRALS = 2
    runs.start_run(thread, kind=Run.Kind.CHAT, user_text="hello", hidden=False, key=None)  # never ends here
    task = finished_in(thread, acme, alice)
    start = clock.now()
    outcomes = []
    for n in range(4):
        with time_machine.travel(start + timedelta(minutes=n + 1), tick=False):
            outcomes.append(notifications.deliver(task.pk))
    assert outcomes[:3] == ["busy", "busy", "retry"]
    task.refresh_from_db()
    assert task.notification_attempt_count >= 1 and "busy" in task.notification_error


def test_a_deliverer_whose_lease_expired_can_neither_dispatch_nor_fail(acme, alice, thread, settings):
    task = finished_in(thread, acme, alice)
    first = notifications.claim(task.pk, owner="d1", now=clock.now())
    later = clock.now() + timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS + 1)
    assert not notifications.dispatch(first, "d1", now=later), "the lease's expiry is checked, not only its owner"
    assert notifications.fail(first, "d1", "late", now=later) == "lost"
    second = notifications.claim(task.pk, owner="d2", now=later)
    assert second is not None and second.key == first.key, "a claimer that died: the same key"
    assert not notifications.dispatch(first, "d1", now=later)
    assert notifications.dispatch(second, "d2", now=later)
    task.refresh_from_db()
    assert task.notification_status == NotificationStatus.DISPATCHED


def test_a_call_whose_gateway_jobs_keep_dying_ends_failed_and_its_task_moves_on(acme, alice, settings):
    task = submit_research(acme, alice)
    jobs.advance(task.pk)  # the plan is requested
    [op] = Operation.objects.filter(task=task)
    at = clock.now()
    for n in range(settings.LONGHAUL_MAX_ATTEMPTS):
        assert [o.pk for o in operations.claim_batch(owner=f"dies:{n}", limit=10, now=at)] == [op.pk]
        at += timedelta(seconds=settings.LONGHAUL_OPERATION_LEASE_SECONDS + 1)  # ... its gateway job died
    assert operations.claim_batch(owner="next:1", limit=10, now=at) == []
    op.refresh_from_db()
    assert (op.status, op.error_class, op.attempts) == (OperationStatus.FAILED, "poison",
                                                       settings.LONGHAUL_MAX_ATTEMPTS)
    task.refresh_from_db()
    assert task.next_run_at is not None, "the task's step is due, to read the failure"
