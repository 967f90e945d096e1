"""A real qcluster, workers killed with SIGKILL mid-step: nothing is lost or done twice."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from django.db import connection

from tasks.models import SleepEffect, Task, TaskEvent
from tasks.statuses import TERMINAL, TaskStatus
from tests.factories import submit_sleep
from tests.processes import qcluster, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]

# Short leases so a dead worker's task is taken over within seconds; q timeout < retry.
FAST_RECOVERY = {
    "LONGHAUL_LEASE_SECONDS": "2",
    "LONGHAUL_Q_TIMEOUT": "6",
    "LONGHAUL_Q_RETRY": "8",
    "LONGHAUL_STEP_SLICE_MS": "0",
}


def worker_pid_of_a_running_step(cluster) -> int | None:
    """The pid in the lease of a task mid-step, if it is one of this cluster's processes."""
    ours = set(cluster.descendants())
    for owner in Task.objects.exclude(lease_owner="").values_list("lease_owner", flat=True):
        pid = int(owner.rsplit(":", 1)[1])
        if pid in ours:
            return pid
    return None


def all_terminal() -> bool:
    connection.close()  # see other processes' commits with a fresh snapshot
    return not Task.objects.exclude(status__in=TERMINAL).exists()


def assert_gapless_events() -> None:
    for task in Task.objects.all():
        seqs = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True))
        assert seqs == list(range(1, task.last_event_seq + 1)), f"task {task.pk}: {seqs}"


def test_killed_workers_lose_nothing_and_repeat_no_side_effect(acme, alice, log_dir):
    acme.max_running = 20
    acme.save()
    steps = 5
    tasks = [submit_sleep(acme, alice, steps=steps, step_seconds=0.25, side_effect=True) for _ in range(20)]
    kills = 0
    with qcluster(log_dir, workers=2, **FAST_RECOVERY) as cluster:
        for done_steps in (10, 40, 70):
            wait_until(lambda n=done_steps: SleepEffect.objects.count() >= n, timeout=120,
                       message=f"{done_steps} effects")
            wait_until(lambda: worker_pid_of_a_running_step(cluster) is not None, timeout=30,
                       interval=0.05, message="a worker mid-step")
            pid = worker_pid_of_a_running_step(cluster)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                kills += 1
        wait_until(all_terminal, timeout=180, interval=0.5, message="every task to end")
    assert kills >= 2
    statuses = Counter(Task.objects.values_list("status", flat=True))
    assert statuses == {TaskStatus.SUCCEEDED: len(tasks)}, statuses
    effects = Counter(SleepEffect.objects.values_list("task_id", "step"))
    assert len(effects) == len(tasks) * steps
    assert max(effects.values()) == 1, "a side-effecting operation ran twice"
    assert_gapless_events()
    assert TaskEvent.objects.filter(kind="recovered").count() >= 1, "a killed step was taken over"
    assert not Task.objects.exclude(lease_owner="").exists()


def test_a_step_that_always_kills_its_worker_ends_as_poison(acme, alice, log_dir):
    doomed = submit_sleep(acme, alice, steps=3, fail_at_step=2, fail_kind="crash")
    healthy = submit_sleep(acme, alice, steps=3, side_effect=True)
    with qcluster(log_dir, workers=2, LONGHAUL_MAX_ATTEMPTS="2", **FAST_RECOVERY):
        wait_until(all_terminal, timeout=120, interval=0.5, message="both tasks to end")
    doomed.refresh_from_db()
    healthy.refresh_from_db()
    assert doomed.status == TaskStatus.FAILED
    assert doomed.error_class == "poison"
    assert doomed.current_step == 1, "the step before the crash stays committed"
    assert healthy.status == TaskStatus.SUCCEEDED
    assert_gapless_events()


@pytest.mark.parametrize("target", ["main process", "every process"])
def test_sigterm_drains_workers_releasing_leases_and_losing_nothing(acme, alice, log_dir, target):
    acme.max_running = 10
    acme.save()
    tasks = [submit_sleep(acme, alice, steps=4, step_seconds=0.8, side_effect=True) for _ in range(6)]
    with qcluster(log_dir, workers=2, name="first", **FAST_RECOVERY) as cluster:
        wait_until(lambda: SleepEffect.objects.count() >= 3, timeout=60, message="a few steps")
        wait_until(lambda: worker_pid_of_a_running_step(cluster) is not None, timeout=30, interval=0.05,
                   message="a worker mid-step")
        workers = cluster.descendants()
        if target == "main process":  # honcho, docker stop, systemd KillMode=mixed
            os.kill(cluster.pid, signal.SIGTERM)
            wait_until(lambda: cluster.popen.poll() is not None, timeout=60, message="the cluster to exit")
        else:  # systemd's default: every process of the service at once
            os.killpg(cluster.pid, signal.SIGTERM)
            wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers),
                       timeout=60, message="the workers to exit")
            # django-q2's supervisor died with the same signal and cannot stop cleanly; what
            # matters here is what the workers left behind.
            cluster.stop(signal.SIGKILL)
    connection.close()
    assert not Task.objects.exclude(lease_owner="").exists(), "a drained worker released its lease"
    assert not Task.objects.filter(status=TaskStatus.FAILED).exists()
    with qcluster(log_dir, workers=2, name="second", **FAST_RECOVERY):
        wait_until(all_terminal, timeout=120, interval=0.5, message="every task to end")
    assert Counter(Task.objects.values_list("status", flat=True)) == {TaskStatus.SUCCEEDED: len(tasks)}
    effects = Counter(SleepEffect.objects.values_list("task_id", "step"))
    assert len(effects) == len(tasks) * 4 and max(effects.values()) == 1
    assert not TaskEvent.objects.filter(kind="recovered").exists(), "no lease had to expire"
    assert_gapless_events()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
