"""Concurrent admitters on real PostgreSQL connections (one per thread) never exceed a cap."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from tasks import clock, scheduling, transitions
from tasks.models import AdmissionRecord, Task, TaskEvent, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus
from tests.factories import make_task
from tests.processes import wait_until

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)


def on_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run a call on its own thread, hence its own database connection."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except Exception as exc:  # surfaced by the test's assertions
            result.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def waiting_on_an_advisory_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND wait_event = 'advisory' AND datname = current_database()")
        return cursor.fetchone()[0] > 0


def admit_while_another_admission_is_open(meanwhile: Callable[[], Any]) -> tuple[list[int], list[int]]:
    """The first admitter admits and keeps its transaction open; `meanwhile` queues more work
    (committed); then a second admitter starts. Returns what each admitted."""
    first_done, go, release = threading.Event(), threading.Event(), threading.Event()

    def first() -> list[int]:
        with transaction.atomic():
            ids = scheduling.admit(now=clock.now())
            first_done.set()
            release.wait(30)
        return ids

    def second() -> list[int]:
        go.wait(30)
        with transaction.atomic():
            return scheduling.admit(now=clock.now())

    first_thread, first_result = on_thread(first)
    second_thread, second_result = on_thread(second)
    try:
        assert first_done.wait(30)
        meanwhile()
        go.set()
        # The second admitter must queue behind the first, not read counts without its admissions.
        wait_until(lambda: waiting_on_an_advisory_lock() or not second_thread.is_alive(), timeout=10,
                   interval=0.01, message="the second admitter to block or finish")
    finally:
        go.set()
        release.set()
        first_thread.join(30)
        second_thread.join(30)
    assert isinstance(first_result[0], list) and isinstance(second_result[0], list), (first_result, second_result)
    return first_result[0], second_result[0]


# SQLite runs one writer at a time, and has no advisory lock for a second admitter to wait on.
TWO_ADMITTERS_AT_ONCE = pytest.mark.skipif("connection.vendor != 'postgresql'",
                                           reason="two admitters' transactions open at once")


def slots(**filters: Any) -> int:
    return Task.objects.filter(status__in=HOLDS_SLOT, **filters).count()


@TWO_ADMITTERS_AT_ONCE
def test_two_admitters_never_exceed_the_system_cap(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 4
    for _ in range(6):
        make_task(acme, alice)

    def globex_arrives() -> None:
        for _ in range(6):
            make_task(globex, charlie)

    first, second = admit_while_another_admission_is_open(globex_arrives)
    assert (len(first), len(second)) == (4, 2), "the second fills the two slots it took back for globex's share"
    assert slots() == 4
    assert slots(tenant=globex) == 2


@TWO_ADMITTERS_AT_ONCE
def test_two_admitters_never_exceed_a_tenants_cap(acme, alice, settings):
    settings.LONGHAUL_MAX_RUNNING = 50
    Tenant.objects.filter(pk=acme.pk).update(max_running=2)
    for _ in range(3):
        make_task(acme, alice)

    def urgent_work_arrives() -> None:
        for _ in range(3):
            make_task(acme, alice, priority=5)

    first, second = admit_while_another_admission_is_open(urgent_work_arrives)
    assert (len(first), len(second)) == (2, 0)
    assert slots(tenant=acme) == 2


def end_one_and_admit() -> list[int]:
    """What a worker does when its task ends: free the slot, admit, in one transaction."""
    with transaction.atomic():
        now = clock.now()
        task = Task.objects.select_for_update(skip_locked=True).filter(status=S.RUNNING).order_by("?").first()
        if task is not None:
            transitions.cancel(task, now=now)
        return scheduling.admit(now=now)


def test_slots_freed_and_refilled_concurrently_stay_within_every_cap(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_MAX_RUNNING = 5
    Tenant.objects.update(max_running=3)
    for _ in range(20):  # 30 end below; enough stay queued to refill every slot
        make_task(acme, alice)
        make_task(globex, charlie)
    with transaction.atomic():
        scheduling.admit(now=clock.now())
    for _ in range(10):
        threads = [on_thread(end_one_and_admit) for _ in range(3)]
        for thread, result in threads:
            thread.join(30)
            assert isinstance(result[0], list), result
        assert slots() <= 5
        assert slots(tenant=acme) <= 3 and slots(tenant=globex) <= 3
    assert slots() == 5, "every freed slot was refilled"


@TWO_ADMITTERS_AT_ONCE
def test_an_admission_that_waited_for_a_freed_slot_is_stamped_after_the_slot_was_freed(acme, alice, settings):
    """Admission times tell when slots were held (fairness, admission waits): a slot is taken no earlier than it
    was freed, even by an admitter whose transaction read the clock before it queued for the admission lock."""
    settings.LONGHAUL_MAX_RUNNING = 1
    running = make_task(acme, alice, status=S.RUNNING)
    waiting = make_task(acme, alice, status=S.QUEUED)
    asked_at = clock.now()  # the second admitter's transaction began here, before the slot was freed
    freeing, release = threading.Event(), threading.Event()

    def free_the_slot() -> None:
        with transaction.atomic():
            scheduling._serialize_admission()  # as a transition freeing a slot admits in its transaction
            Task.objects.filter(pk=running.pk).update(status=S.SUCCEEDED, finished_at=clock.now())
            freeing.set()
            release.wait(30)

    first, _ = on_thread(free_the_slot)
    assert freeing.wait(30)
    second, admitted = on_thread(lambda: transaction.atomic()(scheduling.admit)(now=asked_at))
    try:
        wait_until(lambda: waiting_on_an_advisory_lock() or not second.is_alive(), timeout=10, interval=0.01,
                   message="the second admitter to wait for the first")
    finally:
        release.set()
        first.join(30)
        second.join(30)

    assert admitted == [[waiting.pk]], admitted
    freed_at = Task.objects.get(pk=running.pk).finished_at
    admission = TaskEvent.objects.get(task_id=waiting.pk, kind="admitted")
    assert admission.at >= freed_at, (admission.at, freed_at)
    assert AdmissionRecord.objects.get(task_id=waiting.pk).admitted_at >= freed_at
