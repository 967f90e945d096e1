"""Threads of the streams' own for their database work, off the thread that Channels shares.

`database_sync_to_async` is thread-sensitive by default, and a consumer runs in no request
context, so every such call of every socket in a web process queues on asgiref's one
`SyncToAsync.single_thread_executor`, behind Channels' session look-ups and its per-message
hops. Stream reads and their authorization checks need no thread of their own, so they run
here instead: a few threads, each with its own queue, taken in turn.

Database connections: Django keeps one per thread. Around every call channels'
DatabaseSyncToAsync closes a connection that is broken or older than CONN_MAX_AGE, so these
threads follow the process's setting (the Procfile runs web processes with 0: a connection per
call) and a web process holds at most READ_THREADS connections for streams.
`close_connections` closes them, for tests before their database is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import ParamSpec, TypeVar

from channels.db import DatabaseSyncToAsync
from django.db import connections

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
            return await DatabaseSyncToAsync(partial(read, *args, **kwargs), thread_sensitive=False,
                                             executor=executor)()

        return run

    def close_connections(self) -> None:
        """Close every thread's database connections; blocks until they are closed."""
        for executor in self._executors:
            executor.submit(connections.close_all).result()


@cache
def read_threads() -> ReadThreads:
    """This process's read threads (started on first use)."""
    return ReadThreads(READ_THREADS)
