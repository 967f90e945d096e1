"""Threads of the streams' own for their database work, off the thread that Channels shares.

`database_sync_to_async` is thread-sensitive by default, and a consumer runs in no request
context, so every such call of every socket in a web process queues on asgiref's one
`SyncToAsync.single_thread_executor`, behind Channels' session look-ups and its per-message
hops. Stream reads and their authorization checks need no thread of their own, so they run
here instead: a few threads, each with its own queue, taken in turn.

Database connections: Django keeps one per thread, and these threads keep theirs from one read to
the next, whatever CONN_MAX_AGE says. That setting is for the process's request threads, which come
and go (the Procfile runs web processes with 0); these stay, so a web process holds at most
READ_THREADS connections for streams (under the Procfile's setting, each read used to open one).
No health check before each read either (a round trip, about half of a wake-up's read with 200
subscribers): a connection that went bad while it waited (a database restart, an idle timeout) fails
its read, which then runs once more on a new one.
`close_connections` closes them, for tests before their database is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import ParamSpec, TypeVar

from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections

# Reads are short queries: a few threads keep the database busy without holding many connections.
READ_THREADS = 4
THREAD_NAME_PREFIX = "stream-read"

P = ParamSpec("P")
R = TypeVar("R")


class ReadThreads:
    """Runs synchronous database reads in a few dedicated threads, one call at a time per thread."""

    def __init__(self, size: int) -> None:
        # One queue per thread rather than one shared queue: close_connections must reach each thread.
        self._executors = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{THREAD_NAME_PREFIX}-{n}")
                           for n in range(size)]
        self._turns = itertools.cycle(self._executors)

    def to_async(self, read: Callable[P, R]) -> Callable[P, Awaitable[R]]:
        """`read` as a coroutine function that runs in the next thread in turn."""

        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            executor = next(self._turns)
            call = partial(contextvars.copy_context().run, _on_kept_connection, partial(read, *args, **kwargs))
            return await asyncio.get_running_loop().run_in_executor(executor, call)

        return run

    def close_connections(self) -> None:
        """Close every thread's database connections; blocks until they are closed."""
        for executor in self._executors:
            executor.submit(connections.close_all).result()


def _on_kept_connection(read: Callable[[], R]) -> R:
    """`read` on this thread's connection; once more on a new one if it failed because that one had gone bad."""
    try:
        return read()
    except (InterfaceError, OperationalError):
        kept = connections[DEFAULT_DB_ALIAS]
        if kept.connection is None or kept.is_usable():
            raise  # the read failed, not the connection
        kept.close()
        return read()


@cache
def read_threads() -> ReadThreads:
    """This process's read threads (started on first use)."""
    return ReadThreads(READ_THREADS)
