"""Long-lived MCP sessions: one per server and worker process, on one background event-loop thread.

A session (a connected `mcp.Client`: for stdio, a running server process) must be entered and left
by one task on one event loop, yet each gateway job runs its own `asyncio.run()`, and the chat agent
calls from threads with no loop at all. So every process that talks MCP gets one daemon thread
running an event loop; `run` hands a coroutine to it and awaits the outcome from any loop,
`run_sync` blocks for it. Sessions live there, keyed by a server's settings, so every call to a
server shares one connection. A forked worker (django-q2 forks) finds the parent's loop gone and
starts its own, and its own sessions.

This module keeps sessions alive and knows nothing of the protocol: tasks/mcp/client.py opens
them, decides when one is broken, and classifies what went wrong.

    session = await sessions.get(key, opener, timeout_s=30)    # on the sessions loop
    with session.call():                                       # in flight until the block ends
        ...session.client...
    session.fail(error)      # broken: cancel its calls (they raise `error`), close it, forget it
    session.retire()         # forget it; close it once its calls are done
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Coroutine, Hashable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import anyio

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_C = TypeVar("_C")
CLOSE_TIMEOUT_S = 5.0


class Session(Generic[_C]):
    """One open connection (`client`), kept open by a runner task on the sessions loop."""

    def __init__(self, key: Hashable, opener: Callable[[Session[_C]], AbstractAsyncContextManager[_C]]) -> None:
        self.key = key
        self.client: _C | None = None
        self.error: BaseException | None = None  # why it could not open, or why it broke
        self._opener = opener
        self._opened = anyio.Event()  # set once open, or once opening failed
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._runner = anyio.CancelScope()
        self._calls: set[anyio.CancelScope] = set()
        self._retired = False

    @property
    def usable(self) -> bool:
        return self.client is not None and self.error is None and not self._retired and not self._stop.is_set()

    async def run(self, open_timeout_s: float) -> None:
        """The runner: open the connection, hold it until asked to stop, close it (all in this task)."""
        self._runner.deadline = anyio.current_time() + open_timeout_s
        try:
            with self._runner:
                async with self._opener(self) as client:
                    self.client = client
                    self._runner.deadline = math.inf
                    self._opened.set()
                    await self._stop.wait()
            if self._runner.cancelled_caught and self.client is None and self.error is None:
                self.error = TimeoutError(f"no connection within {open_timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - any failure is the session's error, raised to its callers
            if self.error is None:
                self.error = exc
            if self.client is not None:
                log.info("MCP session %s closed with an error: %r", _describe(self.key), exc)
        finally:
            self._retire_now()
            self._opened.set()
            self._stopped.set()

    async def opened(self) -> None:
        """Wait until open; raises what stopped it from opening."""
        await self._opened.wait()
        if self.client is None or self.error is not None:
            raise self.error or RuntimeError("the session closed before it opened")

    @contextlib.contextmanager
    def call(self) -> Iterator[anyio.CancelScope]:
        """One call in flight on this session; `fail` cancels its scope. Must be entered on the sessions loop."""
        scope = anyio.CancelScope()
        self._calls.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._calls.discard(scope)
            if self._retired and not self._calls:
                self._stop.set()

    def fail(self, error: BaseException) -> None:
        """The connection is broken: its calls in flight end (their scope is cancelled) and it closes."""
        if self.error is None:
            self.error = error
        for scope in list(self._calls):
            scope.cancel()
        self._retire_now()
        self._stop.set()

    def retire(self) -> None:
        """Take no more calls; close once the calls in flight are done."""
        self._retire_now()
        if not self._calls:
            self._stop.set()

    async def close(self) -> None:
        """Close now (calls in flight are cancelled) and wait until closed."""
        self.fail(self.error or RuntimeError("the session was closed"))
        with anyio.move_on_after(CLOSE_TIMEOUT_S):
            await self._stopped.wait()
        self._runner.cancel()  # a transport that would not close in time

    def _retire_now(self) -> None:
        self._retired = True
        if _pool is not None and _pool.get(self.key) is self:
            del _pool[self.key]


# --- the loop thread ---------------------------------------------------------------------------------

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_pid: int | None = None
_pool: dict[Hashable, Session[Any]] | None = None  # only touched on the sessions loop
_tasks: set[asyncio.Task[Any]] = set()  # runner tasks, kept referenced while they run


def _sessions_loop() -> asyncio.AbstractEventLoop:
    """This process's sessions loop, started on first use (and again in a forked child)."""
    global _loop, _loop_thread, _loop_pid, _pool
    with _lock:
        if _loop is None or _loop_pid != os.getpid():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="mcp-sessions", daemon=True)
            thread.start()
            _loop, _loop_thread, _loop_pid, _pool = loop, thread, os.getpid(), {}
        return _loop


