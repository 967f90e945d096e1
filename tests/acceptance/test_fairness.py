"""A real qcluster under a flood: a tenant with three tasks is served within its share, and the
system cap holds across worker processes."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.db import connection, transaction

from tasks.models import Task, TaskEvent
from tasks.statuses import TERMINAL, TaskStatus
from tests.factories import submit_sleep
from tests.processes import qcluster, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]
SLOTS = 4


def fresh_count(**filters) -> int:
    connection.close()  # see the workers' commits with a fresh snapshot
    return Task.objects.filter(**filters).count()


def most_slots_held_at_once() -> int:
    """From the events: the largest number of tasks between admission and their end at one time."""
    admitted = dict(TaskEvent.objects.filter(kind="admitted").values_list("task_id", "at"))
    ended = dict(Task.objects.filter(pk__in=list(admitted), finished_at__isnull=False)
                 .values_list("pk", "finished_at"))
    # At equal times an end sorts first: a slot freed and refilled in one transaction is one slot.
    points: list[tuple[datetime, int]] = [(at, 1) for at in admitted.values()]
    points += [(at, -1) for at in ended.values()]
    held = most = 0
    for _, change in sorted(points):
        held += change
        most = max(most, held)
    return most


def test_a_light_tenant_is_served_within_its_share_while_another_floods(acme, alice, globex, charlie, settings,
                                                                         log_dir):
    settings.LONGHAUL_MAX_RUNNING = SLOTS
    acme.max_queued = 1000
    acme.save()
    for _ in range(60):
        submit_sleep(acme, alice, steps=2, step_seconds=0.05)
    with qcluster(log_dir, workers=SLOTS, LONGHAUL_MAX_RUNNING=str(SLOTS), LONGHAUL_STEP_SLICE_MS="0"):
        wait_until(lambda: fresh_count(tenant=acme, status=TaskStatus.SUCCEEDED) >= SLOTS, timeout=60,
                   message="the flood to be under way")
        since = TaskEvent.objects.latest("id").id
        with transaction.atomic():  # all three wait from one moment, so acme's admissions before it don't count
            theirs = [submit_sleep(globex, charlie, steps=2, step_seconds=0.05).pk for _ in range(3)]
        submitted = TaskEvent.objects.latest("id").id
        wait_until(lambda: fresh_count(pk__in=theirs, status__in=TERMINAL) == 3, timeout=60,
                   message="globex's tasks to finish")
    order = list(TaskEvent.objects.filter(kind="admitted", id__gt=since).order_by("id")
                 .values_list("id", "tenant_id"))
    last_globex = max(event_id for event_id, tenant_id in order if tenant_id == globex.pk)
    # Once globex's tasks wait, each slot that frees is theirs (they hold the fewest per weight); acme's
    # admissions already under way in other workers at that moment may still land first.
    acme_ahead = [event_id for event_id, tenant_id in order
                  if tenant_id == acme.pk and submitted < event_id < last_globex]
    assert len(acme_ahead) <= SLOTS, f"globex waited behind acme's flood: {[t for _, t in order]}"
    assert fresh_count(pk__in=theirs, status=TaskStatus.SUCCEEDED) == 3
    assert most_slots_held_at_once() <= SLOTS
