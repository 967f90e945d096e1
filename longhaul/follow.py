"""Following a task: every event after a cursor, once each and in order, live until the task ends.

The stream is ws(s)://host/ws/tasks/<id>/?after=N (tasks/consumers.py): one JSON frame per
event, then `{"type": "end", ...}` when the task has ended. Whatever happens to the socket,
the follower reconnects with the last seq it handed out and drops anything at or below it,
so a caller never sees an event twice and never misses one:

- closed with 4429 (too far behind): reconnect at once;
- closed with 4429 after a close frame with `retry_after` (this user's or tenant's live streams are at
  their limit): poll instead, which no limit refuses and which carries the same events;
- closed with 4403 (no longer a member of the task's tenant): the API's own error;
- dropped, or the server restarting: reconnect with backoff, for up to `reconnect_for`
  seconds of the server not answering at all;
- a socket the server will not serve (4401: this server's stream takes sessions, not tokens;
  a refused handshake; a proxy that does not pass WebSockets): poll GET .../events instead,
  which carries the same events with the same cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Origin

from longhaul.calls import Settings
from longhaul.errors import ConnectionFailed, ServerError
from longhaul.shapes import TERMINAL, End, Event

if TYPE_CHECKING:
    from longhaul.client import AsyncClient

log = logging.getLogger("longhaul.follow")

WEBSOCKET, POLLING = "websocket", "polling"
POLL_PAGE = 1000  # the events endpoint's largest page
# How often a sync follower's caller wakes while it waits for the next event. Python runs a signal's handler (Ctrl-C's
# KeyboardInterrupt) on the main thread, between two of its bytecodes: a Ctrl-C that comes as the thread is about to
# wait, or that the kernel gives to the follower's thread, does not end a wait with no timeout, and a queued task
# may say nothing for minutes.
WAKE_EVERY = 0.25
MAX_FRAME_BYTES = 16 * 2**20  # an event's data is small; a generous cap still bounds memory
# Sockets that fail while the REST API answers, in a row, before the follower stops trying them.
MAX_SOCKET_FAILURES = 3
# Close codes of the stream protocol (tasks.streams.CloseCode).
BAD_REQUEST, UNAUTHENTICATED, FORBIDDEN, NOT_FOUND, TOO_MANY = 4400, 4401, 4403, 4404, 4429


class Follow:
    """`async for event in follow`: the events; afterwards `end` holds the end message.

    `cursor` is the last seq handed out: pass it as `after` to pick up where this left off.
    """

    def __init__(self, client: AsyncClient, task_id: str, *, after: int = 0) -> None:
        self.client = client
        self.settings = client.settings
        self.task_id = task_id
        self.cursor = after
        self.end: End | None = None
        self.transport = WEBSOCKET if self.settings.use_websocket else POLLING
        self.connections = 0  # sockets opened: more than one means it reconnected
        self._socket_failures = 0
        self._down_since: float | None = None
        self._close_frame: dict[str, Any] = {}  # the server's last word before it closes, if it said one

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while self.end is None:
            try:
                if self.transport == WEBSOCKET:
                    async for event in self._socket():
                        yield event
                else:
                    fresh = False
                    async for event in self._poll():
                        fresh = True
                        yield event
                    if self.end is None and not fresh:
                        await asyncio.sleep(self.settings.poll_interval)
            except (ConnectionFailed, ServerError) as exc:
                await self._wait_for_server(exc)

    def _accept(self, event: Event) -> bool:
        # The one place that decides "new": anything at or below the cursor was handed out already.
        if event["seq"] <= self.cursor:
            return False
        self.cursor = event["seq"]
        return True

    async def _open(self) -> ClientConnection:
        headers = {k: v for k, v in self.settings.headers().items() if k in ("Authorization", "User-Agent")}
        return await connect(
            self.settings.stream_url(self.task_id, self.cursor),
            # The server checks Origin against its allowed hosts, as for a browser.
            origin=Origin(self.settings.url),
            additional_headers=headers,
            open_timeout=self.settings.timeout,
            max_size=MAX_FRAME_BYTES,
            user_agent_header=None,
        )

    async def _socket(self) -> AsyncIterator[Event]:
        try:
            socket = await self._open()
        except InvalidStatus as exc:
            self._stop_using_socket(f"the server refused the stream (HTTP {exc.response.status_code})")
            return
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            # Down, or only the socket broken? The REST API tells: it raises ConnectionFailed if down.
            async for event in self._poll():
                yield event
            self._socket_failed(f"cannot open the stream ({exc or type(exc).__name__})")
            return
        self.connections += 1
        self._down_since = None
        log.info("stream open after seq %d", self.cursor)
        async with socket:
            try:
                while True:
                    frame: dict[str, Any] = json.loads(await socket.recv())
                    if frame.get("type") == "end":
                        self.end = frame  # type: ignore[assignment]
                        return
                    if frame.get("type") == "close":
                        self._close_frame = frame
                        continue
                    if "seq" in frame and self._accept(frame):  # type: ignore[arg-type]
                        self._socket_failures = 0
                        yield frame  # type: ignore[misc]
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else 1006
        await self._closed(code)

    async def _closed(self, code: int) -> None:
        said, self._close_frame = self._close_frame, {}
        if code == TOO_MANY and "retry_after" in said:
            self._stop_using_socket(f"the server refused another live stream ({said.get('reason', 'at its limit')})")
        elif code == TOO_MANY:
            log.info("the server asked to reconnect (behind); resuming after seq %d", self.cursor)
        elif code == UNAUTHENTICATED:
            self._stop_using_socket("the server's stream does not take this token")
        elif code in (NOT_FOUND, FORBIDDEN):
            await self.client.get(self.task_id)  # raises NotFound with the API's own words
            self._stop_using_socket("the stream did not find the task")
        elif code == BAD_REQUEST:
            self._stop_using_socket("the stream refused the request")
        else:
            log.warning("stream closed (%d); resuming after seq %d", code, self.cursor)
            self._socket_failed(f"stream closed with {code}")
            if self._socket_failures > 1:
                await asyncio.sleep(self.settings.backoff_delay(self._socket_failures - 2))

    def _socket_failed(self, reason: str) -> None:
        self._socket_failures += 1
        if self._socket_failures >= MAX_SOCKET_FAILURES:
            self._stop_using_socket(reason)

    def _stop_using_socket(self, reason: str) -> None:
        log.warning("%s; polling events after seq %d instead", reason, self.cursor)
        self.transport = POLLING

    async def _poll(self) -> AsyncIterator[Event]:
        """One round: every event after the cursor, then whether the task has ended."""
        while True:
            page = await self.client.events(self.task_id, after=self.cursor, limit=POLL_PAGE)
            self._down_since = None
            for event in page["results"]:
                if self._accept(event):
                    yield event
            if len(page["results"]) < POLL_PAGE:
                break
        # Read after the events: a task that ended with nothing after the cursor has nothing more to say.
        task = await self.client.get(self.task_id)
        if task.get("status") in TERMINAL and self.cursor >= task.get("last_event_seq", 0):
            self.end = {"type": "end", "status": task["status"], "result_version": task.get("result_version", 0)}

    async def _wait_for_server(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        elif now - self._down_since > self.settings.reconnect_for:
            raise exc
        log.warning("%s; trying again", exc)
        await asyncio.sleep(min(self.settings.poll_interval, self.settings.reconnect_for / 10))


class SyncFollow:
    """Follow for the sync client: the async follower runs on its own event loop in a thread.

    Leaving the loop early (break, an exception, Ctrl-C) closes the stream; the task goes on.
    """

    def __init__(self, settings: Settings, task_id: str, *, after: int = 0) -> None:
        self.settings = settings
        self.task_id = task_id
        self.after = after
        self._follow: Follow | None = None

    @property
    def end(self) -> End | None:
        return self._follow.end if self._follow else None

    @property
    def cursor(self) -> int:
        return self._follow.cursor if self._follow else self.after

    @property
    def transport(self) -> str | None:
        return self._follow.transport if self._follow else None

    @property
    def connections(self) -> int:
        return self._follow.connections if self._follow else 0

    def __iter__(self) -> Iterator[Event]:
        from longhaul.client import AsyncClient

        items: queue.Queue[tuple[str, Any]] = queue.Queue()
        loop = asyncio.new_event_loop()

        async def pump() -> None:
            async with AsyncClient.from_settings(self.settings) as client:
                self._follow = client.follow(self.task_id, after=self.cursor)
                async for event in self._follow:
                    items.put(("event", event))

        def run() -> None:
            try:
                loop.run_until_complete(pumping)
                items.put(("done", None))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
                items.put(("error", exc))
            finally:
                loop.close()

        pumping = loop.create_task(pump())
        thread = threading.Thread(target=run, name=f"longhaul-follow-{self.task_id}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    kind, value = items.get(timeout=WAKE_EVERY)
                except queue.Empty:
                    continue
                if kind == "event":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            if thread.is_alive():
                with contextlib.suppress(RuntimeError):  # the loop closed in between: nothing to stop
                    loop.call_soon_threadsafe(pumping.cancel)
                thread.join(self.settings.timeout)
