"""The worker command against worker deaths that wedge a plain qcluster: workers SIGKILLed while
idle, while busy, or all at once, and a pusher that stops pulling. The cluster is replaced in
place (same pid), every task finishes, and no side effect runs twice."""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from collections.abc import Iterable

import pytest

from tasks.models import Alert, SleepEffect, Task, TaskEvent
from tasks.statuses import TERMINAL, TaskStatus
from tests.acceptance.test_worker_crash import (
    FAST_RECOVERY,
    _alive,
    all_terminal,
    assert_gapless_events,
    worker_pid_of_a_running_step,
)
from tests.factories import submit_sleep
from tests.processes import Process, qcluster, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]

# django-q2 logs each process's pid at INFO ("... ready for work at 4242"): how the test tells
# workers from the pusher and the monitor.
ENV = {**FAST_RECOVERY, "Q_LOG_LEVEL": "INFO"}
REPLACED = "WARNING tasks.supervisor worker cluster replaced:"


def logged_pids(cluster: Process, what: str) -> list[int]:
    """Live processes of the cluster that django-q2 logged as `what` ("ready for work", "pushing tasks")."""
    ours = set(cluster.descendants())
    pids = [int(pid) for pid in re.findall(rf"{what} at (\d+)", cluster.output())]
    return [pid for pid in pids if pid in ours and _alive(pid)]


def wait_for_workers(cluster: Process, count: int, *, not_among: Iterable[int] = ()) -> list[int]:
    """The pids of `count` live workers, none of them in `not_among`."""
    old = set(not_among)
    found: list[int] = []

    def ready() -> bool:
        found[:] = [pid for pid in logged_pids(cluster, "ready for work") if pid not in old]
        return len(found) >= count

    wait_until(ready, timeout=30, interval=0.1, message=f"{count} workers")
    return found


def catch_a_running_step(cluster: Process) -> int:
    """The pid of a worker caught in the middle of a step."""
    caught: list[int] = []

    def catch() -> bool:
        pid = worker_pid_of_a_running_step(cluster)
        if pid is not None:
            caught.append(pid)
        return pid is not None

    wait_until(catch, timeout=30, interval=0.05, message="a worker mid-step")
    return caught[0]


def kill(pids: Iterable[int]) -> list[int]:
    killed = list(pids)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    return killed


def assert_replaced_in_place(cluster: Process, *, killed: list[int]) -> None:
    """The supervisor said why, and the same process now runs a fresh cluster."""
    assert cluster.popen.poll() is None, "the worker command is still running"
    lines = [line for line in cluster.output().splitlines() if REPLACED in line]
    assert lines, cluster.output()[-4000:]
    assert any(f"worker {pid} was killed by SIGKILL" in lines[0] for pid in killed), lines
    assert all(f"restarting pid {cluster.pid} in place" in line for line in lines), lines
    wait_for_workers(cluster, 2, not_among=killed)


def assert_every_task_succeeded_once(tasks: list[Task], *, steps: int) -> None:
    statuses = Counter(Task.objects.values_list("status", flat=True))
    assert statuses == {TaskStatus.SUCCEEDED: len(tasks)}, statuses
    effects = Counter(SleepEffect.objects.values_list("task_id", "step"))
    assert len(effects) == len(tasks) * steps
    assert max(effects.values()) == 1, "a side-effecting operation ran twice"
    assert_gapless_events()
    assert not Task.objects.exclude(lease_owner="").exists()


def test_it_replaces_the_cluster_when_idle_workers_are_killed(acme, alice, log_dir):
    with qcluster(log_dir, workers=2, **ENV) as cluster:
        idle = kill(wait_for_workers(cluster, 2))
        # Submitted at once: the old pusher may already queue these kicks where nobody reads.
        tasks = [submit_sleep(acme, alice, steps=2, side_effect=True) for _ in range(4)]
        wait_until(all_terminal, timeout=60, interval=0.3, message="every task to end")
        assert_replaced_in_place(cluster, killed=idle)
    assert_every_task_succeeded_once(tasks, steps=2)


