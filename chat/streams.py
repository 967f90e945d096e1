"""The thread stream: what ws/threads/<id>/ reads after a cursor (chat/consumers.py follows it).

Built on tasks' streams (tasks/streams.py): the same protocol, the same Follower. Its
wake-ups come from two places: chat's own writes (chat/runs.py), and every commit of a
task's events, through the hook ChatConfig.ready registers with tasks.events.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from chat.models import Thread
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


def thread_group(public_id: object) -> str:
    return f"thread-{public_id}"


def thread_group_of(task: Task) -> str | None:
    """The group of the task's thread, woken with the task's events (tasks.events.also_wake)."""
    return thread_group(task.thread.public_id) if task.thread_id else None


@dataclass(frozen=True)
class ThreadStream:
    """A chat thread's items: for now, the status changes of its tasks, by TaskEvent.id.

    TaskEvent.id is allocated at insert, not at commit: on PostgreSQL two tasks committing
    at once can become visible out of id order, and a reader that has passed the higher id
    never sees the lower one. A thread stream can therefore (rarely) miss a status change,
    which a task stream never does; the chat issue replaces this cursor with a gapless
    per-thread seq when it adds messages.
    """

    thread_pk: int
    public_id: uuid.UUID

    @classmethod
    def open(cls, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None = None) -> ThreadStream | None:
        """The stream of a live thread this user owns in the tenant they act for, or None."""
        tenant = tenant_for(user, slug=tenant_slug)
        if tenant is None:
            return None
        row = Thread.objects.filter(public_id=public_id, tenant=tenant, owner=user, deleted=False).first()
        return None if row is None else cls(row.pk, row.public_id)

    @property
    def group(self) -> str:
        return thread_group(self.public_id)

    def initial_end(self, cursor: int) -> Message | None:
        return None  # a thread does not end

    def read_after(self, cursor: int, limit: int) -> Batch:
        rows = list(
            TaskEvent.objects.filter(task__thread_id=self.thread_pk, id__gt=cursor, kind__in=STATUS_CHANGE_KINDS)
            .order_by("id")
            .values("id", "seq", "kind", "status", "at", "data", "task__public_id")[:limit]
        )
        items = []
        for row, event in zip(rows, EventSerializer(rows, many=True).data):
            items.append({**event, "seq": row["id"], "task": str(row["task__public_id"]), "task_seq": row["seq"]})
        return Batch(items)

    def announced_seq(self, wakeup: Message) -> int | None:
        return None  # a thread wake-up names no TaskEvent.id
