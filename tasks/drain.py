"""Drain on SIGTERM (deploys): a worker finishes or checkpoints its current step,
releases the lease and claims nothing new; another worker resumes the task.

The graceful path is SIGTERM to the qcluster main process (honcho, `kill PID`,
`docker stop`, systemd with KillMode=mixed): django-q2 stops fetching, lets each
worker finish its job, then exits. When SIGTERM reaches every process of the
service at once (systemd's default KillMode=control-group), django-q2's own
supervisor dies with it; each worker then notes the signal, finishes the job in
hand (which releases its lease) and exits, instead of dying mid-step. A gateway job (on a thread
beside the worker's jobs) stops claiming and gives its calls in flight GATEWAY_GRACE_SECONDS; a call
still out then (a remote server that hangs) is released for another worker, under the same key,
rather than waited for; the process exits once both are done.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
draining = threading.Event()
# Jobs in progress in this process: a worker's job on its main thread, and its gateway job's thread beside it
# (tasks/gateway_thread.py). The process exits only when none is.
_jobs_changed = threading.Condition()
_jobs_running = 0
# Set when the process is about to end by itself (django-q2 recycled or stopped its worker): a job on another
# thread claims nothing new and finishes what it has.
ending = threading.Event()
# How long a draining gateway job lets its calls in flight finish before it hands them back
# (tasks/operations.py); well inside the supervisor's drain timeout (tasks/supervisor.py DRAIN_SECONDS).
GATEWAY_GRACE_SECONDS = 3.0
_since: float | None = None


def start() -> None:
    """Begin draining this process: claim nothing new, finish (or hand back) what is in hand."""
    global _since
    if not draining.is_set():
        _since = time.monotonic()
        draining.set()


def grace_over() -> bool:
    """Whether a draining job has waited long enough for its calls in flight."""
    return draining.is_set() and (_since is None or time.monotonic() - _since >= GATEWAY_GRACE_SECONDS)


@contextmanager
def job() -> Iterator[None]:
    """Marks a job in progress, so a draining worker exits only between jobs. Jobs on several threads may be in
    progress at once; once the process is about to exit, a new one waits for that."""
    job_began()
    try:
        yield
    finally:
        job_ended()


def job_began() -> None:
    """A job is in progress from now (job() where it begins and ends on one thread; a job handed to a thread
    begins on the thread that hands it over, so no exit comes between the two)."""
    global _jobs_running
    with _jobs_changed:
        _jobs_running += 1


def job_ended() -> None:
    global _jobs_running
    with _jobs_changed:
        _jobs_running -= 1
        _jobs_changed.notify_all()


@contextmanager
def between_jobs() -> Iterator[None]:
    """Once no job is in progress, and while the block runs, none starts."""
    with _jobs_changed:
        _jobs_changed.wait_for(lambda: _jobs_running == 0)
        yield


def install_in_worker(**_: Any) -> None:
    """django-q2 post_spawn receiver: runs in each new worker process."""
    global _since
    draining.clear()
    _since = None
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if draining.is_set():
        return
    start()
    log.info("worker %s draining: finishing the current step, claiming nothing new", os.getpid())
    threading.Thread(target=_exit_between_jobs, name="longhaul-drain", daemon=True).start()


def _exit_between_jobs() -> None:
    with between_jobs():
        logging.shutdown()
        os._exit(0)
