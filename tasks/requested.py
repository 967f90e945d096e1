"""Calls requested, heard at once: a running gateway job listens on PostgreSQL for the commits that
insert operations (the statement trigger of migration 0023 notifies CHANNEL), so calls a step asked
for are claimed when that step commits, not at the job's next look a quarter of a second later.

Only a hint: a job that cannot listen (SQLite, or a connection refused) looks every LOOK_EVERY
seconds as before, and the step's own gateway kick still starts a job when none runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from django.db import connection

log = logging.getLogger(__name__)
CHANNEL = "longhaul_operations"
LOOK_EVERY = 0.25  # seconds between a running job's looks for due calls, heard of or not


def conninfo() -> str | None:
    """Where Django's default database is, for a connection of the listener's own (None: not PostgreSQL)."""
    if connection.vendor != "postgresql":
        return None
    from psycopg.conninfo import make_conninfo

    params = connection.get_connection_params()
    keep = {k: v for k, v in params.items() if k not in ("cursor_factory", "context", "prepare_threshold")}
    return make_conninfo("", **keep)


class Listener:
    """`heard` is set when calls were requested since it was last cleared."""

    def __init__(self) -> None:
        self.heard = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._connection: Any = None

    async def start(self, conninfo: str | None) -> None:
        """Listening once this returns (a commit from then on is heard), or not at all (it says why in the log)."""
        import psycopg

        if conninfo is None:
            return
        try:
            self._connection = await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
            await self._connection.execute(f"LISTEN {CHANNEL}")
        except (psycopg.Error, OSError) as exc:  # the job goes on looking every LOOK_EVERY seconds
            log.warning("gateway job: not listening for requested calls (%s)", exc)
            await self.stop()
            return
        self._task = asyncio.create_task(self._hear(self._connection))

    async def _hear(self, listening: Any) -> None:
        import psycopg

        try:
            async for _ in listening.notifies():
                self.heard.set()
        except (psycopg.Error, OSError) as exc:
            log.warning("gateway job: stopped listening for requested calls (%s)", exc)

    async def stop(self) -> None:
        """Stop listening and close the connection; never raises (it runs on the way out of a job)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