def _forget_parent() -> None:
    # In a forked child the loop thread does not exist, and the lock may have been held by it.
    global _lock, _loop, _loop_thread, _loop_pid, _pool
    _lock = threading.Lock()
    _loop = _loop_thread = _loop_pid = _pool = None
    _tasks.clear()


os.register_at_fork(after_in_child=_forget_parent)


def _on_sessions_loop() -> bool:
    return _loop_thread is threading.current_thread() and _loop_pid == os.getpid()


async def run(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run `coroutine` on the sessions loop and await its outcome from any event loop.

    Cancelling the caller cancels the coroutine."""
    if _on_sessions_loop():
        return await coroutine
    future = asyncio.run_coroutine_threadsafe(coroutine, _sessions_loop())
    return await asyncio.wrap_future(future)


def run_sync(coroutine: Coroutine[Any, Any, _T], *, timeout_s: float | None = None) -> _T:
    """Run `coroutine` on the sessions loop and wait for its outcome, for code with no event loop."""
    if _on_sessions_loop():
        coroutine.close()
        raise RuntimeError("run_sync called on the MCP sessions loop, which would wait for itself")
    future = asyncio.run_coroutine_threadsafe(coroutine, _sessions_loop())
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise


# --- the pool ----------------------------------------------------------------------------------------


async def get(key: Hashable, opener: Callable[[Session[_C]], AbstractAsyncContextManager[_C]], *,
              timeout_s: float, name: str | None = None) -> Session[_C]:
    """The open session for `key`, opening one (through `opener`) when there is none or it broke.

    `name` groups keys of one server: a session for another key with the same name (the server's
    settings changed) is retired. Raises what opening raised. Call on the sessions loop."""
    assert _on_sessions_loop(), "sessions.get runs on the sessions loop"
    assert _pool is not None
    session = _pool.get(key)
    if session is None or (session.error is not None and session._opened.is_set()):
        if name is not None:
            for other in [s for k, s in _pool.items() if k != key and _name(k) == name]:
                other.retire()
        session = Session(key, opener)
        _pool[key] = session
        task = asyncio.get_running_loop().create_task(session.run(timeout_s), name=f"mcp-session {name or ''}")
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    await session.opened()
    return session


def _name(key: Hashable) -> Any:
    return key[0] if isinstance(key, tuple) and key else None


def _describe(key: Hashable) -> str:
    return repr(_name(key) if _name(key) is not None else "?")


async def _close_all() -> None:
    sessions = list((_pool or {}).values())
    for session in sessions:
        session.retire()
    async with anyio.create_task_group() as group:
        for session in sessions:
            group.start_soon(session.close)


def close_all() -> None:
    """Close this process's sessions (their calls in flight are cancelled); the next call opens anew."""
    if _loop is None or _loop_pid != os.getpid() or not _loop.is_running():
        return
    try:
        run_sync(_close_all(), timeout_s=CLOSE_TIMEOUT_S * 2)
    except Exception:
        log.exception("closing the MCP sessions failed")


def open_count() -> int:
    """How many sessions this process holds open, for tests."""
    return len(_pool or {}) if _loop_pid == os.getpid() else 0


atexit.register(close_all)
