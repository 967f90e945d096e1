"""What callers ask of the runtime: submit, cancel, pause, resume, answer, and what operators
ask in the admin (requeue a failed task, release a stuck lease, retry a dead letter,
acknowledge an alert, set quotas).

Each action is one transaction that leaves an AuditEntry naming who asked. API views,
admin actions and the chat agent call these, never the transitions directly. An action
with nothing to do raises Conflict with a code the caller turns into a message.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from tasks import clock, crypto, kicks, notifications, retention, scheduling, stopping, transitions
from tasks.budgets import Budget
from tasks.context import digest
from tasks.drivers import get_driver
from tasks.errors import Conflict, InvalidInput, QuotaExceeded
from tasks.events import NewEvent
from tasks.mcp import forms
from tasks.models import Alert, AuditEntry, IdempotencyRecord, Task, Tenant
from tasks.statuses import TERMINAL, TaskStatus

S = TaskStatus

MAX_NAME = 200
PRIORITY_RANGE = (-10, 10)
QUOTA_FIELDS = ("max_running", "max_queued", "weight")


@dataclass(frozen=True)
class Submission:
    kind: str
    input: Any
    name: str = ""
    budget: Any = None
    priority: int = 0
    thread_id: int | None = None
    idempotency_key: str | None = None
    # True only for code in this process (tests, drills), never for a request or a model's tool call:
    # only then does the debug driver accept a fault that kills the worker process.
    internal: bool = False


def submit(*, tenant: Tenant, user: Any, submission: Submission) -> tuple[Task, bool]:
    """Create a task, or return the one this idempotency key already made. (task, created)."""
    driver = get_driver(submission.kind)
    task_input = driver.validate_input(submission.input, tenant=tenant, internal=submission.internal)
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
            scheduling.check_queue_capacity(tenant, priority=submission.priority)
            task = Task.objects.create(
                tenant=tenant, owner=user, thread_id=submission.thread_id, kind=submission.kind, name=name,
                input=task_input, budget=budget.as_dict(), priority=submission.priority,
                status=TaskStatus.QUEUED, created_at=now, updated_at=now,
                queue_deadline_at=budget.queue_deadline(now),
                code_version=settings.LONGHAUL_CODE_VERSION, schema_version=driver.schema_version,
                **asdict(driver.pins()),
            )
            if key:
                IdempotencyRecord.objects.create(
                    tenant=tenant, user=user, key=key, kind=submission.kind, request_digest=request_digest,
                    task=task, created_at=now, expires_at=now + timedelta(seconds=settings.LONGHAUL_IDEMPOTENCY_TTL),
                )
            transitions.enqueue_new(task, now=now, events=[NewEvent("queued", {"kind": task.kind})])
    except QuotaExceeded as exc:
        # Recorded after the rollback, in a transaction of its own, so that the refusal leaves a trace.
        scheduling.record_rejection(tenant, user_id=_user_id(user), reason=str(exc), rule=exc.rule, now=clock.now(),
                                    priority=submission.priority, kind=submission.kind,
                                    max_wall_seconds=budget.max_wall_seconds)
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
            audit(fresh, user, "task.cancel", now, {"reason": reason[:200], "keep_results": keep_results})
        _act_on_stop_request(fresh, now=now)
    fresh.refresh_from_db()  # a task queued to cancel its remote work may have been admitted meanwhile
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
            audit(fresh, user, "task.pause", now, {"reason": reason[:200]})
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
        deadline = Budget.of(new_budget or fresh.budget).queue_deadline(now)
        transitions.requeue(fresh, now=now, queue_deadline_at=deadline, budget=new_budget, reason="resumed")
        audit(fresh, user, "task.resume", now, {"budget": new_budget} if new_budget else {})
    fresh.refresh_from_db()
    return fresh


def answer(task: Task, *, user: Any, text: str = "", data: dict[str, Any] | None = None) -> Task:
    """Give a task waiting for input its answer; it queues for a slot and goes on.

    `text` answers a free-text question (or a form with one text field); `data` is a structured
    answer to a remote tool's question: {"action": "accept", "content": {...}}, {"action": "decline"}
    or {"action": "cancel"}. Either is checked against the question's form before anything is written.
    """
    if data is None:
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput("answer must be non-empty text", field="answer")
        if len(text) > 10_000:
            raise InvalidInput("answer must be at most 10000 characters", field="answer")
        text = text.strip()
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status != TaskStatus.WAITING_INPUT:
            raise Conflict(f"the task is {fresh.status}, not waiting for an answer", code="not_waiting")
        response = _checked_answer(fresh, text=text, data=data)
        transitions.answer(fresh, now=now, text=text if data is None else _answer_words(response), data=response)
        audit(fresh, user, "task.answer", now, {"action": response["action"]} if response else {})
    fresh.refresh_from_db()
    return fresh


def _checked_answer(task: Task, *, text: str, data: dict[str, Any] | None) -> dict[str, Any] | None:
    """The structured answer to store (None: the text is the answer); InvalidInput names a bad field."""
    if data is None and task.question_form is None:
        return None  # a free-text question
    if data is not None and task.kind != "mcp":
        raise InvalidInput("this question takes a text answer", field="answer")
    try:
        response = forms.response(task.question_form, data if data is not None else text)
    except forms.FormError as exc:
        field = getattr(exc, "field", None)
        raise InvalidInput(str(exc), field=f"answer.content.{field}" if field else "answer") from None
    return response if data is not None else None


def _answer_words(response: dict[str, Any]) -> str:
    """A structured answer in a few words, for the task's `answer` column (the admin shows it)."""
    if response["action"] != "accept":
        return response["action"]
    return ", ".join(f"{name}: {value}" for name, value in response.get("content", {}).items())[:10_000]


