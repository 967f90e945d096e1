"""Admission: fair shares across tenants, priority with aging, event-driven slot refills."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
import time_machine
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from tasks import actions, clock, jobs, requested, scheduling, sweeper
from tasks.models import Task, TaskEvent, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus
from tests.factories import make_task, submit_sleep

S = TaskStatus
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _one_step_per_advance(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    settings.LONGHAUL_AGING_SECONDS = 60


def admit() -> list[int]:
    with transaction.atomic():
        return scheduling.admit(now=clock.now())


def running(tenant: Tenant) -> int:
    return Task.objects.filter(tenant=tenant, status__in=HOLDS_SLOT).count()


def admission_order(after_event_id: int = 0) -> list[int]:
    """Tenant ids of admissions, in the order they happened."""
    return list(TaskEvent.objects.filter(kind="admitted", id__gt=after_event_id).order_by("id")
                .values_list("tenant_id", flat=True))


def finish_oldest_running() -> Task:
    """End the running task admitted first by running its (only) step, as a worker would; a task
    admission asked to give its slot back queues again instead (its step boundary comes first)."""
    event = (TaskEvent.objects.filter(kind="admitted", task__status=S.RUNNING).order_by("id")
             .select_related("task").first())
    assert event is not None, "nothing is running"
    asked = event.task.yield_requested_at is not None
    jobs.advance(event.task_id)
    event.task.refresh_from_db()
    if asked:  # queued again, and admitted again at once when its tenant was the one owed the slot by then
        assert any(e.data.get("reason") == "yielded" for e in event.task.events.filter(kind="queued"))
        assert event.task.status in (S.QUEUED, S.RUNNING)
    else:
        assert event.task.status == S.SUCCEEDED
    return event.task


@pytest.mark.smoke
def test_it_admits_the_highest_priority_then_the_oldest(acme, alice):
    acme.max_running = 0
    acme.save()
    old_low = submit_sleep(acme, alice)
    old_high = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="sleep", input={"steps": 1}, priority=5))[0]
    new_high = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="sleep", input={"steps": 1}, priority=5))[0]
    Tenant.objects.filter(pk=acme.pk).update(max_running=2)
    assert admit() == [old_high.pk, new_high.pk]
    Tenant.objects.filter(pk=acme.pk).update(max_running=3)
    assert admit() == [old_low.pk]


@pytest.mark.smoke
def test_a_slot_freed_by_one_tenant_goes_to_the_tenant_furthest_below_its_share(acme, alice, globex, charlie,
                                                                                 settings):
    settings.LONGHAUL_MAX_RUNNING = 2
    settings.LONGHAUL_TAKE_SLOTS_BACK = False  # a slot freed by a task ending (test_scheduling_take_back: the rest)
    first = submit_sleep(acme, alice, steps=1)
    submit_sleep(acme, alice, steps=1)
    submit_sleep(acme, alice, steps=1)  # queued: the system is full
    theirs = submit_sleep(globex, charlie, steps=1)
    assert theirs.status == S.QUEUED
    jobs.advance(first.pk)  # acme's task ends: acme holds 1 slot, globex 0
    theirs.refresh_from_db()
    assert theirs.status == S.RUNNING
    assert running(acme) == 1


def test_a_tenant_with_two_hundred_queued_tasks_does_not_starve_one_with_five(acme, alice, globex, charlie,
                                                                              settings):
    settings.LONGHAUL_MAX_RUNNING = 4
    settings.LONGHAUL_TAKE_SLOTS_BACK = False  # slots freed by tasks ending (test_scheduling_take_back: the rest)
    acme.max_queued = 1000
    acme.save()
    for _ in range(200):
        submit_sleep(acme, alice, steps=1)
    since = TaskEvent.objects.latest("id").id
    theirs = [submit_sleep(globex, charlie, steps=1) for _ in range(5)]
    assert all(t.status == S.QUEUED for t in theirs), "the system cap was full when globex arrived"

    while Task.objects.filter(tenant=globex, status=S.QUEUED).exists():
        finish_oldest_running()

    order = admission_order(after_event_id=since)
    last_globex = max(i for i, tenant_id in enumerate(order) if tenant_id == globex.pk)
    acme_before = order[:last_globex].count(acme.pk)
    assert order[0] == globex.pk, "the first slot acme frees goes to globex, which holds none"
    assert acme_before < 20, f"globex waited behind {acme_before} of acme's admissions: {order}"
    # Equal weights: while both wait, slots alternate, so acme got at most one more than globex.
    assert acme_before <= 5, order


def test_slots_are_shared_by_weight(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 4
    Tenant.objects.filter(pk=acme.pk).update(max_running=0)  # let both queues fill first
    Tenant.objects.filter(pk=globex.pk).update(max_running=0, weight=3)
    for _ in range(8):
        submit_sleep(acme, alice, steps=1)
        submit_sleep(globex, charlie, steps=1)
    Tenant.objects.update(max_running=4)
    admit()
    assert (running(acme), running(globex)) == (1, 3)
    for _ in range(6):
        finish_oldest_running()
        assert (running(acme), running(globex)) == (1, 3)


def test_a_tenant_at_its_max_running_leaves_the_slot_to_others(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 4
    Tenant.objects.filter(pk=globex.pk).update(max_running=1)
    for _ in range(3):
        submit_sleep(globex, charlie, steps=1)
    for _ in range(6):
        submit_sleep(acme, alice, steps=1)
    assert (running(acme), running(globex)) == (3, 1)
    finish_oldest_running()  # globex's: its next task takes the slot, within its cap
    assert (running(acme), running(globex)) == (3, 1)
    finish_oldest_running()  # acme's: globex is at its cap, so acme refills it
    assert (running(acme), running(globex)) == (3, 1)


def test_a_pause_frees_the_slot_for_another_tenant(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 1
    mine = submit_sleep(acme, alice, steps=3)
    theirs = submit_sleep(globex, charlie, steps=1)
    assert (mine.status, theirs.status) == (S.RUNNING, S.QUEUED)
    actions.request_pause(mine, user=alice)
    theirs.refresh_from_db()
    assert theirs.status == S.RUNNING


def test_effective_priority_grows_one_point_per_aging_period():
    start = clock.now()
    assert scheduling.effective_priority(3, start, now=start + timedelta(seconds=59)) == 3
    assert scheduling.effective_priority(3, start, now=start + timedelta(seconds=60)) == 4
    assert scheduling.effective_priority(-10, start, now=start + timedelta(minutes=20)) == 10
    assert scheduling.effective_priority(0, start, now=start - timedelta(seconds=5)) == 0


def test_a_low_priority_task_is_admitted_within_its_aging_bound_while_high_priority_keeps_arriving(acme, alice):
    acme.max_running = 1
    acme.save()
    high, low, turn = 10, 0, timedelta(seconds=30)

    def submit(priority: int) -> Task:
        return actions.submit(tenant=acme, user=alice, submission=actions.Submission(
            kind="sleep", input={"steps": 1}, priority=priority))[0]

    with time_machine.travel(clock.now(), tick=False) as traveller:
        submit(high)
        waiting = submit(low)
        highs_first = 0
        for _ in range(40):  # a bounded number of turns: each, a new high arrives and a slot frees
            traveller.shift(turn)
            submit(high)
            finish_oldest_running()
            waiting.refresh_from_db()
            if waiting.status != S.QUEUED:
                break
            highs_first += 1
    admitted_at = waiting.events.get(kind="admitted").at
    waited = admitted_at - waiting.created_at
    bound = timedelta(seconds=(high - low) * 60)
    assert waited <= bound + turn, f"waited {waited}, beyond its aging bound {bound}"
    assert highs_first >= 10, "high priority still goes first while the low task is young"


def test_the_sweeper_fills_free_slots_system_wide_in_one_pass(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 3
    for tenant, user in ((acme, alice), (acme, alice), (globex, charlie), (globex, charlie)):
        make_task(tenant, user, status=S.QUEUED)
    assert sweeper.run_once(now=clock.now())["liveness_repairs"] == 3, "staged rows skipped their admission"
    assert sorted((running(acme), running(globex))) == [1, 2]


def test_a_worker_starting_under_a_raised_system_cap_fills_the_slots_it_frees(acme, alice, settings):
    # LONGHAUL_MAX_RUNNING is read at start: raised with tasks queued (and none ending soon), nothing else admits
    # them but the sweeper's repair, which alerts as for an admission missed.
    settings.LONGHAUL_MAX_RUNNING = 1
    for _ in range(3):
        submit_sleep(acme, alice, steps=10)
    assert running(acme) == 1
    settings.LONGHAUL_MAX_RUNNING = 3

    assert len(scheduling.admit_at_start()) == 2

    assert running(acme) == 3
    assert sweeper.run_once(now=clock.now())["liveness_repairs"] == 0


@pytest.mark.django_db(transaction=True)  # the submissions' admission locks are released by their commits
def test_a_worker_start_does_not_wait_for_ever_behind_a_stuck_admission(acme, alice, settings, monkeypatch, caplog):
    # A session stuck holding the admission lock (a process hung inside a transaction) must not keep the cluster,
    # and the sweeper in it, from starting: the start gives up on the lock and leaves the slots to the sweeper.
    settings.LONGHAUL_MAX_RUNNING = 1
    for _ in range(2):
        submit_sleep(acme, alice, steps=10)
    settings.LONGHAUL_MAX_RUNNING = 2
    monkeypatch.setattr(scheduling, "START_LOCK_TIMEOUT_S", 0.2)
    with psycopg.connect(requested.conninfo(), autocommit=True) as stuck:
        stuck.execute("SELECT pg_advisory_lock(%s)", [scheduling._ADMISSION_LOCK])
        assert scheduling.admit_at_start() == []
    assert "admission at start failed" in caplog.text
    assert running(acme) == 1, "left to the sweeper"
    assert len(scheduling.admit_at_start()) == 1, "and admitted once the lock is free"


def test_admission_reads_the_heads_of_queues_not_whole_queues(acme, alice, globex, charlie):
    Tenant.objects.update(max_running=0)
    for priority in (0, 1):
        make_task(acme, alice, priority=priority)
        make_task(globex, charlie, priority=priority)
    Tenant.objects.update(max_running=1)
    with CaptureQueriesContext(connection) as short_queues:
        assert len(admit()) == 2
    Task.objects.filter(status=S.RUNNING).update(status=S.SUCCEEDED)
    Tenant.objects.update(max_running=0)
    Task.objects.bulk_create(
        Task(tenant=tenant, owner=user, kind="sleep", name="filler", input={"steps": 1}, priority=priority,
             created_at=clock.now(), updated_at=clock.now())
        for tenant, user in ((acme, alice), (globex, charlie)) for priority in (0, 1) for _ in range(300)
    )
    Tenant.objects.update(max_running=1)
    with CaptureQueriesContext(connection) as long_queues:
        assert len(admit()) == 2
    assert len(long_queues) == len(short_queues)
    row_reads = [q["sql"] for q in long_queues.captured_queries
                 if q["sql"].startswith("SELECT") and '"tasks_task"."public_id"' in q["sql"]]
    assert not [sql for sql in row_reads if _cancel_probe(sql)], "nobody's task is queued to cancel: none is looked for"
    assert row_reads and all('"tasks_task"."id" IN (' in sql for sql in row_reads), "only heads are read, by id"


def _cancel_probe(sql: str) -> bool:
    return '"tasks_task"."public_id"' in sql and '"tasks_task"."waiting_reason" = \'cancel\'' in sql


def test_a_task_queued_to_cancel_goes_first_read_alone(acme, alice, globex, charlie):
    Tenant.objects.update(max_running=0)
    for priority in (-10, 5, 10):  # acme's oldest at -10 heads that level: the cancel's is found by its own probe
        make_task(acme, alice, priority=priority)
        make_task(globex, charlie, priority=priority)
    cancelling = make_task(acme, alice, priority=-10, waiting_reason="cancel", cancel_requested_at=clock.now())
    Tenant.objects.update(max_running=1)
    with CaptureQueriesContext(connection) as queries:
        admitted = admit()
    assert cancelling.pk in admitted, "its cancel frees the remote work it holds: it goes before any priority"
    probes = [q["sql"] for q in queries.captured_queries if _cancel_probe(q["sql"])]
    locked = " FOR UPDATE SKIP LOCKED" if connection.vendor == "postgresql" else ""  # SQLite locks no rows
    assert len(probes) == 1 and probes[0].endswith(f"LIMIT 1{locked}"), "acme's queue alone, for one row"


def test_a_tenant_with_one_task_queued_has_its_queue_read_once(acme, alice, globex, charlie):
    Tenant.objects.update(max_running=0)
    alone = make_task(acme, alice)
    several = [make_task(globex, charlie, priority=priority) for priority in (0, 1, 1)]
    Tenant.objects.update(max_running=4)
    with CaptureQueriesContext(connection) as queries:
        assert sorted(admit()) == sorted([alone.pk, *(task.pk for task in several)])
    queue_reads = [q["sql"] for q in queries.captured_queries if "WITH RECURSIVE levels" in q["sql"]]
    # acme's queue once; globex's at each of its three admissions, and once more to find it empty.
    assert len(queue_reads) == 1 + 4, queue_reads

