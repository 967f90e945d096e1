"""A kick is a hint that work is due. The job it reaches must not drop it because the row was locked for a
moment by another transaction (a call's outcome being recorded, a cancel being asked for, a step's commit):
nothing else would act until the sweeper's next pass, up to a minute later. Found in the e2e cancel of a remote
tool, whose cancel kick arrived while the recorder of its last poll held the task's row."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction
from django.db.models import Model

from chat import runs
from chat.models import Run, Thread
from tasks import clock, jobs, notifications
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import make_task

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)  # the lock is held on a connection of its own

HELD_FOR = 0.5  # seconds: a recorder's or a request's transaction, generously


@contextmanager
def row_locked_elsewhere(row: Model) -> Iterator[None]:
    """The row locked by another connection, as a transaction that is about to commit holds it."""
    locked, done = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                type(row).objects.select_for_update().get(pk=row.pk)
                locked.set()
                done.wait(HELD_FOR)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10), "the lock was never taken"
    try:
        yield
    finally:
        done.set()
        holder.join(10)


def test_a_step_kick_that_meets_its_task_locked_for_a_moment_still_runs_the_step(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = make_task(acme, alice, status=S.RUNNING)  # due now, held by nobody
    with row_locked_elsewhere(task):
        jobs.advance(task.pk)  # the kick's job, delivered while the row is locked
    task.refresh_from_db()
    assert task.current_step == 1, "the kick was dropped: nothing runs the due step until the next sweep"
    assert task.fencing_token == 1 and task.lease_owner == ""


def test_a_delivery_kick_that_meets_its_task_locked_for_a_moment_still_delivers(acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice)
    task = make_task(acme, alice, status=S.SUCCEEDED, thread=thread, event_version=1,
                     notification_status="pending", next_notification_at=clock.now())
    with row_locked_elsewhere(task):
        delivery = notifications.claim(task.pk, owner="d1", now=clock.now())
    assert delivery is not None, "the kick was dropped: the thread hears of the task only at the next sweep"
    assert Task.objects.get(pk=task.pk).notification_status == "claimed"


def test_a_chat_run_kick_that_meets_its_run_locked_for_a_moment_still_starts_the_run(acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice)
    run = Run.objects.create(thread=thread, tenant=acme, created_at=clock.now())  # pending
    with row_locked_elsewhere(run):
        claimed = runs.claim(run.pk, owner="w1", now=clock.now())
    assert claimed is not None, "the kick was dropped: the thread's answer waits for the next sweep"
    assert Run.objects.get(pk=run.pk).status == Run.Status.RUNNING
