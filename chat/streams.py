"""The thread stream: what ws/threads/<id>/ reads after a cursor (chat/consumers.py follows it).

Built on tasks' streams (tasks/streams.py): the same protocol, the same Follower. Its
wake-ups come from two places: chat's own writes (chat/runs.py), and every commit of a
task's events, through the hook ChatConfig.ready registers with tasks.events.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Q

from chat.models import Thread, ThreadItem
from tasks.models import Task, TaskEvent
from tasks.serializers import EventSerializer
from tasks.streams import Batch, Message
from tasks.tenancy import tenant_for

# The events tasks/transitions.py appends with a change of status (plus the stop requests,
# which a task panel shows at once). Progress events stay on the task streams.
STATUS_CHANGE_KINDS = frozenset({
    "queued", "admitted", "recovered", "retrying", "retry_scheduled", "paused", "partial",
    "succeeded", "failed", "cancelled", "cancel_requested", "pause_requested",
})


def thread_group(thread_pk: int) -> str:
    """The channel layer's group of a thread's stream, named after its row: a task names it from its own row (its
    thread_id), where a public id would read the thread's row at every commit of the task's events."""
    return f"thread-{thread_pk}"


def thread_group_of(task: Task) -> str | None:
    """The group of the task's thread, woken with the task's events (tasks.events.also_wake)."""
    return thread_group(task.thread_id) if task.thread_id else None


def _moved(thread_pk: int, marks: dict[str, int]) -> dict[str, int]:
    """The thread's tasks with events after their mark, each with its `last_event_seq`.

    That column commits with the task's events, so every event up to the value read is visible:
    the marks move to those values, and no event is looked at twice.
    """
    return {str(pk): last for pk, last in Task.objects.filter(thread_id=thread_pk).values_list("pk", "last_event_seq")
            if last > marks.get(str(pk), 0)}


def _status_changes(moved: dict[str, int], marks: dict[str, int]) -> list[tuple[int, int, int]]:
    """[(event id, task id, seq)] of the status changes among the moved tasks' new events, in id order:
    one index range per task (event_task_seq_unique), usually one or two."""
    ranges = Q(pk__in=[])
    for task_pk, last in moved.items():
        ranges |= Q(task_id=int(task_pk), seq__gt=marks.get(task_pk, 0), seq__lte=last)
    return list(TaskEvent.objects.filter(ranges, kind__in=STATUS_CHANGE_KINDS).order_by("id")
                .values_list("pk", "task_id", "seq"))


def number_new_items(thread_pk: int) -> int:
    """Give the thread's newly committed status changes the next seqs of its stream. Returns how many.

    Under the thread's row lock, so readers number each event once, one after the other: an
    item is numbered only once it has committed, and every later one gets a higher seq, so a
    reader that has passed seq n never finds a new item below it (a global event id, allocated
    at insert, could commit after a higher one and be skipped).
    """
    marks = Thread.objects.values_list("item_marks", flat=True).filter(pk=thread_pk).first()
    if marks is None or not _moved(thread_pk, marks):  # the common case: nothing new, no lock taken
        return 0  # (or the thread was deleted: its followers close at their next check of the grant)
    with transaction.atomic():
        found = Thread.objects.select_for_update().values_list("item_seq", "item_marks").filter(pk=thread_pk).first()
        if found is None:
            return 0
        last, marks = found
        moved = _moved(thread_pk, marks)
        if not moved:
            return 0
        events = _status_changes(moved, marks)
        ThreadItem.objects.bulk_create([
            ThreadItem(thread_id=thread_pk, seq=last + n, event_id=pk, task_id=task_id, task_seq=task_seq)
            for n, (pk, task_id, task_seq) in enumerate(events, start=1)])
        Thread.objects.filter(pk=thread_pk).update(item_seq=last + len(events), item_marks={**marks, **moved})
    return len(events)


@dataclass(frozen=True)
class ThreadStream:
    """A chat thread's items: the status changes of its tasks, in the thread's own sequence
    (ThreadItem.seq, from 1, per thread), each with its task and that task's event seq."""

    thread_pk: int
    public_id: uuid.UUID

    @classmethod
    def open(cls, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None = None) -> ThreadStream | None:
        """The stream of a live thread this user owns in the tenant they act for, or None."""
        tenant = tenant_for(user, slug=tenant_slug)
        if tenant is None:
            return None
        row = Thread.objects.filter(public_id=public_id, tenant=tenant, owner=user).first()
        return None if row is None else cls(row.pk, row.public_id)

    @property
    def group(self) -> str:
        return thread_group(self.thread_pk)

    def initial_end(self, cursor: int) -> Message | None:
        return None  # a thread does not end

    def read_after(self, cursor: int, limit: int) -> Batch:
        number_new_items(self.thread_pk)
        rows = list(
            ThreadItem.objects.filter(thread_id=self.thread_pk, seq__gt=cursor)
            .order_by("seq")
            .values("seq", "task_seq", "event__kind", "event__status", "event__at", "event__data",
                    "task__public_id")[:limit]
        )
        events = EventSerializer([{"seq": row["task_seq"], "kind": row["event__kind"], "status": row["event__status"],
                                   "at": row["event__at"], "data": row["event__data"]} for row in rows], many=True).data
        return Batch([{**event, "seq": row["seq"], "task": str(row["task__public_id"]), "task_seq": row["task_seq"]}
                      for row, event in zip(rows, events)])

    def announced_seq(self, wakeup: Message) -> int | None:
        return None  # a thread wake-up names no item seq
