"""Supervises the django-q2 cluster (`manage.py worker`): a dead process that may have wedged it
gets the whole cluster replaced, in place.

django-q2's workers share one `multiprocessing.Queue`, and an idle worker waits in `get()` holding
its read lock. A worker SIGKILLed there (the OOM killer's pick) never releases it: django-q2
respawns the worker, and every worker then blocks in `get()` for good: nothing runs again, and
nothing says so. Other locks of the cluster's queues fail the same way when their holder is killed.

So the guard (a Sentinel subclass) treats a death that may have left a lock held as fatal to the
cluster; it also notices due work that waits while every worker sits idle, whatever the cause.
Either way it logs why, drains its workers (tasks/drain.py: each finishes the job in hand), hands
the messages stuck in its queue back to the broker and exits with REPLACE_EXIT. The command's
main process then re-executes itself: same pid, so honcho and systemd see one process throughout.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta
from importlib import import_module
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from django import db
from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.cluster import Sentinel, get_mp_context, scheduler
from django_q.conf import Conf
from django_q.queues import Queue
from django_q.status import Stat

from tasks.errors import LonghaulError

log = logging.getLogger(__name__)

REPLACE_EXIT = 75  # EX_TEMPFAIL: the guard's exit code asking the main process to start afresh
STALL_SECONDS = 30.0  # above django-q2's own pusher back-off (10 s after a broker error)
# Ample for an ordinary step, and for a gateway thread's grace before it hands its calls back (tasks/drain.py);
# a worker busy for longer is killed, and its leases expire.
DRAIN_SECONDS = 10.0
PUSHER_SECONDS = 2.0  # above the longest wait of an idle pusher for a kick (tasks/broker.py: LISTEN_WAIT_SECONDS)
PROBE_EVERY = 1.0
RECYCLED = -2  # a worker's timer once django-q2 has recycled it (django_q/worker.py): it takes no more work
_PR_SET_PDEATHSIG = 1
# What a worker's jobs import beyond their own modules (kicks.JOBS): the gateway's HTTP client and its transport,
# providers and tools, and the MCP client.
WORKER_MODULES = ("httpx2", "aiohttp", "tasks.gateway.transport", "tasks.gateway.providers", "tasks.gateway.tools",
                  "tasks.mcp.client", "tasks.mcp.calls")


class ClusterWedged(LonghaulError):
    """The cluster may never take work again; it must be replaced."""


def run_cluster(*, stall_seconds: float = STALL_SECONDS) -> bool:
    """Runs one cluster until it ends; True when it must be replaced (the caller restarts in place)."""
    ctx = get_mp_context()
    stop_event, start_event = ctx.Event(), ctx.Event()
    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)
        # The guard then stops the cluster as qcluster does: workers finish their jobs. Not set() here:
        # it waits for the guard to wake, and a guard killed by the same signal (a whole service
        # group signalled at once) never does.
        threading.Thread(target=stop_event.set, name="longhaul-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _signal_children_on_death()
    freeze_what_workers_share()
    db.connections.close_all()  # the guard forks from here: share no database socket with it
    guard = ctx.Process(target=SupervisedSentinel, name=f"Process-{uuid.uuid4().hex}",
                        args=(stop_event, start_event, uuid.uuid4(), stall_seconds))
    started = time.monotonic()
    guard.start()
    guard.join()
    if stopping:
        return False
    if guard.exitcode != REPLACE_EXIT:  # the guard itself died: its children got SIGTERM from Linux
        log.warning("worker cluster replaced: its guard process %s %s; restarting pid %s in place with fresh "
                    "queues", guard.pid, _how_it_ended(guard.exitcode), os.getpid())
        if time.monotonic() - started < 5:
            time.sleep(1)  # a guard that cannot start must not make this a busy loop
    return True


def freeze_what_workers_share() -> None:
    """Import what jobs run, then move everything loaded so far out of the collector's sight.

    The workers fork from here and run for hundreds of jobs; without this, each full collection walked
    all of Django, the apps and the HTTP stack again: a gateway job holding 200 calls paused 130-225 ms
    every few seconds, with every call's socket waiting. Frozen objects are never collected, which is
    right for modules and classes that live as long as the process, and the pages holding them stay
    shared with the parent after the fork, since the collector no longer writes to them."""
    from tasks import drivers, kicks

    for dotted in (*{path.rpartition(".")[0] for path in kicks.JOBS.values()}, *WORKER_MODULES):
        import_module(dotted)
    drivers.available_kinds()  # the drivers' registry, imported at a task's first step otherwise
    gc.freeze()


def restart_in_place() -> NoReturn:
    """Replaces this process's program with a fresh run of the same command line (same pid)."""
    log.info("restarting pid %s in place: %s", os.getpid(), " ".join(sys.orig_argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


class SupervisedSentinel(Sentinel):
    """django-q2's guard process, replacing its cluster where django-q2 would respawn into locked queues."""

    def __init__(self, stop_event: Any, start_event: Any, cluster_id: uuid.UUID, stall_seconds: float) -> None:
        super().__init__(stop_event, start_event, cluster_id, start=False)
        self.task_queue = WatchedQueue(maxsize=Conf.QUEUE_LIMIT or 0)
        self.result_queue = WatchedQueue()
        self.stall_seconds = stall_seconds
        # Workers django-q2 recycled that have not ended yet: a gateway thread's calls out (tasks/gateway_thread.py)
        # keep the process until they are recorded; a new worker takes its place meanwhile.
        self.retiring: list[BaseProcess] = []
        self._taken = -1
        self._quiet_since = time.monotonic()
        self._next_probe = 0.0
        self.start()

    def start(self) -> None:
        try:
            super().start()
        except ClusterWedged as wedged:
            log.warning("worker cluster replaced: %s; restarting pid %s in place with fresh queues",
                        wedged, os.getppid())
            self.abandon()
            sys.exit(REPLACE_EXIT)

    def guard(self) -> None:
        """django-q2 1.11's guard loop, never waiting on a lock a dead process may hold, plus the stall watch."""
        self.start_event.set()
        Stat(self).save()
        log.info("worker cluster running under pid %s: workers %s, pusher %s, monitor %s", os.getppid(),
                 [p.pid for p in self.pool], self.pusher.pid, self.monitor.pid)
        cycle = Conf.GUARD_CYCLE
        since_schedule = 0.0
        while True:
            busy = False
            for process in list(self.pool):
                if not process.is_alive():
                    self.reincarnate(process)
                    continue
                lock = process.timer.get_lock()
                if not lock.acquire(timeout=cycle):
                    continue  # held by a worker killed just now: the next cycle finds it dead
                try:
                    if process.timer.value == 0:  # past its timeout: django-q2 terminates and replaces it
                        self.reincarnate(process)
                    elif process.timer.value == RECYCLED:
                        self.retire(process)
                    elif process.timer.value > 0:
                        process.timer.value -= cycle
                        busy = True
                finally:
                    lock.release()
            for process in (self.monitor, self.pusher):
                if not process.is_alive():
                    self.reincarnate(process)
            self.let_go_of_retired()
            self.watch_for_stall(busy=busy)
            since_schedule += cycle
            if since_schedule >= 30 and Conf.SCHEDULER:
                since_schedule = 0.0
                scheduler(broker=self.broker)
            Stat(self).save()
            if self.stop_event.wait(cycle):
                break
        self.stop()

    def reincarnate(self, process: BaseProcess) -> None:
        reason = self.unsafe_death(process)
        if reason is not None:
            raise ClusterWedged(reason)
        super().reincarnate(process)

    def retire(self, process: BaseProcess) -> None:
        """A worker django-q2 recycled takes no more work (it has left the task queue) but may still be finishing
        its gateway thread's calls: a new worker takes its place now, not once it has ended."""
        self.pool.remove(process)
        self.retiring.append(process)
        db.connections.close_all()  # as django-q2 before it forks: share no database socket with the new worker
        self.spawn_worker()
        log.info("worker %s recycled while finishing its calls out: worker %s takes its place", process.pid,
                 self.pool[-1].pid)

    def let_go_of_retired(self) -> None:
        """Forget the recycled workers that have ended, each after the check a dead worker gets: one killed while
        its last result was still on its way out may have left the result queue locked."""
        for process in [process for process in self.retiring if not process.is_alive()]:
            self.retiring.remove(process)
            reason = self.unsafe_death(process)
            if reason is not None:
                raise ClusterWedged(reason)

    def stop(self) -> None:
        # django-q2 stops its workers through the task queue, which a dead process may have locked.
        reason = next(filter(None, map(self.unsafe_death, [*self.pool, self.pusher, self.monitor])), None)
        if reason is None:
            super().stop()
            self._drain_retiring()
            return
        log.warning("worker cluster stopping without its queues: %s", reason)
        self.abandon()

    def _drain_retiring(self) -> None:
        """Recycled workers still finishing their calls drain as a stopping worker does (tasks/drain.py)."""
        for worker in self.retiring:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + DRAIN_SECONDS
        for worker in self.retiring:
            worker.join(max(0.0, deadline - time.monotonic()))
            _kill(worker)
        self.retiring = []

    def unsafe_death(self, process: BaseProcess) -> str | None:
        """Why this process's death may have left a queue locked for good; None when it cannot have."""
        code = process.exitcode
        if code is None:
            return None
        role = "pusher" if process is self.pusher else "monitor" if process is self.monitor else "worker"
        if code < 0:
            return f"{role} {process.pid} {_how_it_ended(code)}"
        if role != "worker":
            return None  # django-q2's pusher and monitor leave their queues only through `with` blocks
        lock = process.timer.get_lock()
        if not lock.acquire(False):
            return f"worker {process.pid} {_how_it_ended(code)} while handing back a result"
        try:
            waiting = process.timer.value == -1
        finally:
            lock.release()
        # A worker signalled alone (SIGTERM) drains at once, possibly from inside Queue.get().
        return f"worker {process.pid} {_how_it_ended(code)} while waiting for work" if waiting else None

    def watch_for_stall(self, *, busy: bool) -> None:
        """Raises ClusterWedged when due work has waited while every worker sat idle and took nothing."""
        now = time.monotonic()
        taken = self.task_queue.taken.value
        if busy or taken != self._taken:
            self._taken, self._quiet_since = taken, now
            return
        quiet = now - self._quiet_since
        if quiet < self.stall_seconds or now < self._next_probe:
            return
        self._next_probe = now + PROBE_EVERY
        if self.task_queue.qsize() > 0 or self._due_work_waiting():
            raise ClusterWedged(f"due work waited {quiet:.0f} s while every worker sat idle")

    def _due_work_waiting(self) -> bool:
        if not isinstance(self.broker, ORM):
            return False
        due_before = timezone.now() - timedelta(seconds=self.stall_seconds)
        try:
            keys = getattr(self.broker, "keys", (self.broker.list_key,))  # tasks/broker.py: its queue, step kicks and gateway kicks
            return self.broker.get_connection().filter(key__in=keys, lock__lte=due_before).exists()
        except db.DatabaseError:
            log.debug("stall watch: the broker table is out of reach", exc_info=True)
            return False  # the pusher cannot reach it either; nothing a new cluster would do better

    def abandon(self) -> None:
        """Ends this cluster without its queues: workers drain, the rest is killed, unstarted messages go back."""
        self.event_out.set()
        self.pusher.join(PUSHER_SECONDS)  # it may be stuck putting into a full queue nobody reads
        _kill(self.pusher)
        workers = [p for p in [*self.pool, *self.retiring] if p.is_alive()]
        self.retiring = []
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)  # tasks/drain.py: finish the job in hand, then exit
        deadline = time.monotonic() + DRAIN_SECONDS
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                log.warning("worker %s still busy after %.0f s of draining: killed", worker.pid, DRAIN_SECONDS)
            _kill(worker)
        _kill(self.monitor)
        self.pool = []
        self._hand_back_unstarted()

    def _hand_back_unstarted(self) -> None:
        """Makes the messages no worker took due again now, instead of `retry` seconds after the pusher took them."""
        ack_ids = unstarted_ack_ids(self.task_queue)
        if not ack_ids or not isinstance(self.broker, ORM):
            return
        try:
            count = self.broker.get_connection().filter(pk__in=ack_ids).update(lock=timezone.now())
        except db.DatabaseError:
            log.warning("could not hand %d queued messages back; they return after `retry`", len(ack_ids),
                        exc_info=True)
            return
        log.info("handed %d queued messages back to the broker", count)


class WatchedQueue(Queue):
    """django-q2's queue, with a lock-free size and a count of the messages taken from it."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize=maxsize)
        # Without a lock on purpose: one held by a killed worker must not stop the guard. Two workers
        # racing may lose an increment, yet the value still changes, which is all the stall watch reads.
        self.taken = multiprocessing.RawValue("Q", 0)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        message = super().get(*args, **kwargs)
        self.taken.value += 1
        return message

    def qsize(self) -> int:
        return self.size.count.get_obj().value  # Stat reads this every cycle: never wait on a dead holder


def unstarted_ack_ids(queue: Queue) -> list[Any]:
    """Broker ids of the messages left in a dead cluster's queue, read from its pipe past the (maybe lost) lock."""
    reader = queue._reader  # every other process using this pipe is dead by now
    os.set_blocking(reader.fileno(), False)  # a message half-written by a killed pusher ends the read
    ack_ids = []
    while True:
        try:
            message = ForkingPickler.loads(reader.recv_bytes())
        except Exception:  # BlockingIOError when empty; a torn message when its writer was killed
            return ack_ids
        if isinstance(message, dict) and "ack_id" in message:
            ack_ids.append(message["ack_id"])


def _signal_children_on_death() -> None:
    """Asks Linux to SIGTERM every process forked from here on when its parent dies."""
    # A dead guard's workers then drain and exit instead of waiting on its queue forever, and a
    # dead main process takes its guard along.
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    os.register_at_fork(after_in_child=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM))


def _kill(process: BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join()


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
