"""Append sequenced task events in the caller's transaction; wake subscribers after commit.

Wake-ups leave the committing thread at once: a per-process daemon thread owns one
event loop (and so one set of channel-layer connections) and sends them, coalesced
per group. `async_to_sync(group_send)` per commit cost 7.6 to 20 ms with Redis, most of
it a fresh event loop and a fresh connection each time.

Streams outside tasks that show a task's events (chat's thread stream) register at start,
through `also_wake`, the group each task's commits should wake besides the task's own; apps
that act on events (webhooks) register through `on_append`, called in the appending transaction.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.db import connection, transaction

from tasks.models import Task, TaskEvent

log = logging.getLogger(__name__)

# Each names one more group to wake with a task's events, or None; registered at app start.
_also_woken: list[Callable[[Task], str | None]] = []
# Each is told of every batch of appended events holding a kind it hears, inside the transaction that appended
# them: listener -> the kinds it hears.
_listeners: dict[Callable[[Task, Sequence[TaskEvent]], None], frozenset[str]] = {}


@dataclass(frozen=True)
class NewEvent:
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


def append(task: Task, events: list[NewEvent], *, status: str, at: datetime) -> int:
    """Give the events the task's next seqs, store them, and return the last seq.

    The seq counter lives on the task row and is bumped by one UPDATE, so writers
    in other transactions queue on the row lock and seqs stay gapless. A status change
    reserves the seqs in its own UPDATE instead, which on PostgreSQL also writes the events
    (tasks/transitions.py); `unsaved` and `written` are its halves of `store`.
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
    return store(task, events, last=last, status=status, at=at)


def store(task: Task, events: list[NewEvent], *, last: int, status: str, at: datetime) -> int:
    """Store events whose seqs, up to `last`, the caller reserved on the locked task row; one INSERT."""
    if not events:
        return task.last_event_seq
    return written(task, TaskEvent.objects.bulk_create(unsaved(task, events, last=last, status=status, at=at)),
                   last=last)


def unsaved(task: Task, events: list[NewEvent], *, last: int, status: str, at: datetime) -> list[TaskEvent]:
    """The events' rows, unsaved, numbered up to `last`."""
    first = last - len(events) + 1
    return [TaskEvent(task_id=task.pk, tenant_id=task.tenant_id, seq=first + i, kind=e.kind, status=status,
                      data=e.data, at=at) for i, e in enumerate(events)]


def written(task: Task, logged: Sequence[TaskEvent], *, last: int) -> int:
    """What follows once the task's events up to `last` are written in the caller's transaction: the listeners
    hear of them in it, and the task's streams are woken after it commits."""
    if not logged:
        return task.last_event_seq
    task.last_event_seq = last
    for listener, kinds in _listeners.items():
        if any(event.kind in kinds for event in logged):
            listener(task, logged)
    public_id = task.public_id
    also = [group for group_of in _also_woken if (group := group_of(task)) is not None]
    transaction.on_commit(lambda: wake_subscribers(public_id, last, also=also))
    return last


def also_wake(group_of: Callable[[Task], str | None]) -> None:
    """Wake the group `group_of(task)` names, too, after each commit of a task's events (called at app start).

    How chat's thread stream hears of its tasks without tasks importing chat (DESIGN §3).
    `group_of` runs inside the appending transaction.
    """
    if group_of not in _also_woken:
        _also_woken.append(group_of)


def on_append(listener: Callable[[Task, Sequence[TaskEvent]], None], *, kinds: Collection[str]) -> None:
    """Tell `listener(task, events)` of every batch of events appended that holds one of `kinds`
    (called at app start).

    It runs inside the appending transaction, so what it writes commits or rolls back with the
    events (an outbox row, never a network call). How webhooks hear of tasks without tasks
    importing them (DESIGN §15). The events are as written (seq, kind, status, data, at), without
    their ids: a transition's own statement writes them, and does not read them back. A batch no
    listener hears may be committed by its transition's statement alone (transitions.commits_alone).
    """
    _listeners[listener] = frozenset(kinds)


