"""A task's life through the runner, driven in-process: steps, retries, budgets, stops, recovery."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.db import transaction

from tasks import actions, clock, jobs, leases
from tasks.models import AuditEntry, Checkpoint, Operation, SleepEffect, Task
from tasks.statuses import OperationStatus, TaskStatus
from tests.factories import submit_sleep
from tests.integration.drive import drive

S = TaskStatus
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _one_step_per_advance(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


def kinds(task: Task) -> list[str]:
    return list(task.events.order_by("seq").values_list("kind", flat=True))


@pytest.mark.smoke
def test_it_runs_a_task_to_success_one_checkpointed_step_at_a_time(acme, alice):
    task = submit_sleep(acme, alice, steps=3, side_effect=True)
    assert task.status == S.RUNNING, "a free slot admits at submission"
    task = drive(task)
    assert task.status == S.SUCCEEDED
    assert task.result == {"steps": 3, "summary": "Slept through 3 steps."}
    assert task.result_version == 1
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == [1, 2, 3]
    assert sorted(SleepEffect.objects.filter(task=task).values_list("step", flat=True)) == [1, 2, 3]
    assert kinds(task) == ["queued", "admitted", "step_done", "step_done", "step_done", "succeeded"]
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, 7))
    assert task.lease_owner == "" and task.finished_at is not None


def test_it_continues_in_place_when_nothing_else_waits(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    task = submit_sleep(acme, alice, steps=4)
    from django_q.models import OrmQ

    OrmQ.objects.all().delete()  # nothing waiting: the worker may keep the lease
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == S.SUCCEEDED
    assert task.current_step == 4


def test_a_transient_failure_waits_with_backoff_then_retries(acme, alice):
    task = submit_sleep(acme, alice, steps=3, fail_at_step=2, fail_kind="transient")
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == S.RETRY_WAIT
    assert task.retries == 1
    assert task.next_run_at > clock.now()
    assert task.lease_owner == ""
    jobs.advance(task.pk)  # not due yet: nothing happens
    assert Task.objects.get(pk=task.pk).status == S.RETRY_WAIT
    task = drive(task)
    assert task.status == S.SUCCEEDED
    assert "retry_scheduled" in kinds(task) and "retrying" in kinds(task)


def test_retries_stop_at_the_retry_budget(acme, alice):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="sleep", input={"steps": 2, "fail_at_step": 1, "fail_kind": "transient", "fail_times": 99},
        budget={"max_retries": 2}))
    task = drive(task)
    assert task.status == S.FAILED
    assert task.error_class == "transient"
    assert task.retries == 2
    assert "gave up after 2 retries" in task.error_message


def test_a_permanent_error_fails_at_once_with_its_class(acme, alice):
    task = drive(submit_sleep(acme, alice, steps=3, fail_at_step=1, fail_kind="permanent"))
    assert task.status == S.FAILED
    assert task.error_class == "permanent"
    assert task.retries == 0


def test_a_step_budget_ends_partial_with_a_scoped_result(acme, alice):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="sleep", input={"steps": 5}, budget={"max_steps": 2}))
    task = drive(task)
    assert task.status == S.PARTIAL
    assert task.result == {"steps": 2}
    partial = task.events.get(kind="partial")
    assert "completed 2 of 5 steps" in partial.data["scope"]
    assert "stopped by budget" in partial.data["scope"]


def test_a_wall_time_budget_before_any_result_fails_as_budget_exhausted(acme, alice):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="sleep", input={"steps": 5}, budget={"max_wall_seconds": 10}))
    with time_machine.travel(clock.now() + timedelta(seconds=11), tick=False):
        jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == S.FAILED
    assert task.error_class == "budget_exhausted"


def test_cancelling_a_queued_task_ends_it_at_once(acme, alice):
    acme.max_running = 0
    acme.save()
    task = submit_sleep(acme, alice)
    assert task.status == S.QUEUED
    task = actions.request_cancel(task, user=alice, reason="changed my mind")
    assert task.status == S.CANCELLED
    assert kinds(task) == ["queued", "cancel_requested", "cancelled"]
    assert AuditEntry.objects.filter(action="task.cancel", target_id=str(task.public_id), actor=alice).exists()


def test_cancelling_twice_is_harmless(acme, alice):
    task = submit_sleep(acme, alice)
    actions.request_cancel(task, user=alice)
    again = actions.request_cancel(task, user=alice)
    assert again.status == S.CANCELLED
    assert kinds(again).count("cancel_requested") == 1
    assert kinds(again).count("cancelled") == 1


def test_a_cancel_during_a_step_is_honoured_at_the_next_safe_point(acme, alice):
    task = submit_sleep(acme, alice, steps=3, side_effect=True)
    jobs.advance(task.pk)
    now = clock.now()
    claimed = leases.claim(task.pk, owner="worker-x", now=now)
    assert claimed is not None
    actions.request_cancel(task, user=alice)
    assert Task.objects.get(pk=task.pk).status == S.RUNNING, "held by a worker: cancel waits for its safe point"
    from tasks import runner

    runner.run(claimed, owner="worker-x")
    task.refresh_from_db()
    assert task.status == S.CANCELLED
    assert SleepEffect.objects.filter(task=task).count() == 1, "nothing new starts after the request"
    assert Checkpoint.objects.filter(task=task).count() == 1, "records are kept"


def test_cancel_keeping_results_ends_partial(acme, alice):
    task = submit_sleep(acme, alice, steps=4)
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    task = actions.request_cancel(task, user=alice, keep_results=True)
    assert task.status == S.PARTIAL
    assert task.result == {"steps": 2}


def test_pause_then_resume_continues_from_the_checkpoint_without_repeating_effects(acme, alice):
    task = submit_sleep(acme, alice, steps=4, side_effect=True)
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    task = actions.request_pause(task, user=alice, reason="lunch")
    assert task.status == S.PAUSED
    assert task.lease_owner == ""
    task = actions.resume(task, user=alice)
    assert task.status == S.RUNNING
    task = drive(task)
    assert task.status == S.SUCCEEDED
    assert sorted(SleepEffect.objects.filter(task=task).values_list("step", flat=True)) == [1, 2, 3, 4]


def test_a_partial_task_resumes_with_more_budget(acme, alice):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="sleep", input={"steps": 4}, budget={"max_steps": 2}))
    task = drive(task)
    assert task.status == S.PARTIAL
    task = actions.resume(task, user=alice, budget={"max_steps": 10})
    task = drive(task)
    assert task.status == S.SUCCEEDED
    assert task.result_version == 2, "partial then succeeded: the result version moves on"


def test_a_finished_side_effect_is_reused_not_repeated_on_recovery(acme, alice):
    task = submit_sleep(acme, alice, steps=1, side_effect=True)
    # The scene after a crash: the effect happened and its operation says started.
    now = clock.now()
    SleepEffect.objects.create(task=task, step=1, at=now)
    from tasks.context import digest

    Operation.objects.create(task=task, key=f"{task.pk}:0:0", step=0, n=0, kind="effect", name="sleep_effect",
                             args_digest=digest({"step": 1}), has_side_effects=True, fencing_token=1, started_at=now)
    task = drive(task)
    assert task.status == S.SUCCEEDED
    assert SleepEffect.objects.filter(task=task).count() == 1
    op = Operation.objects.get(task=task)
    assert op.status == OperationStatus.SUCCEEDED
    assert op.result == {"step": 1}


def test_a_succeeded_operation_is_never_executed_again(acme, alice):
    task = submit_sleep(acme, alice, steps=1, side_effect=True)
    from tasks.context import digest

    Operation.objects.create(task=task, key=f"{task.pk}:0:0", step=0, n=0, kind="effect", name="sleep_effect",
                             args_digest=digest({"step": 1}), status=OperationStatus.SUCCEEDED,
                             result={"step": 1}, has_side_effects=True, fencing_token=1, started_at=clock.now())
    task = drive(task)
    assert task.status == S.SUCCEEDED
    assert SleepEffect.objects.filter(task=task).count() == 0


def test_a_step_that_keeps_dying_is_failed_as_poison(acme, alice, settings):
    settings.LONGHAUL_MAX_ATTEMPTS = 3
    task = submit_sleep(acme, alice, steps=2)
    # Each claim whose worker dies leaves attempts counted and the lease to expire.
    start = clock.now()
    for attempt in range(1, settings.LONGHAUL_MAX_ATTEMPTS + 1):
        with time_machine.travel(start + timedelta(minutes=5 * attempt), tick=False):
            claimed = leases.claim(task.pk, owner="doomed", now=clock.now())
            assert claimed is not None
    with time_machine.travel(start + timedelta(hours=1), tick=False):
        jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == S.FAILED
    assert task.error_class == "poison"
    assert "3 attempts" in task.error_message


def test_a_late_cancel_loses_to_a_finished_result(acme, alice):
    task = submit_sleep(acme, alice, steps=1)
    claimed = leases.claim(task.pk, owner="w", now=clock.now())
    with transaction.atomic():
        from tasks import transitions

        fresh = Task.objects.get(pk=task.pk)
        transitions.mark_cancel_requested(fresh, now=clock.now(), by_id=alice.pk, reason="", keep_results=False)
    from tasks import runner

    # The request arrived after the step's last safe point: run the commit directly.
    from tasks.context import StepContext
    from tasks.drivers import get_driver

    driver = get_driver("sleep")
    outcome = driver.step({"done": 0, "of": 1}, StepContext(claimed, token=claimed.fencing_token))
    runner._commit(claimed, claimed.fencing_token, driver, outcome, StepContext(claimed, token=claimed.fencing_token),
                   keep_lease=False)
    task.refresh_from_db()
    assert task.status == S.SUCCEEDED


def _checkpoint_from_a_newer_worker(task: Task) -> None:
    """The task's last checkpoint, as a worker with a newer checkpoint schema would have written it."""
    from tasks.drivers import get_driver

    Checkpoint.objects.filter(task=task).update(schema_version=get_driver(task.kind).schema_version + 1)


