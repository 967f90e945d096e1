"""Waiting, in a test, for the moment another session blocks on a lock this one holds: the proof that the code
under test waits for it, with no fixed sleep standing in for that moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Whether some backend waits for a lock the backend with pid %s holds.
BLOCKED_SQL = "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)))"
# How many of this database's backends wait for a lock: the second to wait for a row waits for the first, not for
# the row's holder, so it is counted here and not by BLOCKED_SQL.
WAITING_SQL = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
               "AND cardinality(pg_blocking_pids(pid)) > 0")


def another_waits(fetchone: Callable[[str, list[Any]], Any], pid: int, *, within: float = 10.0) -> bool:
    """Whether another backend came to wait for a lock of backend `pid` within `within` seconds; `fetchone` runs
    a query on a session that holds no lock of its own in the way (not one waiting)."""
    return _comes(lambda: bool(fetchone(BLOCKED_SQL, [pid])[0]), within)


def waiting_reach(fetchone: Callable[[str, list[Any]], Any], count: int, *, within: float = 10.0) -> bool:
    """Whether `count` backends of the database came to wait for a lock within `within` seconds (`fetchone` as
    above)."""
    return _comes(lambda: fetchone(WAITING_SQL, [])[0] >= count, within)


def _comes(condition: Callable[[], bool], within: float) -> bool:
    ends = time.monotonic() + within
    while time.monotonic() < ends:
        if condition():
            return True
        time.sleep(0.01)
    return False
