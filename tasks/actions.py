"""What callers ask of the runtime: submit, cancel, pause, resume.

Each action is one transaction. API views, admin actions and the chat agent call
these, never the transitions directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from tasks import clock, kicks, runner, scheduling, transitions
from tasks.budgets import Budget
from tasks.context import digest
from tasks.drivers import get_driver
from tasks.errors import Conflict, InvalidInput, QuotaExceeded
from tasks.events import NewEvent
from tasks.models import AuditEntry, IdempotencyRecord, Task, Tenant
from tasks.statuses import TERMINAL, TaskStatus

MAX_NAME = 200
PRIORITY_RANGE = (-10, 10)


@dataclass(frozen=True)
class Submission:
    kind: str
    input: Any
    name: str = ""
    budget: Any = None
    priority: int = 0
    thread_id: int | None = None
    idempotency_key: str | None = None


def submit(*, tenant: Tenant, user: Any, submission: Submission) -> tuple[Task, bool]:
    """Create a task, or return the one this idempotency key already made. (task, created)."""
    driver = get_driver(submission.kind)
    task_input = driver.validate_input(submission.input, tenant=tenant)
    budget = Budget.parse(submission.budget)
    name = (submission.name or "").strip() or f"{submission.kind} task"
    if len(name) > MAX_NAME:
        raise InvalidInput(f"name must be at most {MAX_NAME} characters", field="name")
    low, high = PRIORITY_RANGE
    if isinstance(submission.priority, bool) or not isinstance(submission.priority, int) \
            or not low <= submission.priority <= high:
        raise InvalidInput(f"priority must be an integer between {low} and {high}", field="priority")
    request_digest = digest({"kind": submission.kind, "name": name, "input": task_input,
                             "budget": budget.as_dict(), "priority": submission.priority,
                             "thread": submission.thread_id})
    key = submission.idempotency_key
    try:
        with transaction.atomic():
            now = clock.now()
            if key:
                replay = _replay(tenant, user, key, submission.kind, request_digest, now=now)
                if replay is not None:
                    return replay, False
            scheduling.check_queue_capacity(tenant)
            task = Task.objects.create(
                tenant=tenant, owner=user, thread_id=submission.thread_id, kind=submission.kind, name=name,
                input=task_input, budget=budget.as_dict(), priority=submission.priority,
                status=TaskStatus.QUEUED, created_at=now, updated_at=now,
                queue_deadline_at=now + timedelta(seconds=budget.queue_deadline_seconds),
                code_version=settings.LONGHAUL_CODE_VERSION, schema_version=driver.schema_version,
            )
            if key:
                IdempotencyRecord.objects.create(
                    tenant=tenant, user=user, key=key, kind=submission.kind, request_digest=request_digest,
                    task=task, created_at=now, expires_at=now + timedelta(seconds=settings.LONGHAUL_IDEMPOTENCY_TTL),
                )
            transitions.enqueue_new(task, now=now, events=[NewEvent("queued", {"kind": task.kind})])
    except QuotaExceeded as exc:
        # Recorded after the rollback, in a transaction of its own, so that the refusal leaves a trace.
        scheduling.record_rejection(tenant, user_id=_user_id(user), reason=str(exc), now=clock.now())
        raise
    except IntegrityError:
        # Another request with the same key committed first; its task is the answer.
        if not key:
            raise
        with transaction.atomic():
            replay = _replay(tenant, user, key, submission.kind, request_digest, now=clock.now())
        if replay is None:
            raise
        return replay, False
    task.refresh_from_db()
    return task, True


def _replay(tenant: Tenant, user: Any, key: str, kind: str, request_digest: str, *, now) -> Task | None:
    record = (
        IdempotencyRecord.objects.select_related("task")
        .filter(tenant=tenant, user=user, key=key)
        .first()
    )
    if record is None:
        return None
    if record.expires_at <= now:
        record.delete()
        return None
    if record.kind != kind or record.request_digest != request_digest:
        raise Conflict(
            "this Idempotency-Key was already used with a different request; use a new key for a new task",
            code="idempotency_key_reused",
        )
    return record.task


def request_cancel(task: Task, *, user: Any, reason: str = "", keep_results: bool = False) -> Task:
    """Persist the request, then act: at once if nobody holds the task, else at its next safe point.
    Repeating it is harmless; a finished task is left as it is."""
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status in TERMINAL:
            return fresh
        if fresh.cancel_requested_at is None:
            transitions.mark_cancel_requested(fresh, now=now, by_id=_user_id(user), reason=reason,
                                              keep_results=keep_results)
            _audit(fresh, user, "task.cancel", now, {"reason": reason[:200], "keep_results": keep_results})
        _act_on_stop_request(fresh, now=now)
    return fresh


def request_pause(task: Task, *, user: Any, reason: str = "") -> Task:
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status in TERMINAL or fresh.status == TaskStatus.PAUSED:
            raise Conflict(f"a {fresh.status} task cannot be paused", code="not_pausable")
        if fresh.status == TaskStatus.PARTIAL:
            raise Conflict("a partial task is already stopped", code="not_pausable")
        if fresh.pause_requested_at is None:
            transitions.mark_pause_requested(fresh, now=now, by_id=_user_id(user), reason=reason)
            _audit(fresh, user, "task.pause", now, {"reason": reason[:200]})
        _act_on_stop_request(fresh, now=now)
    return fresh


def resume(task: Task, *, user: Any, budget: Any = None) -> Task:
    """paused or partial -> queued, from the last checkpoint; a partial task may get more budget."""
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status not in (TaskStatus.PAUSED, TaskStatus.PARTIAL):
            raise Conflict(f"a {fresh.status} task cannot be resumed", code="not_resumable")
        new_budget = None
        if budget is not None:
            new_budget = Budget.parse({**fresh.budget, **_require_dict(budget, "budget")}).as_dict()
        transitions.requeue(fresh, now=now, budget=new_budget, reason="resumed")
        _audit(fresh, user, "task.resume", now, {"budget": new_budget} if new_budget else {})
    fresh.refresh_from_db()
    return fresh


def answer(task: Task, *, user: Any, text: str) -> Task:
    """Give a task waiting for input its answer; it queues for a slot and goes on."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput("answer must be non-empty text", field="answer")
    if len(text) > 10_000:
        raise InvalidInput("answer must be at most 10000 characters", field="answer")
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status != TaskStatus.WAITING_INPUT:
            raise Conflict(f"the task is {fresh.status}, not waiting for an answer", code="not_waiting")
        transitions.answer(fresh, now=now, text=text.strip())
        _audit(fresh, user, "task.answer", now, {})
    fresh.refresh_from_db()
    return fresh


def _act_on_stop_request(task: Task, *, now) -> None:
    """A task nobody holds stops now; a held one stops at its next safe point, and if its
    holder died, the kick at lease expiry lets the next claimer stop it."""
    lease_free = not task.lease_owner or (task.lease_expires_at and task.lease_expires_at < now)
    if not lease_free:
        kicks.kick("advance", task.pk, at=task.lease_expires_at + timedelta(milliseconds=500))
        return
    if task.status != TaskStatus.PAUSED or task.cancel_requested_at:
        runner.stop_as_requested(task, now=now)


def _require_dict(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"{field} must be an object", field=field)
    return value


def _user_id(user: Any) -> int | None:
    return getattr(user, "pk", None)


def _audit(task: Task, user: Any, action: str, now, details: dict) -> None:
    AuditEntry.objects.create(tenant_id=task.tenant_id, actor_id=_user_id(user), action=action,
                              target_type="task", target_id=str(task.public_id), details=details, at=now)
