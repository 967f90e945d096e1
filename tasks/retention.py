"""Retention: what is kept, for how long, and the purge that forgets the rest (DESIGN §14).

Each data class has its own retention in days (0 keeps it for ever), from the settings
`LONGHAUL_RETENTION_<CLASS>_DAYS`. The purge runs with every sweep, in bounded batches, and
only ever touches tasks that have ended (succeeded, failed, cancelled): a partial task may
still be resumed, and a running one still needs everything.

- events: a task's events, once it ended that long ago;
- checkpoints: a task's checkpoints but its last (the result and what a requeue resumes from);
- operation_payloads: the arguments and results of a task's calls (the rows, their status,
  usage and version stay: they say what ran);
- results: a task's result (the task row stays, with its status and error);
- messages: chat messages written that long ago (the thread stays);
- audit: audit entries, which must outlive what they describe, so their retention is at least
  every other class's (project/retention.py checks it at start);
- admissions: admission records (the scheduling replay's input), counted from their arrival, whether
  or not their task ended: they describe decisions, and a decision that old is outside any replay.

A tenant may keep a class for another number of days (Tenant.retention, set in the admin and held to the
same range and audit rule as the settings); its rows are then purged by a pass of their own, and the
system's pass leaves them alone.

Each class moves a watermark forward (RetentionMark: the (moment, id) purged last, one per class for the
system's pass and one per class and overriding tenant), so a pass reads only rows it has not purged yet,
through an index on that moment and id.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import F, Max, Model, Q, QuerySet

from chat.models import Message, ThreadItem
from project.retention import DEFAULT_DAYS, MAX_DAYS, check, setting_name
from tasks.errors import InvalidInput
from tasks.models import AdmissionRecord, AuditEntry, Checkpoint, Operation, RetentionMark, Task, TaskEvent, Tenant
from tasks.statuses import TERMINAL, OperationStatus

CLASSES = tuple(DEFAULT_DAYS)


def days(data_class: str) -> int:
    """The system's retention of a class, from the settings."""
    return int(getattr(settings, setting_name(data_class)))


def effective(tenant: Tenant) -> dict[str, int]:
    """What a tenant keeps, class by class: its overrides over the system's days."""
    return {data_class: int(tenant.retention.get(data_class, days(data_class))) for data_class in CLASSES}


def check_overrides(overrides: dict[str, Any]) -> dict[str, int]:
    """A tenant's overrides as the admin saves them: known classes, whole days in range, and audit outliving
    the rest once merged with the system's days. Raises InvalidInput naming the field."""
    cleaned = {}
    for data_class, value in overrides.items():
        if data_class not in DEFAULT_DAYS:
            raise InvalidInput(f"unknown data class {data_class!r}; known: {', '.join(CLASSES)}", field=data_class)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DAYS:
            raise InvalidInput(f"{data_class} must be a whole number of days from 0 (for ever) to {MAX_DAYS}",
                               field=data_class)
        cleaned[data_class] = value
    merged = {data_class: cleaned.get(data_class, days(data_class)) for data_class in CLASSES}
    try:
        check(merged, name=lambda data_class: data_class)
    except ImproperlyConfigured as exc:
        raise InvalidInput(str(exc), field="audit") from None
    return cleaned


def overrides_dropped(tenant_id: int, data_classes: set[str]) -> None:
    """A tenant follows the system again for these classes: the system's pass, whose watermark went past
    the tenant's rows while they were left out, walks its class again from the start (a pass over rows
    already purged finds nothing and moves on a batch), and the tenant's own watermark goes."""
    if data_classes:
        RetentionMark.objects.filter(data_class__in=data_classes, tenant__isnull=True).update(up_to=None, up_to_id=0)
        RetentionMark.objects.filter(data_class__in=data_classes, tenant_id=tenant_id).delete()


def purge(now: datetime, *, batch: int | None = None) -> dict[str, int]:
    """One bounded pass over every class (the system's, then each overriding tenant's); returns how many
    rows each class purged (or emptied)."""
    batch = batch or settings.LONGHAUL_SWEEP_BATCH
    overrides = {pk: retention for pk, retention in Tenant.objects.exclude(retention={}).values_list("pk", "retention")}
    purged = {}
    for data_class in CLASSES:
        own = {pk: kept[data_class] for pk, kept in overrides.items() if data_class in kept}
        if not days(data_class) and not any(own.values()):
            continue  # kept for ever, by everyone
        total = _purge_class(data_class, now, batch, days(data_class), exclude=sorted(own)) if days(data_class) else 0
        for tenant_id, kept in sorted(own.items()):
            total += _purge_class(data_class, now, batch, kept, tenant_id=tenant_id) if kept else 0
        purged[data_class] = total
    return purged


