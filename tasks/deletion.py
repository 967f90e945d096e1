"""Deletion: a user's tasks, and an operator's erasure of a tenant's data (DESIGN §14).

A task that has ended (or stopped partial) goes at once, with everything derived from it: events,
checkpoints, operations, notification runs, webhook deliveries, idempotency records (all CASCADE).
A task that may still run is asked to cancel and marked `delete_requested_at`: from then on no API
or page shows it, and the sweeper deletes it once it has ended (`finish_pending`), so a deletion
never waits on a step in flight and never leaves a row behind.

Every deletion leaves an audit entry with who, when and how many rows of each class went, never
content. Threads are chat's (chat/deletion.py); it calls `delete_tasks` for a thread's tasks.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime
from typing import Any

from django.apps import apps
from django.db import transaction
from django.db.models import QuerySet

from tasks import actions, clock, notifications
from tasks.errors import Conflict
from tasks.models import AdmissionRecord, Task, Tenant
from tasks.statuses import TERMINAL, TaskStatus

log = logging.getLogger(__name__)

# A task may be deleted once nothing will run it again without its owner: ended, or stopped partial.
DELETABLE = TERMINAL | {TaskStatus.PARTIAL}
CANCEL_REASON = "deleted by its owner"
# What a deletion and its audit read of a task: never its content, so a row whose content fails its check
# (or whose key is gone) is deleted all the same.
DELETION_FIELDS = ("pk", "public_id", "tenant_id", "status", "delete_requested_by")


def delete_task(task: Task, *, user: Any) -> dict[str, int]:
    """Delete a task that has ended, with everything derived from it; 409 `task_active` otherwise.
    Returns the counts its audit entry keeps."""
    now = clock.now()
    with transaction.atomic():
        lock_runs(task_id=task.pk)
        fresh = Task.objects.select_for_update().only(*DELETION_FIELDS).get(pk=task.pk)
        if fresh.status not in DELETABLE:
            raise Conflict(f"the task is {fresh.status}: cancel it first, then delete it", code="task_active")
        counts = _delete_one(fresh)
        actions.audit(fresh, user, "task.delete", now, {"deleted": counts})
    return counts


def delete_tasks(tasks: QuerySet[Task], *, user: Any, now: datetime) -> tuple[Counter[str], int]:
    """Delete these tasks: the ones that have ended now, the others once their cancel has ended them.
    Returns the rows deleted per class, and how many tasks are left to the sweeper."""
    for task in tasks.exclude(status__in=sorted(DELETABLE)).filter(delete_requested_at__isnull=True):
        actions.request_cancel(task, user=user, reason=CANCEL_REASON)  # ends at once unless a worker holds it
        Task.objects.filter(pk=task.pk, delete_requested_at__isnull=True).update(
            delete_requested_at=now, delete_requested_by=user, updated_at=now)
    counts: Counter[str] = Counter()
    # Locked in id order, as every statement that locks several tasks does (a gateway job's batch of outcomes).
    for task in tasks.filter(status__in=sorted(DELETABLE)).select_for_update().only(*DELETION_FIELDS).order_by("pk"):
        counts.update(_delete_one(task))
    return counts, tasks.exclude(status__in=sorted(DELETABLE)).count()


def finish_pending(now: datetime, *, batch: int) -> int:
    """The sweeper's part: delete, at most `batch` a pass, the tasks deleted while they could still
    run that have ended since. Each gets its own audit entry, naming who deleted it."""
    done = 0
    ids = list(Task.objects.filter(delete_requested_at__isnull=False, status__in=sorted(DELETABLE))
               .values_list("pk", flat=True)[:batch])  # task_delete_pending_idx
    for pk in ids:
        try:
            with transaction.atomic():
                lock_runs(task_id=pk)
                task = Task.objects.select_for_update(skip_locked=True).filter(pk=pk).only(*DELETION_FIELDS).first()
                if task is None or task.status not in DELETABLE:
                    continue
                counts = _delete_one(task)
                actions.audit(task, task.delete_requested_by, "task.delete", now,
                              {"deleted": counts, "after_cancel": True})
                done += 1
        except Exception:
            log.exception("deleting task %s, whose owner deleted it, failed; the next sweep tries again", pk)
    return done


def lock_runs(**rows: Any) -> None:
    """Lock the chat runs these rows would take with them, before their thread or task: a run that ends
    locks its run, then its thread, then its task (chat.runs), and a deletion that took the task first
    would wait for it while it waits for the task. Named by string: tasks never imports chat."""
    list(apps.get_model("chat", "Run").objects.select_for_update().filter(**rows).values_list("pk", flat=True))


def erase_tenant(tenant: Tenant, *, user: Any, batch: int = 200) -> dict[str, Any]:
    """An operator's erasure of everything a tenant's users made: threads (with their messages),
    tasks (with everything derived) and admission records. The tenant, its members, its settings
    and the audit trail stay. Tasks are deleted in transactions of `batch`, so a large tenant never
    holds one long lock; the ones still running follow through the sweeper."""
    now = clock.now()
    counts: Counter[str] = Counter()
    with transaction.atomic():
        lock_runs(tenant_id=tenant.pk)
        # Their tasks lose their thread (SET NULL), and with it anyone to tell (a running task ends later).
        notifications.nobody_to_tell(Task.objects.filter(tenant=tenant, thread__isnull=False))
        _, threads = tenant.threads.all().delete()  # chat's threads, by their relation: tasks never imports chat
        counts.update(named_counts(threads))
    while True:
        with transaction.atomic():
            ids = list(Task.objects.filter(tenant=tenant, delete_requested_at__isnull=True)
                       .values_list("pk", flat=True)[:batch])
            if not ids:
                break
            deleted, _ = delete_tasks(Task.objects.filter(pk__in=ids), user=user, now=now)
            counts.update(deleted)
    admissions, _ = AdmissionRecord.objects.filter(tenant=tenant).delete()
    if admissions:
        counts["admissionrecord"] += admissions
    details = {"deleted": dict(sorted(counts.items())), "tasks_pending": Task.objects.filter(tenant=tenant).count()}
    with transaction.atomic():
        actions.audit(tenant, user, "tenant.erase", now, details)
    return details


def _delete_one(task: Task) -> dict[str, int]:
    _, deleted = task.delete()
    return named_counts(deleted)


def named_counts(deleted: dict[str, int]) -> dict[str, int]:
    """Django's per-model counts ("tasks.TaskEvent": 3) as the audit keeps them ("taskevent": 3)."""
    return {label.split(".")[-1].lower(): n for label, n in sorted(deleted.items()) if n}
