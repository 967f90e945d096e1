"""Races between processes, on real PostgreSQL connections (one per thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.db import connection, transaction

from tasks import actions, clock, jobs, leases, scheduling, transitions
from tasks.context import StepContext
from tasks.errors import LeaseLost
from tasks.events import NewEvent, append
from tasks.models import Checkpoint, SleepEffect, Task, TaskEvent
from tasks.statuses import HOLDS_SLOT, TaskStatus
from tests.factories import make_task, submit_sleep

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)


def in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call on its own thread (its own connection), released together by a barrier."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[i] = call()
        except Exception as exc:  # surfaced to the test below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_two_workers_racing_for_a_claim_exactly_one_wins(acme, alice):
    for _ in range(10):
        task = make_task(acme, alice, status=S.RUNNING)
        now = clock.now()
        results = in_parallel(*[lambda owner=o: leases.claim(task.pk, owner=owner, now=now) for o in ("w1", "w2")])
        winners = [r for r in results if isinstance(r, Task)]
        assert len(winners) == 1, results
        assert results.count(None) == 1
        fresh = Task.objects.get(pk=task.pk)
        assert fresh.fencing_token == 1
        assert fresh.lease_owner == winners[0].lease_owner


def test_a_claim_made_between_a_read_and_a_write_wins_over_the_stale_writer(acme, alice):
    task = make_task(acme, alice, status=S.RUNNING)
    stale = Task.objects.get(pk=task.pk)  # process A reads
    [other] = in_parallel(lambda: leases.claim(task.pk, owner="B", now=clock.now()))  # process B claims
    assert isinstance(other, Task)
    now = clock.now()
    with transaction.atomic():  # process A writes from its stale read
        won = transitions.claim(stale, owner="A", now=now, expires_at=now + timedelta(seconds=30))
    assert won is False
    assert Task.objects.get(pk=task.pk).lease_owner == "B"


def test_a_zombie_workers_writes_are_rejected_after_a_takeover(acme, alice):
    task = submit_sleep(acme, alice, steps=3, side_effect=True)
    zombie = leases.claim(task.pk, owner="zombie", now=clock.now())
    assert zombie is not None
    later = clock.now() + timedelta(seconds=60)
    with time_machine.travel(later, tick=False):
        successor = leases.claim(task.pk, owner="successor", now=clock.now())
    assert successor is not None
    assert successor.fencing_token == zombie.fencing_token + 1
    assert list(successor.events.filter(kind="recovered").values_list("data", flat=True)) == [{"step": 0}]

    ctx = StepContext(zombie, token=zombie.fencing_token)
    with pytest.raises(LeaseLost):
        ctx.operation("sleep_effect", lambda: {"step": 1}, args={"step": 1}, side_effect=True)
    with pytest.raises(LeaseLost), transaction.atomic():
        ctx.fence()
        SleepEffect.objects.create(task_id=task.pk, step=1, at=clock.now())
    from tasks import runner
    from tasks.drivers import Continue, get_driver

    with pytest.raises(LeaseLost):
        runner._commit(zombie, zombie.fencing_token, get_driver("sleep"), Continue({"done": 1, "of": 3}), ctx,
                       keep_lease=False)
    assert not Checkpoint.objects.filter(task=task).exists()
    assert not SleepEffect.objects.filter(task=task).exists()
    assert Task.objects.get(pk=task.pk).lease_owner == "successor"


def test_an_expired_lease_is_reclaimed_and_the_task_finishes(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_sleep(acme, alice, steps=2, side_effect=True)
    assert leases.claim(task.pk, owner="died", now=clock.now()) is not None
    jobs.advance(task.pk)  # a live lease: nothing happens
    assert Task.objects.get(pk=task.pk).current_step == 0
    with time_machine.travel(clock.now() + timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS + 1), tick=True):
        jobs.advance(task.pk)
        jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == S.SUCCEEDED
    assert SleepEffect.objects.filter(task=task).count() == 2


def test_duplicate_kicks_execute_a_step_once(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_sleep(acme, alice, steps=2, step_seconds=0.3, side_effect=True)
    results = in_parallel(*[lambda: jobs.advance(task.pk)] * 3)
    assert all(r is None for r in results), results
    task.refresh_from_db()
    # A kick that arrives after step 1 committed may run step 2 (it is due); none repeats a step.
    assert task.current_step in (1, 2)
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == list(
        range(1, task.current_step + 1))
    effects = list(SleepEffect.objects.filter(task=task).values_list("step", flat=True))
    assert sorted(effects) == list(range(1, task.current_step + 1))


def test_events_stay_gapless_under_concurrent_writers(acme, alice):
    task = make_task(acme, alice, status=S.RUNNING)

    def writer(n: int) -> None:
        for i in range(20):
            with transaction.atomic():
                fresh = Task.objects.get(pk=task.pk)
                append(fresh, [NewEvent("probe", {"writer": n, "i": i})], status=fresh.status, at=clock.now())

    results = in_parallel(*[lambda n=n: writer(n) for n in range(4)])
    assert all(r is None for r in results), results
    seqs = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, 81))
    assert Task.objects.get(pk=task.pk).last_event_seq == 80


def test_concurrent_submissions_with_one_key_create_one_task(acme, alice):
    def submit() -> tuple[int, bool]:
        task, created = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
            kind="sleep", input={"steps": 1}, idempotency_key="same-key"))
        return task.pk, created

    results = in_parallel(*[submit] * 4)
    assert all(isinstance(r, tuple) for r in results), results
    assert len({pk for pk, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert Task.objects.count() == 1


def test_concurrent_admissions_never_exceed_the_tenant_quota(acme, alice):
    acme.max_running = 1
    acme.save()
    for _ in range(4):
        make_task(acme, alice, status=S.QUEUED)

    def admit() -> list[int]:
        with transaction.atomic():
            return scheduling.admit(now=clock.now())

    results = in_parallel(admit, admit, admit)
    assert sum(len(r) for r in results) == 1, results
    assert Task.objects.filter(tenant=acme, status__in=HOLDS_SLOT).count() == 1


def test_two_delivery_jobs_claim_one_notification_and_one_wins(acme, alice):
    from chat.models import Thread
    from tasks import notifications

    thread = Thread.objects.create(tenant=acme, owner=alice)
    task = make_task(acme, alice, status=S.SUCCEEDED, thread=thread, event_version=1,
                     notification_status="pending", next_notification_at=clock.now())
    now = clock.now()
    results = in_parallel(*[lambda o=o: notifications.claim(task.pk, owner=o, now=now) for o in ("d1", "d2")])
    winners = [r for r in results if isinstance(r, notifications.Delivery)]
    assert len(winners) == 1, results
    assert winners[0].key == f"task:{task.pk}:1:1", "version 1, the first delivery"
    assert Task.objects.get(pk=task.pk).notification_status == "claimed"
