"""A running slot is taken back at a step boundary when another tenant is owed it: with every slot
taken, a newcomer of a tenant below its share no longer waits for a running task to end."""

from __future__ import annotations

import pytest
from django.db import transaction
from django_q.models import OrmQ

from tasks import actions, clock, jobs, leases, runner, scheduling
from tasks.context import StepContext
from tasks.drivers import Continue, get_driver
from tasks.models import Checkpoint, Task, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus
from tests.factories import submit_sleep

S = TaskStatus
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _four_slots(settings):
    settings.LONGHAUL_MAX_RUNNING = 4
    settings.LONGHAUL_STEP_SLICE_MS = 0


def held(tenant: Tenant) -> int:
    return Task.objects.filter(tenant=tenant, status__in=HOLDS_SLOT).count()


def asked() -> list[int]:
    return list(Task.objects.filter(yield_requested_at__isnull=False).values_list("pk", flat=True))


def step_each_running_task() -> None:
    """One step boundary for every task holding a slot, oldest first, as workers would."""
    for pk in Task.objects.filter(status=S.RUNNING).order_by("pk").values_list("pk", flat=True):
        jobs.advance(pk)


def test_a_newcomer_gets_a_slot_at_the_next_step_boundary_not_at_a_task_end(acme, alice, globex, charlie):
    theirs = [submit_sleep(acme, alice, steps=10) for _ in range(4)]
    mine = submit_sleep(globex, charlie, steps=1)
    assert mine.status == S.QUEUED, "every slot was taken"
    assert asked() == [theirs[-1].pk], "the most recently started of the richest tenant's tasks is asked"

    jobs.advance(theirs[-1].pk)  # its step boundary: it gives the slot back before running the step

    yielded = Task.objects.get(pk=theirs[-1].pk)
    assert yielded.status == S.QUEUED and yielded.lease_owner == "" and yielded.yield_requested_at is None
    assert yielded.events.filter(kind="queued", data__reason="yielded").exists()
    assert Task.objects.get(pk=mine.pk).status == S.RUNNING, "the freed slot went to the tenant owed it"
    assert (held(acme), held(globex)) == (3, 1)
    assert asked() == [], "1 of 4 slots is globex's share with one task queued: nothing more is owed"


def test_slots_come_back_one_boundary_at_a_time_until_the_weights_are_met(acme, alice, globex, charlie):
    for _ in range(4):
        submit_sleep(acme, alice, steps=20)
    for _ in range(4):
        submit_sleep(globex, charlie, steps=20)
    assert len(asked()) == 1, "one request at a time"
    for _ in range(4):
        step_each_running_task()
    assert (held(acme), held(globex)) == (2, 2), "equal weights: two slots each"
    for _ in range(3):
        step_each_running_task()
    assert (held(acme), held(globex)) == (2, 2), "and it stays there: no slot goes back and forth"
    yielded = Task.objects.filter(tenant=acme, events__kind="queued", events__data__reason="yielded").distinct()
    assert yielded.count() == 2
    for task in yielded:
        steps = list(Checkpoint.objects.filter(task=task).values_list("step", flat=True))
        assert steps == list(range(1, len(steps) + 1)), "a yielded task resumes from its checkpoint"


def test_no_slot_is_taken_back_from_a_tenant_within_its_weighted_share(acme, alice, globex, charlie):
    Tenant.objects.filter(pk=acme.pk).update(weight=3)
    for _ in range(4):
        submit_sleep(acme, alice, steps=10)
    submit_sleep(globex, charlie, steps=1)
    assert len(asked()) == 1, "globex holds none: one of acme's four is owed"
    step_each_running_task()
    assert (held(acme), held(globex)) == (3, 1)
    submit_sleep(globex, charlie, steps=1)
    assert asked() == [], "3 to 1 is what weights 3 and 1 say"


def test_a_tenant_of_weight_zero_gives_every_slot_back_to_weighted_work(acme, alice, globex, charlie):
    Tenant.objects.filter(pk=acme.pk).update(weight=0)
    for _ in range(4):
        submit_sleep(acme, alice, steps=20)
    for _ in range(4):
        submit_sleep(globex, charlie, steps=20)
    for _ in range(8):
        step_each_running_task()
    assert (held(acme), held(globex)) == (0, 4)


def test_a_task_asked_while_running_in_place_yields_at_its_commit(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    task = submit_sleep(acme, alice, steps=5)
    worker = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert worker is not None
    for _ in range(3):
        submit_sleep(acme, alice, steps=5)
    submit_sleep(globex, charlie, steps=1)
    Task.objects.filter(yield_requested_at__isnull=False).update(yield_requested_at=None)
    with transaction.atomic():
        task.refresh_from_db()
        from tasks import transitions

        assert transitions.ask_to_yield(task, now=clock.now())

    # The worker read the row before the request: its commit without a read loses, the locked one yields.
    ctx = StepContext(worker, token=worker.fencing_token)
    kept = runner._commit(worker, worker.fencing_token, get_driver("sleep"), Continue({"done": 1, "of": 5}), ctx,
                          keep_lease=True)
    assert kept is None, "the worker must not run the next step of a task that gave its slot back"
    task.refresh_from_db()
    assert task.status == S.QUEUED and task.current_step == 1
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == [1]
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))
    assert held(globex) == 1


def test_a_stop_requested_meanwhile_goes_before_the_yield(acme, alice, globex, charlie):
    theirs = [submit_sleep(acme, alice, steps=10) for _ in range(4)]
    submit_sleep(globex, charlie, steps=1)
    assert asked() == [theirs[-1].pk]
    actions.request_cancel(Task.objects.get(pk=theirs[-1].pk), user=alice, reason="enough")
    jobs.advance(theirs[-1].pk)
    assert Task.objects.get(pk=theirs[-1].pk).status == S.CANCELLED


def test_taking_slots_back_can_be_turned_off(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_TAKE_SLOTS_BACK = False
    for _ in range(4):
        submit_sleep(acme, alice, steps=10)
    submit_sleep(globex, charlie, steps=1)
    assert asked() == []
    OrmQ.objects.all().delete()
    with transaction.atomic():
        assert scheduling.admit(now=clock.now()) == []
    assert asked() == []