def _purge_class(data_class: str, now: datetime, batch: int, kept: int, *, tenant_id: int | None = None,
                 exclude: list[int] | None = None) -> int:
    """One bounded pass for one class: the system's (leaving `exclude` out) or one tenant's."""
    cutoff = now - timedelta(days=kept)
    candidates, moment, purge_rows, tenant_of = _CLASSES[data_class]
    rows_of = candidates()
    if tenant_id is not None:
        rows_of = rows_of.filter(**{tenant_of: tenant_id})
    elif exclude:
        rows_of = rows_of.exclude(**{f"{tenant_of}__in": exclude})
    with transaction.atomic():
        mark, _ = RetentionMark.objects.select_for_update().get_or_create(data_class=data_class, tenant_id=tenant_id)
        # After the watermark: (moment, id) above the last pair purged, in that order (an index on both).
        after = (Q(**{f"{moment}__gt": mark.up_to}) | Q(**{moment: mark.up_to, "pk__gt": mark.up_to_id})
                 if mark.up_to else Q())
        rows = list(rows_of.filter(after, **{f"{moment}__lt": cutoff})
                    .order_by(moment, "pk").values_list("pk", moment)[:batch])
        if not rows:
            return 0
        purged, complete = purge_rows([pk for pk, _ in rows], batch)
        moved: dict = {}
        if complete:  # else the next pass takes the same rows again, for what is left of them
            last_id, last_moment = rows[-1]
            moved = {"up_to": last_moment, "up_to_id": last_id}
        RetentionMark.objects.filter(pk=mark.pk).update(purged=F("purged") + purged, last_run_at=now, **moved)
    return purged


# Each returns (rows purged, whether the rows it was given are done with).
Purged = tuple[int, bool]


def _purge_events(task_ids: list[int], batch: int) -> Purged:
    """At most `batch` events a pass, however many the tasks had; their thread-stream items first."""
    ids = list(TaskEvent.objects.filter(task_id__in=task_ids).values_list("pk", flat=True)[:batch])
    ThreadItem.objects.filter(event_id__in=ids).delete()
    TaskEvent.objects.filter(pk__in=ids).delete()  # one DELETE: nothing cascades from an event
    return len(ids), len(ids) < batch


def _purge_checkpoints(task_ids: list[int], batch: int) -> Purged:
    last = Checkpoint.objects.filter(task_id__in=task_ids).values("task_id").annotate(step=Max("step"))
    keep = Q()
    for row in last:
        keep |= Q(task_id=row["task_id"], step=row["step"])
    older = Checkpoint.objects.filter(task_id__in=task_ids)
    if last:
        older = older.exclude(keep)
    ids = list(older.values_list("pk", flat=True)[:batch])
    Checkpoint.objects.filter(pk__in=ids).delete()
    return len(ids), len(ids) < batch


def _purge_operation_payloads(task_ids: list[int], batch: int) -> Purged:
    ids = list(Operation.objects.filter(task_id__in=task_ids, status__in=[OperationStatus.SUCCEEDED,
                                                                           OperationStatus.FAILED])
               .filter(Q(args__isnull=False) | Q(result__isnull=False)).values_list("pk", flat=True)[:batch])
    Operation.objects.filter(pk__in=ids).update(args=None, result=None)
    return len(ids), len(ids) < batch


def _purge_results(task_ids: list[int], batch: int) -> Purged:
    return Task.objects.filter(pk__in=task_ids, result__isnull=False).update(result=None), True


def _delete(model: type[Model]) -> Callable[[list[int], int], Purged]:
    """Rows that are purged whole, by id (messages, audit entries, admission records)."""
    def purge_rows(ids: list[int], batch: int) -> Purged:
        model.objects.filter(pk__in=ids).delete()
        return len(ids), True
    return purge_rows


def _ended_tasks() -> QuerySet[Task]:
    return Task.objects.filter(status__in=sorted(TERMINAL))  # task_ended_idx


# Per class: the rows its watermark walks (the ended tasks, or the rows themselves), the moment they are
# ordered and aged by, what a pass does to the ones it took, and the path to their tenant.
_CLASSES: dict[str, tuple[Callable[[], QuerySet], str, Callable[[list[int], int], Purged], str]] = {
    "events": (_ended_tasks, "finished_at", _purge_events, "tenant_id"),
    "checkpoints": (_ended_tasks, "finished_at", _purge_checkpoints, "tenant_id"),
    "operation_payloads": (_ended_tasks, "finished_at", _purge_operation_payloads, "tenant_id"),
    "results": (_ended_tasks, "finished_at", _purge_results, "tenant_id"),
    "messages": (Message.objects.all, "created_at", _delete(Message), "thread__tenant_id"),  # message_created_idx
    "audit": (AuditEntry.objects.all, "at", _delete(AuditEntry), "tenant_id"),  # audit_at_idx
    "admissions": (AdmissionRecord.objects.all, "arrived_at", _delete(AdmissionRecord),  # admission_arrived_idx
                   "tenant_id"),
}