def heard(kinds: Iterable[str]) -> bool:
    """Whether a listener hears an event of one of `kinds`, and so writes in the appending transaction."""
    wanted = set(kinds)
    return any(not wanted.isdisjoint(heard_kinds) for heard_kinds in _listeners.values())


def task_group(public_id: object) -> str:
    return f"task-{public_id}"


def wake_subscribers(public_id: object, seq: int, *, also: Sequence[str] = ()) -> None:
    """A hint to stream consumers that events up to `seq` exist; they read them from the database."""
    wake_group(task_group(public_id), seq=seq)
    for group in also:
        wake_group(group)  # those streams read fresh; a task's seq means nothing there


def wake_group(group: str, *, seq: int = 0) -> None:
    """Hand a wake-up to the process's sender; called after commit (transaction.on_commit)."""
    layer = get_channel_layer()
    if layer is None:
        return
    if isinstance(layer, InMemoryChannelLayer):
        # In-process layer (tests, the embedded mode): its queues belong to the consumers' loop,
        # and a test reads right after the commit, so the send stays synchronous.
        _send_now(layer, group, seq)
        return
    wakeup_sender().wake(group, seq)


def wakeup(group: str, seq: int) -> dict[str, Any]:
    """The message: it names its group, since listeners share one channel (tasks/group_listeners.py)."""
    return {"type": "task.wakeup", "group": group, "seq": seq}


def _send_now(layer: Any, group: str, seq: int) -> None:
    try:
        async_to_sync(layer.group_send)(group, wakeup(group, seq))
    except Exception:  # a lost wake-up delays an event, it never drops one
        log.warning("wake-up for %s failed", group, exc_info=True)


SENDS_AT_ONCE = 32  # wake-ups in flight at once, well under channels_redis's pool of 100 connections


class WakeupSender:
    """A daemon thread with one event loop that sends wake-ups handed to it by committing threads.

    Wake-ups for one group that pile up while a send is under way merge into one with the
    highest seq: consumers read every event after their cursor, so the latest hint covers
    the earlier ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._flush_scheduled = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="longhaul-wakeups", daemon=True)
        self._thread.start()

    def wake(self, group: str, seq: int) -> None:
        """Never blocks on the channel layer."""
        with self._lock:
            self._pending[group] = max(seq, self._pending.get(group, 0))
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
            self._idle.clear()
        self._loop.call_soon_threadsafe(self._start_flush)

    def _start_flush(self) -> None:
        self._loop.create_task(self._flush())

    async def _flush(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, {}
                if not batch:
                    self._flush_scheduled = False
                    self._idle.set()
                    return
            layer = get_channel_layer()
            items = list(batch.items())
            # A few at a time: each send in flight holds one of the layer's pooled connections (100 at most), and a
            # commit that touched hundreds of tasks hands over hundreds of wake-ups at once.
            for start in range(0, len(items), SENDS_AT_ONCE):
                chunk = items[start:start + SENDS_AT_ONCE]
                results = await asyncio.gather(
                    *(layer.group_send(group, wakeup(group, seq)) for group, seq in chunk),
                    return_exceptions=True)
                for (group, _), result in zip(chunk, results):
                    if isinstance(result, BaseException):  # a lost wake-up delays an event, it never drops one
                        log.warning("wake-up for %s failed: %r", group, result)

    def drain(self, timeout: float) -> bool:
        """Wait until every wake-up handed over so far has been sent (at exit, so none is left behind)."""
        return self._idle.wait(timeout)


_sender_lock = threading.Lock()
_sender_instance: WakeupSender | None = None
_sender_pid = 0


def wakeup_sender() -> WakeupSender:
    """This process's sender; a forked child (a django-q2 worker) starts its own, since threads do not
    survive a fork."""
    global _sender_instance, _sender_pid
    pid = os.getpid()
    if _sender_instance is None or _sender_pid != pid:
        with _sender_lock:
            if _sender_instance is None or _sender_pid != pid:
                _sender_instance, _sender_pid = WakeupSender(), pid
    return _sender_instance


@atexit.register
def _drain_at_exit() -> None:
    if _sender_instance is not None and _sender_pid == os.getpid():
        _sender_instance.drain(timeout=2.0)
