"""The safety net: re-kick what is due and held by nobody, check and repair the liveness
rules (tasks/liveness.py: every repair raises an alert), time out stale queues, flag
stalled tasks, forget expired idempotency keys.

Kicks may be lost; this makes sure nothing waits forever because of it. Each part
runs on its own, so one failing part never stops the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from tasks import deletion, kicks, leases, liveness, notifications, operations, retention, transitions
from tasks.alerts import raise_alert
from tasks.events import NewEvent, append
from tasks.models import Alert, AuditEntry, IdempotencyRecord, Task
from tasks.statuses import ErrorClass, TaskStatus

log = logging.getLogger(__name__)
# A task due for less than this is probably being kicked right now; don't pile on.
KICK_GRACE = timedelta(seconds=5)


def run_once(*, now: datetime) -> dict[str, int]:
    parts: dict[str, Callable[[datetime], int]] = {
        "kicked": kick_due,
        "operations_kicked": kick_operations,
        "notifications_kicked": lambda at: notifications.kick_due(at, limit=settings.LONGHAUL_SWEEP_BATCH),
        "queue_timeouts": fail_queue_timeouts,
        "liveness_repairs": lambda at: sum(liveness.repair(at).values()),
        "stalled": flag_stalled,
        "idempotency_expired": forget_expired_keys,
        "retention_purged": lambda at: sum(retention.purge(at).values()),
        "deletions_finished": lambda at: deletion.finish_pending(at, batch=settings.LONGHAUL_SWEEP_BATCH),
    }
    counts = {}
    for name, part in parts.items():
        try:
            counts[name] = part(now)
        except Exception:
            log.exception("sweep part %s failed", name)
            counts[name] = 0
    return counts


def kick_due(now: datetime) -> int:
    """Tasks whose next step is due, held by nobody (or by a worker whose lease expired)."""
    ids = list(
        leases.due(now).filter(next_run_at__lte=now - KICK_GRACE)
        .order_by("next_run_at")
        .values_list("pk", flat=True)[: settings.LONGHAUL_SWEEP_BATCH]
    )
    for task_id in ids:
        kicks.kick("advance", task_id)
    return len(ids)


def kick_operations(now: datetime) -> int:
    """Pending model and tool calls whose gateway kick was lost, or whose gateway job died."""
    if not operations.due_exists(now):
        return 0
    kicks.kick("operations", 0)
    return 1


def fail_queue_timeouts(now: datetime) -> int:
    count = 0
    # A task queued to cancel its remote work ends by that cancel, not by its queue deadline: failing it
    # here would leave the remote work running.
    overdue = (Task.objects.filter(status=TaskStatus.QUEUED, queue_deadline_at__lt=now)
               .exclude(waiting_reason=transitions.CANCEL_WAIT))
    for task in overdue[: settings.LONGHAUL_SWEEP_BATCH]:
        with transaction.atomic():
            if transitions.fail(task, now=now, error_class=ErrorClass.QUEUE_TIMEOUT,
                                message="waited in the queue past its deadline without getting a slot"):
                count += 1
    return count


def flag_stalled(now: datetime) -> int:
    """A fresh heartbeat with stale progress: the process lives but the task does not move."""
    limit = now - timedelta(seconds=settings.LONGHAUL_STALL_SECONDS)
    candidates = (
        Task.objects.exclude(lease_owner="")
        .filter(lease_expires_at__gte=now, stalled_at__isnull=True)
        .filter(Q(last_progress_at__lt=limit) | Q(last_progress_at__isnull=True, started_at__lt=limit))
    )
    count = 0
    for task in candidates[: settings.LONGHAUL_SWEEP_BATCH]:
        with transaction.atomic():
            # stalled_at is not part of the version: flagging must not fence the worker out.
            if not Task.objects.filter(pk=task.pk, stalled_at__isnull=True).update(stalled_at=now):
                continue
            since = task.last_progress_at or task.started_at
            append(task, [NewEvent("stalled", {"no_progress_since": since.isoformat() if since else None,
                                               "step": task.current_step})], status=task.status, at=now)
            AuditEntry.objects.create(tenant_id=task.tenant_id, actor=None, action="task.stalled",
                                      target_type="task", target_id=str(task.public_id), at=now,
                                      details={"step": task.current_step, "lease_owner": task.lease_owner})
            raise_alert(Alert.Kind.STALLED, f"task {task.name!r} has not progressed since {since:%Y-%m-%d %H:%M} "
                        f"though its worker is alive", now=now, task=task)
            count += 1
    return count


def forget_expired_keys(now: datetime) -> int:
    deleted, _ = IdempotencyRecord.objects.filter(expires_at__lt=now).delete()
    return deleted



