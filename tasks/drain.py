"""Drain on SIGTERM (deploys): a worker finishes or checkpoints its current step,
releases the lease and claims nothing new; another worker resumes the task.

The graceful path is SIGTERM to the qcluster main process (honcho, `kill PID`,
`docker stop`, systemd with KillMode=mixed): django-q2 stops fetching, lets each
worker finish its job, then exits. When SIGTERM reaches every process of the
service at once (systemd's default KillMode=control-group), django-q2's own
supervisor dies with it; each worker then notes the signal, finishes the job in
hand (which releases its lease) and exits, instead of dying mid-step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
draining = threading.Event()
_job_running = threading.Lock()


@contextmanager
def job() -> Iterator[None]:
    """Marks a job in progress, so a draining worker exits only between jobs."""
    with _job_running:
        yield


def install_in_worker(**_: Any) -> None:
    """django-q2 post_spawn receiver: runs in each new worker process."""
    draining.clear()
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if draining.is_set():
        return
    draining.set()
    log.info("worker %s draining: finishing the current step, claiming nothing new", os.getpid())
    threading.Thread(target=_exit_between_jobs, name="longhaul-drain", daemon=True).start()


def _exit_between_jobs() -> None:
    with _job_running:
        logging.shutdown()
        os._exit(0)
