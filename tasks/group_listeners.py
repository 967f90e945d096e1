"""A web process joins each wake-up group once, and hands each wake-up to every stream in it that follows it.

With a channel per socket, a commit on a task that ten sockets of one daphne follow was delivered ten times
in the process: channels_redis sends one message to the process naming the ten channels, then fills ten
channel queues, wakes ten consumers and runs ten dispatches, all on the event loop that also sends the
events. Here the process listens on one channel of its own, joins a group when its first listener comes and
leaves it when its last one goes: one delivery per process per commit, then a plain call per listener.

A group_send does not say which group a message came through, so a wake-up names it (`group`, put in by
tasks.events.wake_group). Joins and leaves take turns (one lock), so a group whose last listener leaves
while a new one comes ends up joined. The process's memberships are added again every REFRESH_S, because
channels_redis forgets a member after its group_expiry (a day by default) and a popular task's group can
keep listeners longer than any one socket; and after a failed receive, because a Redis that restarted
forgot every group. Until then each stream's safety poll carries it: a lost wake-up delays an item, it
never drops one.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Message = dict[str, Any]
Listener = Callable[[Message], None]

REFRESH_S = 3600.0  # well within channels_redis's default group_expiry of a day
RETRY_S = 1.0  # after a failed receive (Redis away), before receiving and joining again


class GroupListeners:
    """One event loop's listeners by group, and the one channel that hears their groups."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self._listeners: dict[str, list[Listener]] = {}  # only groups joined, each with a listener at least
        self._membership = asyncio.Lock()
        self._channel: str | None = None
        self._loops: list[asyncio.Task[None]] = []

    async def join(self, group: str, listener: Listener) -> None:
        """`listener` hears every wake-up of `group` sent from when this returns."""
        async with self._membership:
            if self._channel is None:
                self._channel = await self.layer.new_channel()
                self._loops = [asyncio.create_task(self._receive()), asyncio.create_task(self._refresh())]
            if group not in self._listeners:
                await self.layer.group_add(group, self._channel)  # a failure leaves nothing registered
                self._listeners[group] = []
            self._listeners[group].append(listener)

    async def leave(self, group: str, listener: Listener) -> None:
        """`listener` hears no more of `group`; the process leaves the group with its last listener."""
        async with self._membership:
            listeners = self._listeners.get(group, [])
            if listener in listeners:
                listeners.remove(listener)
            if listeners or group not in self._listeners:
                return
            del self._listeners[group]
            try:
                await self.layer.group_discard(group, self._channel)
            except Exception:  # its wake-ups then reach no listener, until the membership expires
                log.warning("leaving %s failed", group, exc_info=True)

    def groups(self) -> list[str]:
        return list(self._listeners)

    def stop(self) -> None:
        for loop in self._loops:
            loop.cancel()

    async def _receive(self) -> None:
        assert self._channel is not None
        while True:
            try:
                message = await self.layer.receive(self._channel)
            except Exception:
                log.warning("receiving wake-ups failed; joining every group again in %s s", RETRY_S, exc_info=True)
                await asyncio.sleep(RETRY_S)
                await self._join_all_again()
                continue
            for listener in tuple(self._listeners.get(message.get("group", ""), ())):
                try:
                    listener(message)
                except Exception:  # one stream's failure must not deafen the others
                    log.exception("a listener of %s failed", message.get("group"))

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self._join_all_again()

    async def _join_all_again(self) -> None:
        async with self._membership:
            for group in self._listeners:
                try:
                    await self.layer.group_add(group, self._channel)
                except Exception:
                    log.warning("joining %s again failed", group, exc_info=True)
                    return  # the layer is away: the next refresh or failed receive tries again


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GroupListeners] = weakref.WeakKeyDictionary()


def group_listeners(layer: Any) -> GroupListeners:
    """The running event loop's listeners on `layer` (a new set when the layer was replaced, as tests do)."""
    loop = asyncio.get_running_loop()
    current = _by_loop.get(loop)
    if current is None or current.layer is not layer:
        if current is not None:
            current.stop()
        current = _by_loop[loop] = GroupListeners(layer)
    return current
