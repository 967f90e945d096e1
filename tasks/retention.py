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

Each class moves a watermark forward (RetentionMark: the (moment, id) purged last), so a pass
reads only rows it has not purged yet, through an index on that moment and id.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Max, Model, Q, QuerySet

from chat.models import Message, ThreadItem
from project.retention import DEFAULT_DAYS, setting_name
from tasks.models import AdmissionRecord, AuditEntry, Checkpoint, Operation, RetentionMark, Task, TaskEvent
from tasks.statuses import TERMINAL, OperationStatus

CLASSES = tuple(DEFAULT_DAYS)


def days(data_class: str) -> int:
    return int(getattr(settings, setting_name(data_class)))


def purge(now: datetime, *, batch: int | None = None) -> dict[str, int]:
    """One bounded pass over every class; returns how many rows each purged (or emptied)."""
    batch = batch or settings.LONGHAUL_SWEEP_BATCH
    return {data_class: _purge_class(data_class, now, batch) for data_class in CLASSES if days(data_class) > 0}


def _purge_class(data_class: str, now: datetime, batch: int) -> int:
    cutoff = now - timedelta(days=days(data_class))
    candidates, moment, purge_rows = _CLASSES[data_class]
    with transaction.atomic():
        mark, _ = RetentionMark.objects.select_for_update().get_or_create(data_class=data_class)
        # After the watermark: (moment, id) above the last pair purged, in that order (an index on both).
        after = (Q(**{f"{moment}__gt": mark.up_to}) | Q(**{moment: mark.up_to, "pk__gt": mark.up_to_id})
                 if mark.up_to else Q())
        rows = list(candidates().filter(after, **{f"{moment}__lt": cutoff})
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
               .exclude(args={}, result=None).values_list("pk", flat=True)[:batch])
    Operation.objects.filter(pk__in=ids).update(args={}, result=None)
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
# ordered and aged by, and what a pass does to the ones it took.
_CLASSES: dict[str, tuple[Callable[[], QuerySet], str, Callable[[list[int], int], Purged]]] = {
    "events": (_ended_tasks, "finished_at", _purge_events),
    "checkpoints": (_ended_tasks, "finished_at", _purge_checkpoints),
    "operation_payloads": (_ended_tasks, "finished_at", _purge_operation_payloads),
    "results": (_ended_tasks, "finished_at", _purge_results),
    "messages": (Message.objects.all, "created_at", _delete(Message)),  # message_created_idx
    "audit": (AuditEntry.objects.all, "at", _delete(AuditEntry)),  # audit_at_idx
    "admissions": (AdmissionRecord.objects.all, "arrived_at", _delete(AdmissionRecord)),  # admission_arrived_idx
}