def test_a_checkpoint_from_a_newer_worker_is_left_for_a_worker_that_reads_it(acme, alice):
    from tasks.runner import DEFER_FOR

    task = submit_sleep(acme, alice, steps=3, side_effect=True)
    jobs.advance(task.pk)
    _checkpoint_from_a_newer_worker(task)
    with time_machine.travel(clock.now(), tick=False):
        jobs.advance(task.pk)
        task.refresh_from_db()
        assert (task.status, task.lease_owner, task.current_step, task.attempts) == (S.RUNNING, "", 1, 0)
        assert task.next_run_at == clock.now() + DEFER_FOR
    assert kinds(task)[-1] == "deferred"
    assert Checkpoint.objects.filter(task=task).count() == 1, "this worker wrote nothing it cannot read back"
    assert SleepEffect.objects.filter(task=task).count() == 1, "and ran no step"


def _claim_then_ask(task: Task, alice, ask: str) -> Task:
    """The task claimed by worker-x, then a stop asked for: held, the stop waits for worker-x."""
    claimed = leases.claim(task.pk, owner="worker-x", now=clock.now())
    assert claimed is not None
    if ask == "pause":
        actions.request_pause(task, user=alice)
    else:
        actions.request_cancel(task, user=alice, keep_results=ask == "cancel keeping results")
    assert Task.objects.get(pk=task.pk).status == S.RUNNING, "held by a worker: the stop waits for it"
    return claimed


