"""Runtime actions the admin needs that tasks.actions does not offer yet.

Each is one transaction that changes the row through a conditional UPDATE and
writes an AuditEntry naming the acting admin, then raises Conflict (with a code
the admin turns into a message) when there was nothing to do. Only operators ask
for these, so they live beside tasks/actions.py rather than in it; their status
changes are transitions like any other.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from tasks import clock, kicks, notifications, scheduling, transitions
from tasks.budgets import Budget
from tasks.errors import Conflict, InvalidInput
from tasks.models import Alert, AuditEntry, Task, Tenant
from tasks.statuses import TaskStatus

S = TaskStatus
QUOTA_FIELDS = ("max_running", "max_queued", "weight")


def requeue_failed(task: Task, *, user: Any) -> Task:
    """failed -> queued: a new attempt from the last checkpoint with a fresh retry budget."""
    now = clock.now()
    with transaction.atomic():
        fresh = Task.objects.select_for_update().get(pk=task.pk)
        if fresh.status != S.FAILED:
            raise Conflict(f"a {fresh.status} task cannot be requeued", code="not_failed")
        previous = {"error_class": fresh.error_class, "error_message": fresh.error_message[:200],
                    "retries": fresh.retries, "step": fresh.current_step}
        deadline = now + timedelta(seconds=Budget.of(fresh.budget).queue_deadline_seconds)
        if not transitions.requeue_failed(fresh, now=now, queue_deadline_at=deadline):
            raise Conflict("the task changed while it was being requeued", code="changed")
        _audit(fresh.tenant_id, user, "task.requeue", "task", str(fresh.public_id), now, previous)
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
        _audit(fresh.tenant_id, user, "task.release_lease", "task", str(fresh.public_id), now, held)
        kicks.kick("advance", fresh.pk)
    return fresh


def retry_notification(task: Task, *, user: Any) -> None:
    """dead_letter -> pending: a fresh set of delivery attempts for the task's newest event."""
    now = clock.now()
    with transaction.atomic():
        if not notifications.retry_dead_letter(task, now=now):
            raise Conflict("the task's notification is not dead-lettered", code="not_dead_lettered")
        _audit(task.tenant_id, user, "task.notification_retry", "task", str(task.public_id), now,
               {"event_version": task.event_version, "error": task.notification_error[:200]})


def acknowledge_alert(alert: Alert, *, user: Any) -> None:
    """Mark an alert seen; it leaves the admin index."""
    now = clock.now()
    with transaction.atomic():
        acknowledged = Alert.objects.filter(pk=alert.pk, acknowledged_at__isnull=True).update(
            acknowledged_at=now, acknowledged_by=user)
        if not acknowledged:
            raise Conflict("the alert was already acknowledged", code="already_acknowledged")
        _audit(alert.tenant_id, user, "alert.acknowledge", "alert", str(alert.pk), now, {"kind": alert.kind})


def set_quotas(tenant: Tenant, *, user: Any, quotas: dict[str, int]) -> None:
    """Change a tenant's quotas; a raised max_running admits its queued tasks now, not at the next sweep."""
    unknown = set(quotas) - set(QUOTA_FIELDS)
    if unknown:
        raise InvalidInput(f"not a quota: {', '.join(sorted(unknown))}", field=min(unknown))
    now = clock.now()
    with transaction.atomic():
        # Locked so that the audit's old values are the ones this update replaced, even when two admins edit.
        before = Tenant.objects.select_for_update().values(*quotas).get(pk=tenant.pk)
        Tenant.objects.filter(pk=tenant.pk).update(**quotas)
        _audit(tenant.pk, user, "tenant.quotas", "tenant", tenant.slug, now,
               {name: [before[name], value] for name, value in quotas.items() if before[name] != value})
        scheduling.admit(now=now)  # not a transition: a raised max_running frees slots by itself


def _audit(tenant_id: int | None, user: Any, action: str, target_type: str, target_id: str, now: datetime,
           details: dict[str, Any]) -> None:
    AuditEntry.objects.create(tenant_id=tenant_id, actor_id=getattr(user, "pk", None), action=action,
                              target_type=target_type, target_id=target_id, details=details, at=now)
