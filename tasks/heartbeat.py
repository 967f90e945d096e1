"""One heartbeat thread per worker process, renewing the leases of the steps it runs.

A heartbeat proves the process lives, not that the task moves: progress is
recorded separately (last_progress_at), and the sweeper flags the difference.
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections, connection

from tasks import clock, leases

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self) -> None:
        self._held: dict[int, tuple[str, int]] = {}
        self._lost: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, task_id: int, *, owner: str, token: int) -> None:
        with self._lock:
            self._held[task_id] = (owner, token)
            self._lost.discard(task_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="longhaul-heartbeat", daemon=True)
                self._thread.start()

    def drop(self, task_id: int) -> None:
        with self._lock:
            self._held.pop(task_id, None)
            self._lost.discard(task_id)

    def lost(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._lost

    def interval(self) -> float:
        return max(0.1, float(settings.LONGHAUL_LEASE_SECONDS) / 3)

    def beat_once(self) -> None:
        with self._lock:
            held = dict(self._held)
        now = clock.now()
        for task_id, (owner, token) in held.items():
            try:
                alive = leases.renew(task_id, owner=owner, token=token, now=now)
            except Exception:  # a database blip: the next beat tries again before expiry
                log.warning("heartbeat for task %s failed", task_id, exc_info=True)
                close_old_connections()
                continue
            if not alive:
                log.warning("task %s: lease lost (token %s)", task_id, token)
                with self._lock:
                    if self._held.get(task_id) == (owner, token):
                        self._lost.add(task_id)

    def _run(self) -> None:
        try:
            while not self._wake.wait(self.interval()):
                self.beat_once()
                connection.close()  # a beat every few seconds does not need to hold a connection between
        finally:
            connection.close()


heartbeat = Heartbeat()