@pytest.mark.parametrize(("ask", "ends"), [("cancel", S.CANCELLED), ("pause", S.PAUSED)])
def test_a_stop_asked_for_while_a_newer_checkpoint_would_defer_the_task_is_acted_on_at_once(acme, alice, ask, ends):
    from tasks import runner

    task = submit_sleep(acme, alice, steps=3)
    jobs.advance(task.pk)
    _checkpoint_from_a_newer_worker(task)
    runner.run(_claim_then_ask(task, alice, ask), owner="worker-x")
    task.refresh_from_db()
    assert task.status == ends, "not deferred for a minute with the stop unread"
    assert "deferred" not in kinds(task)
    assert task.lease_owner == ""


def test_a_cancel_keeping_results_waits_for_a_worker_that_reads_the_checkpoint_it_keeps(acme, alice):
    from tasks import runner

    task = submit_sleep(acme, alice, steps=3)
    jobs.advance(task.pk)
    _checkpoint_from_a_newer_worker(task)
    runner.run(_claim_then_ask(task, alice, "cancel keeping results"), owner="worker-x")
    task.refresh_from_db()
    assert (task.status, task.lease_owner, task.result) == (S.RUNNING, "", None), "nothing read from that state"
    assert task.cancel_requested_at is not None and task.cancel_keep_results, "the request stands for the next one"
    assert kinds(task)[-1] == "deferred"