def test_it_replaces_the_cluster_when_a_busy_and_an_idle_worker_are_killed(acme, alice, log_dir):
    acme.max_running = 1  # one worker mid-step, the other idle
    acme.save()
    tasks = [submit_sleep(acme, alice, steps=3, step_seconds=0.5, side_effect=True) for _ in range(3)]
    with qcluster(log_dir, workers=2, **ENV) as cluster:
        workers = wait_for_workers(cluster, 2)
        busy = catch_a_running_step(cluster)
        killed = kill([busy, *(pid for pid in workers if pid != busy)])
        wait_until(all_terminal, timeout=90, interval=0.3, message="every task to end")
        assert_replaced_in_place(cluster, killed=killed)
    assert_every_task_succeeded_once(tasks, steps=3)
    assert TaskEvent.objects.filter(kind="recovered").exists(), "the killed step was taken over"


def test_it_replaces_the_cluster_when_every_worker_is_killed_mid_step(acme, alice, log_dir):
    acme.max_running = 10
    acme.save()
    tasks = [submit_sleep(acme, alice, steps=4, step_seconds=0.3, side_effect=True) for _ in range(6)]
    with qcluster(log_dir, workers=2, **ENV) as cluster:
        workers = wait_for_workers(cluster, 2)
        wait_until(lambda: SleepEffect.objects.count() >= 4, timeout=60, message="a few steps")
        catch_a_running_step(cluster)
        killed = kill(workers)
        wait_until(all_terminal, timeout=90, interval=0.3, message="every task to end")
        assert_replaced_in_place(cluster, killed=killed)
    assert_every_task_succeeded_once(tasks, steps=4)
    assert TaskEvent.objects.filter(kind="recovered").exists(), "a killed step was taken over"


def test_it_replaces_a_cluster_that_leaves_due_work_waiting(acme, alice, log_dir):
    # No process dies here: the pusher just stops pulling (SIGSTOP), as a hung one would.
    with qcluster(log_dir, workers=2, command=("worker", "--stall-seconds", "2"), **ENV) as cluster:
        wait_for_workers(cluster, 2)
        wait_until(lambda: bool(logged_pids(cluster, "pushing tasks")), timeout=30, message="the pusher")
        os.kill(logged_pids(cluster, "pushing tasks")[0], signal.SIGSTOP)
        tasks = [submit_sleep(acme, alice, steps=2, side_effect=True) for _ in range(2)]
        wait_until(all_terminal, timeout=60, interval=0.3, message="every task to end")
        assert cluster.popen.poll() is None
        lines = [line for line in cluster.output().splitlines() if REPLACED in line]
        assert len(lines) == 1 and "while every worker sat idle" in lines[0], lines
    assert_every_task_succeeded_once(tasks, steps=2)


def test_a_worker_started_under_a_raised_cap_admits_what_waited_for_it(acme, alice, settings, log_dir):
    # LONGHAUL_MAX_RUNNING is read when a process starts: raised (here, only the worker's), tasks that queued
    # under the old cap get the new slots when the worker starts, not at the sweeper's repair (which alerts as
    # for an admission missed), nor when the running task ends.
    settings.LONGHAUL_MAX_RUNNING = 1
    tasks = [submit_sleep(acme, alice, steps=3, step_seconds=5) for _ in range(3)]
    assert Task.objects.filter(status=TaskStatus.QUEUED).count() == 2
    with qcluster(log_dir, workers=2, LONGHAUL_MAX_RUNNING="3", **FAST_RECOVERY):
        wait_until(lambda: not Task.objects.filter(pk__in=[t.pk for t in tasks], status=TaskStatus.QUEUED).exists(),
                   timeout=20, message="the queued tasks to be admitted")
        assert not Alert.objects.filter(kind=Alert.Kind.LIVENESS).exists(), "admitted by the sweeper's repair"
        assert not Task.objects.filter(pk__in=[t.pk for t in tasks], status__in=TERMINAL).exists(), \
            "admitted only when the running task ended"
