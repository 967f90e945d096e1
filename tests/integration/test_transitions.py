"""Every transition wins from its allowed statuses, refuses the others, and loses races cleanly."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction

from tasks import clock, transitions
from tasks.errors import InvalidTransition
from tasks.models import Operation, Task, TaskEvent
from tasks.statuses import ACTIVE, TERMINAL, TaskStatus
from tests.factories import make_task

S = TaskStatus
pytestmark = pytest.mark.django_db


def _call(name: str, task: Task, token: int | None = None):
    now = clock.now()
    calls = {
        "admit": lambda: transitions.admit(task, now=now),
        "claim": lambda: transitions.claim(task, owner="w1", now=now, expires_at=now + timedelta(seconds=30)),
        "commit_step": lambda: transitions.commit_step(task, token=token or 0, now=now, keep_lease=False, events=[]),
        "schedule_retry": lambda: transitions.schedule_retry(task, token=token or 0, now=now, run_at=now,
                                                             error_class="transient", message="x"),
        "succeed": lambda: transitions.succeed(task, token=token or 0, now=now, result={"ok": 1}, events=[]),
        "finish_partial": lambda: transitions.finish_partial(task, now=now, result={}, scope="s", reason="r"),
        "fail": lambda: transitions.fail(task, now=now, error_class="permanent", message="m"),
        "cancel": lambda: transitions.cancel(task, now=now),
        "pause": lambda: transitions.pause(task, now=now),
        "requeue": lambda: transitions.requeue(task, now=now, queue_deadline_at=now, reason="r"),
    }
    with transaction.atomic():
        return calls[name]()


ALLOWED = {
    "admit": {S.QUEUED},
    "claim": {S.RUNNING, S.RETRY_WAIT},
    "commit_step": {S.RUNNING},
    "schedule_retry": {S.RUNNING},
    "succeed": {S.RUNNING},
    "finish_partial": set(ACTIVE),
    "fail": set(ACTIVE),
    "cancel": set(ACTIVE),
    "pause": {S.QUEUED, S.RUNNING, S.RETRY_WAIT, S.WAITING_INPUT, S.WAITING_TOOL},
    "requeue": {S.PAUSED, S.PARTIAL},
}
CASES = [(name, status) for name in ALLOWED for status in S]


@pytest.mark.parametrize(("name", "status"), CASES)
def test_it_allows_exactly_the_designed_moves(name, status, acme, alice):
    _no_free_slots(acme)  # so that a move into queued is not followed by an admission
    task = make_task(acme, alice, status=status)
    if status in ALLOWED[name]:
        assert _call(name, task) is True
        task.refresh_from_db()
        assert task.version == 1
        if task.status != status:
            assert task.events.filter(status=task.status).count() == 1, "a status change appends its event"
    else:
        with pytest.raises(InvalidTransition):
            _call(name, task)
        assert Task.objects.get(pk=task.pk).status == status


@pytest.mark.parametrize("status", sorted(TERMINAL))
def test_terminal_tasks_never_change_status(status, acme, alice):
    task = make_task(acme, alice, status=status)
    for name in ALLOWED:
        with pytest.raises(InvalidTransition):
            _call(name, task)
    assert Task.objects.get(pk=task.pk).status == status
    assert not TaskEvent.objects.filter(task=task).exists()


def test_a_transition_from_a_stale_read_loses_and_writes_nothing(acme, alice):
    task = make_task(acme, alice, status=S.RUNNING)
    stale = Task.objects.get(pk=task.pk)
    assert _call("pause", task) is True
    assert _call("cancel", stale) is False
    fresh = Task.objects.get(pk=task.pk)
    assert fresh.status == S.PAUSED
    assert list(fresh.events.values_list("kind", flat=True)) == ["paused"]


def test_a_worker_transition_with_a_stale_fencing_token_loses(acme, alice):
    task = make_task(acme, alice, status=S.RUNNING, fencing_token=5, lease_owner="w2")
    assert _call("succeed", task, token=4) is False
    assert Task.objects.get(pk=task.pk).status == S.RUNNING
    assert _call("succeed", task, token=5) is True
    assert Task.objects.get(pk=task.pk).status == S.SUCCEEDED


def test_it_will_not_cancel_a_task_held_by_a_live_lease_without_its_token(acme, alice):
    now = clock.now()
    task = make_task(acme, alice, status=S.RUNNING, lease_owner="w1", lease_expires_at=now + timedelta(seconds=30),
                     fencing_token=3)
    assert _call("cancel", task) is False
    task.lease_expires_at = now - timedelta(seconds=1)
    Task.objects.filter(pk=task.pk).update(lease_expires_at=task.lease_expires_at)
    assert _call("cancel", task) is True
    fresh = Task.objects.get(pk=task.pk)
    assert fresh.status == S.CANCELLED
    assert fresh.fencing_token == 4, "a forced stop moves the token on, fencing out the old holder"


def test_each_status_change_appends_one_event_with_the_next_seq(acme, alice):
    task = make_task(acme, alice, status=S.QUEUED)
    _call("admit", task)
    _call("pause", task)
    _call("requeue", task)
    events = list(TaskEvent.objects.filter(task=task).values_list("seq", "kind", "status"))
    assert events == [(1, "admitted", "running"), (2, "paused", "paused"), (3, "queued", "queued"),
                      (4, "admitted", "running")], "a move into queued admits when a slot is free"


def _no_free_slots(tenant) -> None:
    tenant.max_running = 0
    tenant.save()


def test_a_transition_that_frees_a_slot_admits_the_next_task_in_its_transaction(acme, alice):
    acme.max_running = 1
    acme.save()
    running = make_task(acme, alice, status=S.RUNNING)
    waiting = make_task(acme, alice, status=S.QUEUED)
    assert _call("succeed", running) is True
    waiting.refresh_from_db()
    assert waiting.status == S.RUNNING, "the freed slot went to the queued task"
    assert list(waiting.events.values_list("kind", flat=True)) == ["admitted"]


@pytest.mark.parametrize("name", ["succeed", "fail", "cancel"])
def test_a_task_that_ends_closes_the_calls_nobody_took_and_only_those(name, acme, alice, bob):
    task = make_task(acme, alice, status=S.RUNNING)
    other = make_task(acme, bob, status=S.RUNNING)

    def call(owner: Task, n: int, status: str) -> Operation:
        return Operation.objects.create(task=owner, key=f"{owner.pk}:1:{n}", step=1, n=n, kind="tool", name="search",
                                        args_digest="-", args={"query": str(n)}, status=status,
                                        fencing_token=owner.fencing_token)

    pending, started, done, others = call(task, 0, "pending"), call(task, 1, "started"), call(task, 2, "succeeded"), \
        call(other, 0, "pending")
    assert _call(name, task) is True
    ended_at = Task.objects.get(pk=task.pk).finished_at
    pending.refresh_from_db()
    assert (pending.status, pending.error_class, pending.error_message, pending.finished_at) == (
        "failed", "cancelled", "its task ended before it ran", ended_at)
    assert Operation.objects.get(pk=started.pk).status == "started", "a call in flight records its own outcome"
    assert Operation.objects.get(pk=done.pk).status == "succeeded"
    assert Operation.objects.get(pk=others.pk).status == "pending", "another task's calls are not its own"


def test_a_transition_that_keeps_its_slot_admits_nobody(acme, alice):
    acme.max_running = 1
    acme.save()
    running = make_task(acme, alice, status=S.RUNNING)
    waiting = make_task(acme, alice, status=S.QUEUED)
    assert _call("schedule_retry", running) is True
    waiting.refresh_from_db()
    assert waiting.status == S.QUEUED, "retry_wait still holds the slot"
