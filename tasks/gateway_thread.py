"""A worker process's gateway job runs on a thread of its own, beside the jobs of its main thread.

A gateway job spends its slice (LONGHAUL_GATEWAY_SLICE_SECONDS) waiting on the network, with hundreds of
calls out on one event loop (tasks/operations.py). Run as the job itself, it held one of the process's
worker slots for the whole slice and then until its last call answered, and the steps its calls' results
made due queued behind the machine's other workers; on a machine of one worker, behind the calls. The job
now starts the event loop on a thread and returns: the worker goes on taking jobs while the calls are out.

One thread of a process holds a gateway turn at a time. A kick that comes meanwhile does nothing: that
thread claims what is due, as the job holding the turn did; so where a database has more than one turn
(LONGHAUL_GATEWAY_TURNS), the others go to other processes (two threads of one process that try at the same
moment may both take one: they share the process's cap). Otherwise a kick starts a thread, which tries
for the turn on a database connection of its own (operations.pump), beside a thread that has given the
turn back and only waits for its last calls. The calls out of all of them count against the process's one
cap (LONGHAUL_GATEWAY_INFLIGHT).

How such a thread ends with its process:
- a draining worker (SIGTERM, tasks/drain.py) counts it as a job in progress: the thread hands its calls
  back after the drain's grace, and the process exits once it has;
- a worker that ends by itself (django-q2 recycles it, or stops it with its cluster) runs finish() before
  Python's exit takes the thread pools the job works through: the thread claims nothing new and finishes
  the calls it has out, then the process exits;
- a thread still running a minute past its slice and its calls' operation lease (every call times out
  before that) is stuck, on a database or a socket that never answers: the process exits, and with it
  the turn's session. The supervisor takes it for a dead worker: it replaces it, or the whole cluster
  when it was waiting for work (tasks/supervisor.py), and its step in hand resumes when its lease expires.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  its exit hook must be registered before finish()'s, to run after
import functools
import logging
import os
import threading

from django.conf import settings

from tasks import drain, operations

log = logging.getLogger(__name__)

STUCK_MARGIN_SECONDS = 60.0
_lock = threading.Lock()
_claiming: threading.Thread | None = None  # this process's gateway thread that holds a turn
_started: list[threading.Thread] = []  # this process's gateway threads that may still run


def start() -> bool:
    """Run a gateway job on a new thread, unless a thread of this process holds a turn; True when started."""
    with _lock:
        if _claiming is not None:
            return False
        thread = threading.Thread(target=_run, name="longhaul-gateway")
        _started[:] = [t for t in _started if t.is_alive()]
    drain.job_began()  # here, not on the thread: a drain must not exit between this job's end and the thread's start
    try:
        thread.start()
    except BaseException:
        drain.job_ended()
        raise
    with _lock:
        _started.append(thread)
    return True


def holds_turn() -> bool:
    """Whether a gateway thread of this process holds a turn."""
    return _claiming is not None


def running() -> bool:
    """Whether a gateway thread of this process is still running."""
    with _lock:
        return any(thread.is_alive() for thread in _started)


def join(timeout: float | None = None) -> None:
    """Wait for this process's gateway threads to end. Harnesses that run jobs one after another (the
    property test) use it to see a gateway job's work done, as when the job was the thread's whole body."""
    with _lock:
        threads = list(_started)
    for thread in threads:
        thread.join(timeout)


def finish() -> None:
    """Before the process ends by itself: the gateway threads claim nothing new and finish their calls out."""
    drain.ending.set()
    join()


def _took_turn(thread: threading.Thread) -> None:
    global _claiming
    with _lock:
        _claiming = thread


def _stopped_claiming(thread: threading.Thread) -> None:
    """`thread` claims no more: the next kick may start another (a later thread's turn stands)."""
    global _claiming
    with _lock:
        if _claiming is thread:
            _claiming = None


def _run() -> None:
    me = threading.current_thread()
    stuck = threading.Timer(_stuck_after(), _stuck)
    stuck.daemon = True
    stuck.start()
    try:
        if operations.run_due(took_turn=functools.partial(_took_turn, me),
                              stopped_claiming=functools.partial(_stopped_claiming, me)) is None:
            log.debug("gateway thread: other jobs hold every turn")
    except Exception:  # a thread's exception would only reach stderr: log it as a failed job would be
        log.exception("gateway job failed")
    finally:
        stuck.cancel()
        _stopped_claiming(me)
        drain.job_ended()


def _stuck_after() -> float:
    return (settings.LONGHAUL_GATEWAY_SLICE_SECONDS + settings.LONGHAUL_OPERATION_LEASE_SECONDS
            + STUCK_MARGIN_SECONDS)


def _stuck() -> None:
    log.error("a gateway job ran for %.0f s, past any call's time: ending worker process %s", _stuck_after(),
              os.getpid())
    logging.shutdown()
    os._exit(1)


# Run at the start of Python's exit, before the hook of concurrent.futures (registered earlier, run later) stops
# every thread pool taking work: the job's database work and its event loop's look-ups go through them.
threading._register_atexit(finish)
