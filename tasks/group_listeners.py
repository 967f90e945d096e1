"""A web process joins each wake-up group once, and hands each wake-up to every stream in it that follows it.

With a channel per socket, a commit on a task that ten sockets of one daphne follow was delivered ten times
in the process: channels_redis sends one message to the process naming the ten channels, then fills ten
channel queues, wakes ten consumers and runs ten dispatches, all on the event loop that also sends the
events. Here the process listens on one channel of its own, joins a group when its first listener comes and
leaves it when its last one goes: one delivery per process per commit, then a plain call per listener.

A group_send does not say which group a message came through, so a wake-up names it (`group`, put in by
tasks.events.wakeup).

Each group's membership is settled by one task at a time, which joins or leaves until the layer matches
whether the group has listeners: a group whose last listener leaves while a new one comes ends up joined,
and groups settle side by side, each a round trip. The layer can lose memberships behind our back: a Redis
that restarted forgot every group, and channels_redis forgets a member after its group_expiry (a day by
default), while a busy task's group can keep listeners longer than any one socket. So every CHECK_S the
process sends itself a wake-up through a group of its own, and joins every group again when it does not
come back; and it joins them all again every REFRESH_S regardless. Until then each stream's safety poll
carries it: a lost wake-up delays an item, it never drops one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Message = dict[str, Any]
Listener = Callable[[Message], None]

CHECK_S = 10.0  # how often the process checks that its own wake-up still comes back
ANSWER_S = 5.0  # how long that wake-up may take before the process joins every group again
REFRESH_S = 3600.0  # well within channels_redis's default group_expiry of a day
RETRY_S = 1.0  # after a failed receive (Redis away), before receiving again


class GroupListeners:
    """One event loop's listeners by group, and the one channel that hears their groups."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self._listeners: dict[str, list[Listener]] = {}  # groups with a listener at least
        self._joined: set[str] = set()  # groups the layer has this channel in, as far as we know
        self._settling: dict[str, asyncio.Future[None]] = {}
        self._own_group = f"listeners-{uuid.uuid4().hex}"
        self._answered = asyncio.Event()
        self._starting = asyncio.Lock()
        self._channel: str | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._sending: asyncio.Future[None] | None = None  # the check's send to its own group
        self._warned_unnamed = False

    async def join(self, group: str, listener: Listener) -> None:
        """`listener` hears every wake-up of `group` sent from when this returns; raises if the layer would
        not add the group, and then `listener` hears nothing."""
        await self._start()
        self._listeners.setdefault(group, []).append(listener)
        try:
            await self._settle(group)
        except BaseException:
            self._forget(group, listener)
            raise

    async def leave(self, group: str, listener: Listener) -> None:
        """`listener` hears no more of `group`; the process leaves the group with its last listener."""
        self._forget(group, listener)
        try:
            await self._settle(group)
        except Exception:  # a join that failed in the same settling: the process is left out of the group anyway
            log.warning("settling %s after a leave failed", group, exc_info=True)

    def groups(self) -> list[str]:
        return list(self._listeners)

    def stop(self) -> list[asyncio.Task[None]]:
        """Cancel the receiving and checking tasks; returns them, for a caller that waits for them to end."""
        for task in self._loops:
            task.cancel()
        return self._loops

    def _forget(self, group: str, listener: Listener) -> None:
        listeners = self._listeners.get(group, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            self._listeners.pop(group, None)

    async def _start(self) -> None:
        async with self._starting:
            if self._channel is not None:
                return
            channel = await self.layer.new_channel()
            await self.layer.group_add(self._own_group, channel)
            self._channel = channel
            # In a context of their own: they outlive the socket whose connect started them.
            context = contextvars.Context()
            self._loops = [asyncio.create_task(self._receive(), context=context),
                           asyncio.create_task(self._check(), context=context)]

    async def _settle(self, group: str) -> None:
        settling = self._settling.get(group)
        if settling is None:
            settling = self._settling[group] = asyncio.ensure_future(self._settle_now(group))
        # Shielded: a socket that goes away while its group settles does not stop it for the others.
        await asyncio.shield(settling)

    async def _settle_now(self, group: str) -> None:
        """Join or leave until the layer matches whether the group has listeners. Nothing awaits between the
        last check and the end, so a listener that comes after it starts a settling of its own."""
        try:
            while (group in self._listeners) != (group in self._joined):
                if group in self._listeners:
                    await self.layer.group_add(group, self._channel)
                    self._joined.add(group)
                else:
                    self._joined.discard(group)
                    try:
                        await self.layer.group_discard(group, self._channel)
                    except Exception:  # its wake-ups then reach no listener, until the membership expires
                        log.warning("leaving %s failed", group, exc_info=True)
        finally:
            del self._settling[group]

    async def _receive(self) -> None:
        while True:
            try:
                message = await self.layer.receive(self._channel)
            except Exception:  # the check below finds out whether the layer lost our groups
                log.warning("receiving wake-ups failed; receiving again in %s s", RETRY_S, exc_info=True)
                await asyncio.sleep(RETRY_S)
                continue
            group = message.get("group")
            if group == self._own_group:
                self._answered.set()
            elif group is None:
                self._warn_unnamed()
            for listener in tuple(self._listeners.get(group or "", ())):
                try:
                    listener(message)
                except Exception:  # one stream's failure must not deafen the others
                    log.exception("a listener of %s failed", group)

    async def _check(self) -> None:
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(CHECK_S)
            if not await self._answers():
                log.warning("a wake-up to this process did not come back; joining its %d groups again",
                            len(self._joined))
            elif time.monotonic() - refreshed < REFRESH_S:
                continue
            if await self._join_all_again():
                refreshed = time.monotonic()

    async def _answers(self) -> bool:
        """Whether a wake-up sent to the process's own group comes back."""
        if self._sending is not None and not self._sending.done():
            return False  # the last check's send has not ended: one at most is left waiting, not one per check
        self._answered.clear()
        sending = self._sending = asyncio.ensure_future(
            self.layer.group_send(self._own_group, {"type": "task.wakeup", "group": self._own_group}))
        done, _ = await asyncio.wait({sending}, timeout=ANSWER_S)
        if not done:
            # Left to end on its own: a send cancelled in redis-py's clean-up after Redis dropped its connections
            # was seen to wait for good, and the checks must go on.
            sending.cancel()
            return False
        if sending.exception() is not None:
            return False
        try:
            async with asyncio.timeout(ANSWER_S):
                await self._answered.wait()
        except TimeoutError:
            return False
        return True

    async def _join_all_again(self) -> bool:
        """Add every joined group again (adding is idempotent); False if the layer failed, to try at the next
        check. A group settling now is left to its settling."""
        try:
            await self.layer.group_add(self._own_group, self._channel)
            for group in list(self._joined):
                if group not in self._settling:
                    await self.layer.group_add(group, self._channel)
        except Exception:
            log.warning("joining the groups again failed; trying again in %s s", CHECK_S, exc_info=True)
            return False
        return True

    def _warn_unnamed(self) -> None:
        if not self._warned_unnamed:
            self._warned_unnamed = True
            log.warning("a wake-up that names no group (sent by a process older than this one) reached no stream; "
                        "streams read at their safety poll until every process is updated")


# Per event loop. Its tasks hold the loop, so a loop that closed keeps its listeners until the process ends:
# daphne runs one loop; a test suite leaves one small object per async test.
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
