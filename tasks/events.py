"""Append sequenced task events in the caller's transaction; wake subscribers after commit."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction

from tasks.models import Task, TaskEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewEvent:
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


def append(task: Task, events: list[NewEvent], *, status: str, at: datetime) -> int:
    """Give the events the task's next seqs, store them, and return the last seq.

    The seq counter lives on the task row and is bumped by one UPDATE, so writers
    in other transactions queue on the row lock and seqs stay gapless.
    """
    if not events:
        return task.last_event_seq
    assert connection.in_atomic_block, "events are appended inside the transaction that made them true"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Task._meta.db_table} SET last_event_seq = last_event_seq + %s WHERE id = %s RETURNING last_event_seq",
            [len(events), task.pk],
        )
        (last,) = cursor.fetchone()
    first = last - len(events) + 1
    TaskEvent.objects.bulk_create(
        TaskEvent(task_id=task.pk, tenant_id=task.tenant_id, seq=first + i, kind=e.kind, status=status, data=e.data, at=at)
        for i, e in enumerate(events)
    )
    task.last_event_seq = last
    public_id = task.public_id
    thread_public_id = task.thread.public_id if task.thread_id else None
    transaction.on_commit(lambda: wake_subscribers(public_id, last, thread_public_id=thread_public_id))
    return last


def task_group(public_id: object) -> str:
    return f"task-{public_id}"


def thread_group(public_id: object) -> str:
    return f"thread-{public_id}"


def wake_subscribers(public_id: object, seq: int, *, thread_public_id: object | None = None) -> None:
    """A hint to stream consumers that events up to `seq` exist; they read them from the database."""
    wake_group(task_group(public_id), seq=seq)
    if thread_public_id is not None:
        wake_group(thread_group(thread_public_id))  # the thread stream reads fresh; seq means nothing there


def wake_group(group: str, *, seq: int = 0) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "task.wakeup", "seq": seq})
    except Exception:  # a lost wake-up delays an event, it never drops one
        log.warning("wake-up for %s failed", group, exc_info=True)
