"""The sweeper: the safety net for lost kicks, stale queues and stalled tasks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django_q.models import OrmQ

from tasks import actions, clock, leases, sweeper
from tasks.models import Alert, AuditEntry, IdempotencyRecord, Task
from tasks.statuses import TaskStatus
from tests.factories import make_task, submit_sleep

S = TaskStatus
pytestmark = pytest.mark.django_db


def kicked_ids() -> list[int]:
    from django_q.signing import SignedPackage

    return [SignedPackage.loads(row.payload)["args"][0] for row in OrmQ.objects.all()]


def test_it_kicks_due_tasks_that_nobody_holds(acme, alice):
    now = clock.now()
    lost = make_task(acme, alice, status=S.RUNNING, next_run_at=now - timedelta(minutes=1))
    expired = make_task(acme, alice, status=S.RUNNING, next_run_at=now - timedelta(minutes=1),
                        lease_owner="dead:1", lease_expires_at=now - timedelta(seconds=1))
    make_task(acme, alice, status=S.RUNNING, next_run_at=now - timedelta(minutes=1),
              lease_owner="alive:2", lease_expires_at=now + timedelta(seconds=20))
    make_task(acme, alice, status=S.RETRY_WAIT, next_run_at=now + timedelta(minutes=5))
    OrmQ.objects.all().delete()
    assert sweeper.kick_due(now) == 2
    assert sorted(kicked_ids()) == sorted([lost.pk, expired.pk])


def test_it_fails_tasks_that_waited_past_their_queue_deadline(acme, alice):
    acme.max_running = 0
    acme.save()
    task = submit_sleep(acme, alice)
    with time_machine.travel(task.queue_deadline_at + timedelta(seconds=1), tick=False):
        counts = sweeper.run_once(now=clock.now())
    assert counts["queue_timeouts"] == 1
    task.refresh_from_db()
    assert task.status == S.FAILED
    assert task.error_class == "queue_timeout"
    assert "deadline" in task.error_message


def test_a_resumed_task_gets_a_new_queue_deadline_from_its_resume(acme, alice):
    """The queue deadline bounds a wait for a slot; a task paused for longer than that and resumed has
    only just started waiting."""
    acme.max_running = 1
    acme.save()
    submit_sleep(acme, alice)  # holds the slot
    task = actions.request_pause(submit_sleep(acme, alice), user=alice)
    assert task.status == S.PAUSED
    resumed_at = task.queue_deadline_at + timedelta(hours=1)
    with time_machine.travel(resumed_at, tick=False):
        actions.resume(task, user=alice)
        assert sweeper.run_once(now=clock.now())["queue_timeouts"] == 0
    task.refresh_from_db()
    assert task.status == S.QUEUED
    assert task.queue_deadline_at > resumed_at
    with time_machine.travel(task.queue_deadline_at + timedelta(seconds=1), tick=False):
        assert sweeper.run_once(now=clock.now())["queue_timeouts"] == 1


def test_a_task_queued_to_cancel_its_remote_work_is_left_to_its_cancel(acme, alice):
    acme.max_running = 0
    acme.save()
    task = make_task(acme, alice, kind="mcp", waiting_reason="cancel", cancel_requested_at=clock.now(),
                     queue_deadline_at=clock.now() - timedelta(seconds=1))
    counts = sweeper.run_once(now=clock.now())
    assert counts["queue_timeouts"] == 0
    assert counts["liveness_repairs"] == 0
    task.refresh_from_db()
    assert task.status == S.QUEUED


def test_it_admits_queued_tasks_when_slots_are_free_and_says_so(acme, alice):
    queued = make_task(acme, alice, status=S.QUEUED)  # staged: queued without the admission its transition does
    counts = sweeper.run_once(now=clock.now())
    assert counts["liveness_repairs"] == 1
    assert Task.objects.get(pk=queued.pk).status == S.RUNNING
    [alert] = Alert.objects.filter(kind=Alert.Kind.LIVENESS)
    assert alert.rule == "admission_missed" and alert.task_id == queued.pk


def test_the_admission_repair_names_only_the_tasks_that_waited_beside_a_free_slot(acme, alice, globex, charlie,
                                                                                  settings):
    # Four slots: acme holds three (between steps), one is free, and globex has three queued, staged without the
    # admission their transitions would have run. The repair fills the free slot; the slots the weights say globex
    # is owed besides are taken back by the next admission, not reported as slots that were free.
    settings.LONGHAUL_MAX_RUNNING = 4
    for _ in range(3):
        make_task(acme, alice, status=S.RUNNING)
    globex_queued = [make_task(globex, charlie, status=S.QUEUED) for _ in range(3)]
    counts = sweeper.run_once(now=clock.now())
    alerts = list(Alert.objects.filter(kind=Alert.Kind.LIVENESS).values_list("rule", "task_id"))
    assert alerts == [("admission_missed", globex_queued[0].pk)]
    assert counts["liveness_repairs"] == 1
    assert Task.objects.filter(tenant=globex, status=S.RUNNING).count() == 1


def test_a_fresh_heartbeat_with_stale_progress_is_flagged_once(acme, alice, settings):
    task = submit_sleep(acme, alice)
    start = clock.now()
    leases.claim(task.pk, owner="busy:1", now=start)
    later = start + timedelta(seconds=settings.LONGHAUL_STALL_SECONDS + 5)
    with time_machine.travel(later, tick=False):
        assert leases.renew(task.pk, owner="busy:1", token=1, now=clock.now())
        assert sweeper.flag_stalled(clock.now()) == 1
        assert sweeper.flag_stalled(clock.now()) == 0
    task.refresh_from_db()
    assert task.stalled_at is not None
    assert task.events.filter(kind="stalled").count() == 1
    assert AuditEntry.objects.filter(action="task.stalled", target_id=str(task.public_id)).exists()


def test_a_task_that_progresses_is_not_flagged(acme, alice, settings):
    task = submit_sleep(acme, alice)
    leases.claim(task.pk, owner="busy:1", now=clock.now())
    Task.objects.filter(pk=task.pk).update(last_progress_at=clock.now())
    assert sweeper.flag_stalled(clock.now()) == 0


def test_it_forgets_expired_idempotency_keys(acme, alice):
    task = submit_sleep(acme, alice, key="k")
    assert IdempotencyRecord.objects.count() == 1
    with time_machine.travel(clock.now() + timedelta(days=2), tick=False):
        assert sweeper.forget_expired_keys(clock.now()) == 1
    assert Task.objects.filter(pk=task.pk).exists(), "forgetting a key keeps the task"