# --- what operators ask for in the admin ----------------------------------------------


def requeue_failed(task: Task, *, user: Any) -> Task:
    """failed -> queued: a new attempt from the last checkpoint with a fresh retry budget."""
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status != S.FAILED:
            raise Conflict(f"a {fresh.status} task cannot be requeued", code="not_failed")
        previous = {"error_class": fresh.error_class, "error_message": fresh.error_message[:200],
                    "retries": fresh.retries, "step": fresh.current_step}
        deadline = Budget.of(fresh.budget).queue_deadline(now)
        if not transitions.requeue_failed(fresh, now=now, queue_deadline_at=deadline):
            raise Conflict("the task changed while it was being requeued", code="changed")
        audit(fresh, user, "task.requeue", now, previous)
    fresh.refresh_from_db()
    return fresh


def release_lease(task: Task, *, user: Any) -> Task:
    """Take a stuck lease away from its holder: the fencing token moves on, so the old
    holder can write nothing more, and the step is due again for any worker."""
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status != S.RUNNING or not fresh.lease_owner:
            raise Conflict("nobody holds this task's lease", code="not_leased")
        # The holder's name and token are internal: they go to the audit log, not the task's events.
        held = {"lease_owner": fresh.lease_owner, "fencing_token": fresh.fencing_token,
                "lease_expires_at": fresh.lease_expires_at.isoformat() if fresh.lease_expires_at else None}
        if not transitions.release_lease(fresh, now=now):
            raise Conflict("the task changed while its lease was being released", code="changed")
        audit(fresh, user, "task.release_lease", now, held)
        kicks.kick("advance", fresh.pk)
    return fresh


def retry_notification(task: Task, *, user: Any) -> None:
    """dead_letter -> pending: a fresh set of delivery attempts for the task's newest event."""
    now = clock.now()
    with transaction.atomic():
        if not notifications.retry_dead_letter(task, now=now):
            raise Conflict("the task's notification is not dead-lettered", code="not_dead_lettered")
        audit(task, user, "task.notification_retry", now,
               {"event_version": task.event_version, "error": task.notification_error[:200]})


def acknowledge_alert(alert: Alert, *, user: Any) -> None:
    """Mark an alert seen; it leaves the admin index."""
    now = clock.now()
    with transaction.atomic():
        acknowledged = Alert.objects.filter(pk=alert.pk, acknowledged_at__isnull=True).update(
            acknowledged_at=now, acknowledged_by=user)
        if not acknowledged:
            raise Conflict("the alert was already acknowledged", code="already_acknowledged")
        audit(alert, user, "alert.acknowledge", now, {"kind": alert.kind})


