"""Chat run admission: a tenant has at most LONGHAUL_CHAT_RUNS_PER_TENANT runs answering at once, oldest
first; the rest wait pending and start when a place frees, so one tenant cannot hold every worker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from chat import runs
from chat.models import Run, Thread
from tasks import broker, clock
from tests.factories import submit_sleep
from tests.integration.chatting import queued_jobs

pytestmark = pytest.mark.django_db

OWNER = "worker-a"


@pytest.fixture(autouse=True)
def _one_place_per_tenant(settings):
    settings.LONGHAUL_CHAT_RUNS_PER_TENANT = 1


def pending_run(tenant, user, title: str) -> Run:
    thread = Thread.objects.create(tenant=tenant, owner=user, title=title)
    run, created = runs.start_run(thread, kind=Run.Kind.CHAT, user_text=f"hello from {title}", hidden=False, key=None)
    assert created
    return run


def kicked_runs() -> list[int]:
    return [ident for func, ident in queued_jobs() if func == "chat.jobs.run_agent"]


def status_of(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.pk)


def test_a_second_run_of_the_tenant_waits_while_another_tenant_is_answered(acme, alice, bob, globex, charlie):
    first, second = pending_run(acme, alice, "one"), pending_run(acme, bob, "two")
    theirs = pending_run(globex, charlie, "theirs")
    now = clock.now()
    assert runs.claim(first.pk, owner=OWNER, now=now) is not None
    assert runs.claim(second.pk, owner=OWNER, now=now) is None
    assert status_of(second) == Run.Status.PENDING
    assert runs.claim(theirs.pk, owner=OWNER, now=now) is not None


def test_a_run_that_ends_hands_its_place_to_the_oldest_waiting_run(acme, alice, bob,
                                                                   django_capture_on_commit_callbacks):
    first, second, third = (pending_run(acme, alice, "one"), pending_run(acme, bob, "two"),
                            pending_run(acme, alice, "three"))
    now = clock.now()
    claimed = runs.claim(first.pk, owner=OWNER, now=now)
    assert claimed is not None
    assert runs.claim(third.pk, owner=OWNER, now=now) is None
    assert runs.claim(second.pk, owner=OWNER, now=now) is None
    before = len(kicked_runs())
    with django_capture_on_commit_callbacks(execute=True):
        runs.complete(claimed, owner=OWNER, reply="done", data={}, now=now)
    assert kicked_runs()[before:] == [second.pk]  # the oldest waiting, not the last one tried
    assert runs.claim(second.pk, owner=OWNER, now=now) is not None


@pytest.mark.parametrize("end", ["fail", "interrupt"])
def test_a_run_that_fails_or_is_interrupted_frees_its_place_too(acme, alice, bob, settings, end,
                                                                django_capture_on_commit_callbacks):
    first, second = pending_run(acme, alice, "one"), pending_run(acme, bob, "two")
    now = clock.now()
    claimed = runs.claim(first.pk, owner=OWNER, now=now)
    assert claimed is not None
    assert runs.claim(second.pk, owner=OWNER, now=now) is None
    before = len(kicked_runs())
    with django_capture_on_commit_callbacks(execute=True):
        if end == "fail":
            runs.fail(claimed, owner=OWNER, error="boom", now=now)
        else:  # its workers kept dying: the next claim after the lease gives up on it
            settings.LONGHAUL_MAX_ATTEMPTS = 1
            later = now + timedelta(seconds=runs.lease_seconds() + 1)
            assert runs.claim(first.pk, owner=OWNER, now=later) is None
            assert status_of(first) == Run.Status.INTERRUPTED
    assert second.pk in kicked_runs()[before:]
    assert runs.claim(second.pk, owner=OWNER, now=now + timedelta(seconds=runs.lease_seconds() + 1)) is not None


def test_a_run_whose_worker_died_does_not_hold_the_place(acme, alice, bob):
    first, second = pending_run(acme, alice, "one"), pending_run(acme, bob, "two")
    now = clock.now()
    assert runs.claim(first.pk, owner=OWNER, now=now) is not None
    later = now + timedelta(seconds=runs.lease_seconds() + 1)
    # The dead worker's run has an expired lease: the waiting run may start, and the dead one is
    # taken over after it (its own place counts again once it is claimed).
    assert runs.claim(second.pk, owner=OWNER, now=later) is not None
    assert runs.claim(first.pk, owner=OWNER, now=later) is None


def test_a_newer_run_kicked_first_defers_to_the_oldest_and_kicks_it(acme, alice, bob):
    first, second = pending_run(acme, alice, "one"), pending_run(acme, bob, "two")
    before = len(kicked_runs())
    assert runs.claim(second.pk, owner=OWNER, now=clock.now()) is None
    assert kicked_runs()[before:] == [first.pk]
    assert runs.claim(first.pk, owner=OWNER, now=clock.now()) is not None


def test_chat_runs_are_kicked_on_their_own_queue_and_task_steps_on_the_main_one(acme, alice, settings):
    run = pending_run(acme, alice, "one")
    task = submit_sleep(acme, alice)
    packages = [(SignedPackage.loads(row.payload), row.key) for row in OrmQ.objects.all()]
    keys = {(package["func"], package["args"][0]): key for package, key in packages}
    assert keys[("chat.jobs.run_agent", run.pk)] == settings.LONGHAUL_CHAT_QUEUE
    # A step kick goes under the main cluster's step key, which the main cluster's broker reads, the chat one's not.
    step_key = keys[("tasks.jobs.advance", task.pk)]
    assert step_key in broker.Broker(list_key=settings.Q_CLUSTER["name"]).keys
    assert step_key not in broker.Broker(list_key=settings.LONGHAUL_CHAT_QUEUE).keys
