"""Regression tests for the issue "Nothing is ever stranded": each path here once left a task,
a notification or a chat run with no way forward. Each failed on the code before the fix."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import time_machine

from tasks import actions, clock, jobs, leases, operations, runner
from tasks.models import Checkpoint, Operation, Task
from tasks.statuses import OperationStatus, TaskStatus

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)
QUESTION = "How does asyncio task cancellation work?"


@pytest.fixture(autouse=True)
def _one_step_per_advance(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


def submit_research(tenant, user, **extra) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="research", input={"question": QUESTION}, **extra))
    return task


def run_to_end(task: Task, *, max_rounds: int = 80) -> Task:
    """Advance steps and run gateway batches in-process until the task stops."""
    for _ in range(max_rounds):
        task.refresh_from_db()
        if task.status in (S.SUCCEEDED, S.FAILED, S.PARTIAL, S.CANCELLED, S.PAUSED):
            return task
        if task.current_step and operations.unfinished(task.pk, task.current_step - 1):
            operations.run_due(run_for=5)
        else:
            jobs.advance(task.pk)
    raise AssertionError(f"still {task.status} at step {task.current_step}")


def finish_call(op: Operation) -> bool:
    """The gateway job that claimed `op` runs it with the real offline provider and records it."""
    import httpx

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            await operations._run_one(op, owner="gateway:1", client=client)

    asyncio.run(run())
    op.refresh_from_db()
    return op.status == OperationStatus.SUCCEEDED


def test_a_task_stopped_by_its_model_call_budget_resumes_with_more_and_succeeds(acme, alice):
    task = run_to_end(submit_research(acme, alice, budget={"max_model_calls": 4}))
    assert task.status == S.PARTIAL, (task.status, task.error_message)
    steps_before = task.current_step
    assert Checkpoint.objects.filter(task=task).count() == steps_before, "every checkpoint is a counted step"

    actions.resume(task, user=alice, budget={"max_model_calls": 200})
    task = run_to_end(task)

    assert task.status == S.SUCCEEDED, (task.status, task.error_class, task.error_message)
    assert task.result_version == 2, "the partial result was superseded by the full one"
    steps = list(Checkpoint.objects.filter(task=task).order_by("step").values_list("step", flat=True))
    assert steps == list(range(1, task.current_step + 1))


def test_a_resumed_task_whose_calls_finished_during_its_claim_is_due_again(acme, alice, monkeypatch):
    """Pause a task waiting on a call, resume it, and let the call finish between the claim
    (which clears waiting_reason) and the runner's wait: the task must still move on."""
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

    # A worker claims the resumed task; the call finishes between the runner's look at the operations
    # (still running) and its wait for them: the competing write, run between the read and the write.
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    original = operations.unfinished
    raced = []

    def unfinished_then_the_call_finishes(task_id, step):
        found = original(task_id, step)
        if found and not raced:
            raced.append(finish_call(op))
        return found

    monkeypatch.setattr(operations, "unfinished", unfinished_then_the_call_finishes)
    runner.run(held, owner="worker:1")
    monkeypatch.setattr(operations, "unfinished", original)
    assert raced == [True]

    task.refresh_from_db()
    due = task.next_run_at is not None and task.lease_owner == ""
    assert due or task.current_step > 1, (task.status, task.waiting_reason, task.next_run_at, task.lease_owner)
    task = run_to_end(task)
    assert task.status == S.SUCCEEDED, (task.status, task.error_message)