def quota_ceilings() -> dict[str, tuple[int, str]]:
    """The most each quota may be set to, and the system setting that says so. A tenant admin may edit
    their own tenant's quotas, so without these they could give themselves the whole system."""
    return {"max_running": (settings.LONGHAUL_MAX_RUNNING, "LONGHAUL_MAX_RUNNING"),
            "max_queued": (settings.LONGHAUL_MAX_QUEUED, "LONGHAUL_MAX_QUEUED"),
            "weight": (settings.LONGHAUL_MAX_TENANT_WEIGHT, "LONGHAUL_MAX_TENANT_WEIGHT")}


def check_quota(name: str, value: Any) -> None:
    """InvalidInput naming the quota when `value` is not a whole number from 0 to its ceiling."""
    if name not in QUOTA_FIELDS:
        raise InvalidInput(f"not a quota: {name}", field=name)
    ceiling, setting = quota_ceilings()[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= ceiling:
        raise InvalidInput(f"{name} must be a whole number from 0 to {ceiling} (the system's {setting})",
                           field=name)


def set_quotas(tenant: Tenant, *, user: Any, quotas: dict[str, int]) -> None:
    """Change a tenant's quotas; a raised max_running admits its queued tasks now, not at the next sweep."""
    for name in sorted(quotas):
        check_quota(name, quotas[name])
    now = clock.now()
    with transaction.atomic():
        # Locked so that the audit's old values are the ones this update replaced, even when two admins edit.
        before = Tenant.objects.select_for_update().values(*quotas).get(pk=tenant.pk)
        Tenant.objects.filter(pk=tenant.pk).update(**quotas)
        audit(tenant, user, "tenant.quotas", now,
               {name: [before[name], value] for name, value in quotas.items() if before[name] != value})
        scheduling.admit(now=now)  # not a transition: a raised max_running frees slots by itself


def set_retention(tenant: Tenant, *, user: Any, overrides: dict[str, int]) -> None:
    """Replace a tenant's retention overrides (tasks/retention.py); the classes left out follow the system's."""
    cleaned = retention.check_overrides(overrides)
    now = clock.now()
    with transaction.atomic():
        before = Tenant.objects.select_for_update().values_list("retention", flat=True).get(pk=tenant.pk)
        Tenant.objects.filter(pk=tenant.pk).update(retention=cleaned)
        retention.overrides_dropped(tenant.pk, set(before) - set(cleaned))
        tenant.retention = cleaned
        audit(tenant, user, "tenant.retention", now, {"before": before, "after": cleaned})


def destroy_data_key(tenant: Tenant, *, user: Any) -> int:
    """Crypto-shredding: every version of the tenant's data key is destroyed, so what they sealed reads as
    erased; returns how many versions went. New content gets a new key."""
    now = clock.now()
    with transaction.atomic():
        destroyed = crypto.destroy_keys(tenant.pk)
        audit(tenant, user, "tenant.key_destroyed", now, {"versions": destroyed})
    return destroyed


def _act_on_stop_request(task: Task, *, now) -> None:
    """A task nobody holds stops now; a held one stops at its next safe point, and if its
    holder died, the kick at lease expiry lets the next claimer stop it."""
    lease_free = not task.lease_owner or (task.lease_expires_at and task.lease_expires_at < now)
    if not lease_free:
        kicks.kick("advance", task.pk, at=task.lease_expires_at + timedelta(milliseconds=500))
        return
    if task.status != TaskStatus.PAUSED or task.cancel_requested_at:
        stopping.stop_as_requested(task, now=now)


def _require_dict(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"{field} must be an object", field=field)
    return value


def _user_id(user: Any) -> int | None:
    return getattr(user, "pk", None)


def audit(target: Any, user: Any, action: str, now: datetime, details: dict[str, Any]) -> None:
    """The one audit trail of every action: who did what to which row, and when. The target is a task,
    an alert, a tenant, or another app's row with a tenant and a public id (a chat thread)."""
    if isinstance(target, Alert):
        tenant_id, target_type, target_id = target.tenant_id, "alert", str(target.pk)
    elif isinstance(target, Tenant):
        tenant_id, target_type, target_id = target.pk, "tenant", target.slug
    else:
        tenant_id, target_type, target_id = target.tenant_id, target._meta.model_name, str(target.public_id)
    AuditEntry.objects.create(tenant_id=tenant_id, actor_id=_user_id(user), action=action, target_type=target_type,
                              target_id=target_id, details=details, at=now)
