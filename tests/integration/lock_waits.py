"""Waiting, in a test, for the moment another session blocks on a lock this one holds: the proof that the code
under test waits for it, with no fixed sleep standing in for that moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Whether some backend waits for a lock the backend with pid %s holds.
BLOCKED_SQL = "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)))"


def another_waits(fetchone: Callable[[str, list[Any]], Any], pid: int, *, within: float = 10.0) -> bool:
    """Whether another backend came to wait for a lock of backend `pid` within `within` seconds; `fetchone` runs
    a query on a session that holds no lock of its own in the way (not one waiting)."""
    ends = time.monotonic() + within
    while time.monotonic() < ends:
        if fetchone(BLOCKED_SQL, [pid])[0]:
            return True
        time.sleep(0.01)
    return False
