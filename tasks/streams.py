"""Event streams: what a stream reads after a cursor, and the follower that sends it on.

A stream is a subject (a task here; a chat thread in chat/streams.py) whose items have an
ascending cursor `seq`. The database is the only source of items; the channel layer carries
wake-ups and nothing else, so a lost wake-up delays an item and never drops or reorders one.
The consumers (tasks/consumers.py, chat/consumers.py) authorize, open a stream and run a Follower.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from channels.layers import BaseChannelLayer, InMemoryChannelLayer
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import QuerySet

from project.env import envfloat
from tasks.compiled import compiled_once
from tasks.events import task_group
from tasks.models import Task, TaskEvent
from tasks.serializers import EventSerializer
from tasks.statuses import TERMINAL
from tasks.tenancy import tenant_for, visible_tasks

Message = dict[str, Any]

# Items per database read: a follower never holds more than this in memory.
BATCH_SIZE = 200
# Full batches sent in a row without catching up before the client is told to reconnect (4429).
MAX_BATCHES_BEHIND = 10


class CloseCode(IntEnum):
    """WebSocket close codes of the stream protocol (4000-4999 are the application's)."""

    BAD_REQUEST = 4400
    UNAUTHENTICATED = 4401
    # Only for a socket that was allowed and no longer is (its membership removed); at connect,
    # forbidden and missing both answer NOT_FOUND, so knowing an id tells nothing.
    FORBIDDEN = 4403
    NOT_FOUND = 4404
    # "Reconnect with your last seq": the client fell too far behind; it loses nothing.
    TOO_FAR_BEHIND = 4429
    # The same code (an alias): too many live sockets. This close is preceded by a
    # {"type": "close", "retry_after": s} frame, which is how a client tells the two apart.
    TOO_MANY = 4429
    INTERNAL_ERROR = 4500  # autobahn lets an application send only 1000 or 3000-4999


@dataclass(frozen=True)
class Batch:
    """Items read after a cursor, in order, and the end message if the subject ended with them."""

    items: list[Message]
    end: Message | None = None


class Stream(Protocol):
    """An opened, authorized stream: where its wake-ups come from and how its items are read."""

    @property
    def group(self) -> str: ...

    def initial_end(self, cursor: int) -> Message | None:
        """The end message if the subject had ended, with nothing after `cursor`, when it was opened."""

    def read_after(self, cursor: int, limit: int) -> Batch:
        """At most `limit` items with seq > cursor, in order (synchronous: it queries the database)."""

    def announced_seq(self, wakeup: Message) -> int | None:
        """The cursor a wake-up says exists in the database, or None when it does not say."""


# --- the task stream -------------------------------------------------------------

def visible_task(user: Any, public_id: uuid.UUID, *, tenant_slug: str | None = None) -> Task | None:
    """The task if this user may see it, else None."""
    tenant = tenant_for(user, slug=tenant_slug)
    if tenant is None:
        return None
    return visible_tasks(user, tenant).filter(public_id=public_id).first()


def end_message(status: str, result_version: int) -> Message:
    return {"type": "end", "status": status, "result_version": result_version}


EVENT_COLUMNS = ("seq", "kind", "status", "at", "data", "task__status", "task__last_event_seq", "task__result_version")


@compiled_once(shaped_by=("limit",))
def _events_after(*, task_id: int, cursor: int, limit: int) -> QuerySet:
    # One statement: the task columns come from the same snapshot as the events, so "terminal and nothing
    # after the last row" is decided without a race. Compiled once: every commit has each process's
    # followers of the task read it, and building it cost more than running it.
    return TaskEvent.objects.filter(task_id=task_id, seq__gt=cursor).order_by("seq").values_list(*EVENT_COLUMNS)[:limit]


@dataclass(frozen=True)
class TaskStream:
    """A task's events by seq (gapless per task, assigned under the task row's lock, so seq order is commit order)."""

    task_pk: int
    public_id: uuid.UUID
    status: str
    last_event_seq: int
    result_version: int

    @classmethod
    def open(cls, user: Any, public_id: uuid.UUID, *, tenant_slug: str | None = None) -> TaskStream | None:
        """The stream of a task this user may see, or None (missing and forbidden look the same)."""
        task = visible_task(user, public_id, tenant_slug=tenant_slug)
        if task is None:
            return None
        return cls(task.pk, task.public_id, task.status, task.last_event_seq, task.result_version)

    @property
    def group(self) -> str:
        return task_group(self.public_id)

    def initial_end(self, cursor: int) -> Message | None:
        if self.status in TERMINAL and cursor >= self.last_event_seq:
            return end_message(self.status, self.result_version)
        return None

    def read_after(self, cursor: int, limit: int) -> Batch:
        found = _events_after(task_id=self.task_pk, cursor=cursor, limit=limit)
        rows = [dict(zip(EVENT_COLUMNS, row)) for row in found]
        if not rows:
            return Batch([])
        last = rows[-1]
        ended = last["task__status"] in TERMINAL and last["seq"] == last["task__last_event_seq"]
        end = end_message(last["task__status"], last["task__result_version"]) if ended else None
        return Batch(list(EventSerializer(rows, many=True).data), end)

    def announced_seq(self, wakeup: Message) -> int | None:
        seq = wakeup.get("seq")  # tasks.events.wake_subscribers: the last seq of the commit
        return seq if isinstance(seq, int) else None


# --- following a stream ----------------------------------------------------------

def _seconds_setting(name: str, default: float) -> float:
    # Settings win; the environment is read the same way until settings.py names these.
    value = getattr(settings, name, None)
    if value is None:
        return envfloat(name, default, minimum=0.01)
    if not isinstance(value, (int, float)) or value <= 0:
        raise ImproperlyConfigured(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def poll_interval(layer: BaseChannelLayer | None) -> float:
    """Seconds between reads when no wake-up comes.

    An in-memory layer hears no other process, so polling carries the stream alone
    (LONGHAUL_STREAM_POLL_S, 1 s); a cross-process layer makes it a safety net for lost
    wake-ups (LONGHAUL_STREAM_SAFETY_POLL_S, 15 s).
    """
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return _seconds_setting("LONGHAUL_STREAM_POLL_S", 1.0)
    return _seconds_setting("LONGHAUL_STREAM_SAFETY_POLL_S", 15.0)


# (cursor, limit, fresh) -> Batch; fresh: the read must begin after the call.
ReadBatch = Callable[[int, int, bool], Awaitable[Batch]]
SendMessage = Callable[[Message], Awaitable[None]]
ReadKey = tuple[str, int, int]


class SharedReads:
    """Followers of one stream at one cursor share database reads.

    One commit wakes every subscriber of a task in this process; without sharing, each
    would run the same query. A fresh read joins only a read that has not begun, so it
    sees every commit made before it was asked for; other reads also join a running one.
    Per key, at most one read runs and at most one waits behind it for all comers.
    """

    def __init__(self) -> None:
        self._running: dict[ReadKey, asyncio.Task[Batch]] = {}
        self._queued: dict[ReadKey, asyncio.Task[Batch]] = {}

    async def read(self, key: ReadKey, read: Callable[[], Awaitable[Batch]], *, fresh: bool) -> Batch:
        task = None if fresh else self._running.get(key)
        task = task or self._queued.get(key)
        if task is None:
            task = asyncio.ensure_future(self._read(key, self._running.get(key), read))
            self._queued[key] = task
        # Shielded: a follower that leaves does not cancel the read others wait for.
        return await asyncio.shield(task)

    async def _read(self, key: ReadKey, after: asyncio.Task[Batch] | None, read: Callable[[], Awaitable[Batch]]
                    ) -> Batch:
        if after is not None:
            await asyncio.wait({after})
        self._running[key] = self._queued.pop(key)  # begun: fresh comers queue behind it
        try:
            return await read()
        finally:
            del self._running[key]


_shared_reads: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SharedReads] = weakref.WeakKeyDictionary()


def shared_reader(stream: Stream, read: Callable[[int, int], Awaitable[Batch]]) -> ReadBatch:
    """`read` for one follower of `stream`, shared with this event loop's other followers of it."""
    shared = _shared_reads.setdefault(asyncio.get_running_loop(), SharedReads())

    async def read_shared(cursor: int, limit: int, fresh: bool) -> Batch:
        return await shared.read((stream.group, cursor, limit), lambda: read(cursor, limit), fresh=fresh)

    return read_shared


@dataclass
class Follower:
    """Sends a stream's items after a cursor, in order and once each, then follows it.

    One reader at a time: wake-ups only set an event that the single `run` loop waits
    on, so wake-ups that arrive together cause one read, never two overlapping sends.
    A wake-up that names its seq lets the follower join a read already under way and
    skip reads it does not need; one that does not, or the poll timer, asks for a fresh one.

    Back-pressure: daphne gives an application no signal of a slow socket (sending never
    blocks and the transport's buffer is out of reach), so the follower bounds what it
    writes without catching up: after `max_batches_behind` full batches in a row it stops
    and the client is closed with 4429. The close frame comes after every item sent, so a
    client can only reconnect (with its last seq, losing nothing) once it has read them:
    a slow client paces itself, and at most max_batches_behind x batch_size items wait
    in the server for it.
    """

    read: ReadBatch
    send: SendMessage
    cursor: int
    poll_s: float
    initial_end: Message | None = None
    batch_size: int = BATCH_SIZE
    max_batches_behind: int = MAX_BATCHES_BEHIND
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _fresh: bool = field(default=True, init=False)  # the next read must begin after now
    _announced: int = field(default=0, init=False)  # the highest seq a wake-up said exists
    _end_sent: Message | None = field(default=None, init=False)

    def wake(self, seq: int | None = None) -> None:
        """Ask for a read soon; any number of calls before it costs one read."""
        if seq is None:
            self._fresh = True
        elif seq <= self.cursor:
            return  # several commits in a row wake us several times; one read covered them
        else:
            self._announced = max(self._announced, seq)
        self._wake.set()

    async def run(self) -> CloseCode:
        """Follow the stream until the client must reconnect; returns the close code to send."""
        if self.initial_end is not None:
            await self._send_end(self.initial_end)
        while True:
            self._wake.clear()  # before reading: a wake-up during the read triggers another one
            if not await self.catch_up():
                return CloseCode.TOO_FAR_BEHIND
            if self._announced > self.cursor:
                # The read joined began before that commit: one more, fresh, then rely on the poll.
                self._announced, self._fresh = 0, True
                continue
            if not self._fresh:
                self._wake.clear()  # wake-ups during the read named seqs it has now sent
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that races
            # with a wake-up, and a disconnected client's follower would live on.
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                self._fresh = True

    async def catch_up(self) -> bool:
        """Send everything after the cursor; False if that took more than max_batches_behind full batches."""
        for _ in range(self.max_batches_behind):
            fresh, self._fresh = self._fresh, False
            batch = await self.read(self.cursor, self.batch_size, fresh)
            for item in batch.items:
                await self.send(item)
                self.cursor = item["seq"]
            if batch.end is not None:
                await self._send_end(batch.end)
            if len(batch.items) < self.batch_size:
                return True
        return False

    async def _send_end(self, end: Message) -> None:
        # Late events after the end are sent as events; the same end is not repeated.
        if end != self._end_sent:
            await self.send(end)
            self._end_sent = end

