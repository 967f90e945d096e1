"""The notification outbox: each event version told exactly once in its thread, even across crashes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.db import transaction

from chat import notify as chat_notify
from chat.models import Message, Run, Thread
from tasks import clock, jobs, notifications
from tasks.models import Alert, Task
from tasks.statuses import NotificationStatus, TaskStatus
from tests.factories import submit_sleep
from tests.integration.chatting import queued_jobs, run_queued

N = NotificationStatus
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _one_step_per_advance(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


@pytest.fixture
def thread(acme, alice) -> Thread:
    return Thread.objects.create(tenant=acme, owner=alice, title="work")


def finish(task: Task) -> Task:
    for _ in range(20):
        task.refresh_from_db()
        if task.status == TaskStatus.SUCCEEDED:
            return task
        jobs.advance(task.pk)
    raise AssertionError(task.status)


def assistant_messages(thread: Thread) -> list[str]:
    return list(Message.objects.filter(thread=thread, role="assistant").values_list("content", flat=True))


def test_a_finished_task_is_told_once_in_its_thread(acme, alice, thread):
    task = finish(submit_sleep(acme, alice, steps=2, thread_id=thread.pk))
    assert (task.event_version, task.notified_version, task.notification_status) == (1, 0, N.PENDING)
    run_queued()
    task.refresh_from_db()
    assert (task.notified_version, task.notification_status) == (1, N.DELIVERED)
    [message] = assistant_messages(thread)
    assert "is done" in message and "Slept through 2 steps" in message
    assert str(task.public_id) not in message
    assert Message.objects.get(role="user").hidden, "the injected turn is hidden"
    run_queued()
    assert len(assistant_messages(thread)) == 1


def test_a_task_without_a_thread_is_not_told(acme, alice):
    task = finish(submit_sleep(acme, alice, steps=1))
    assert task.event_version == 0 and task.notification_status == N.NONE
    assert not Run.objects.exists()


def test_a_crash_after_the_run_started_does_not_start_a_second_run(acme, alice, thread):
    task = finish(submit_sleep(acme, alice, steps=1, thread_id=thread.pk))
    delivery = notifications.claim(task.pk, owner="dies", now=clock.now())
    from chat.notify import deliver as notifier

    notifier(delivery)  # the run starts, then the worker dies before marking it dispatched
    assert Run.objects.count() == 1
    with time_machine.travel(clock.now() + timedelta(minutes=5), tick=False):
        assert notifications.deliver(task.pk) == "dispatched"
    assert Run.objects.count() == 1, "the same key found the same run"
    run_queued()
    assert len(assistant_messages(thread)) == 1
    task.refresh_from_db()
    assert task.notification_status == N.DELIVERED


def test_a_busy_thread_coalesces_quick_events_into_one_delivery_of_the_newest(acme, alice, thread):
    from chat import runs

    runs.start_run(thread, kind=Run.Kind.CHAT, user_text="hi", hidden=False, key=None)  # the thread is busy
    task = submit_sleep(acme, alice, steps=1, thread_id=thread.pk)
    for n in range(3):
        with transaction.atomic():
            Task.objects.filter(pk=task.pk).update(name=f"nap {n}")
            task.refresh_from_db()
            assert notifications.note(task, event="succeeded", now=clock.now())
        assert notifications.deliver(task.pk) == "busy"
    task.refresh_from_db()
    assert task.event_version == 3 and task.notification_attempt_count == 0, "busy is not a failure"
    run_queued()  # the chat run ends, the thread frees, the newest event goes out
    with time_machine.travel(clock.now() + timedelta(seconds=3), tick=False):
        assert notifications.deliver(task.pk) == "dispatched"
        run_queued()
    task.refresh_from_db()
    assert (task.notified_version, task.notification_status) == (3, N.DELIVERED)
    assert Run.objects.filter(kind=Run.Kind.NOTIFICATION).count() == 1
    assert Run.objects.get(kind=Run.Kind.NOTIFICATION).task_version == 3


def test_a_thread_deleted_under_a_claimed_notification_dead_letters_at_once(acme, alice, thread):
    """Deleted behind chat.deletion's back (the admin's delete): the notifier finds no thread."""
    task = finish(submit_sleep(acme, alice, steps=1, thread_id=thread.pk))
    delivery = notifications.claim(task.pk, owner="notifier:1", now=clock.now())
    Thread.objects.filter(pk=thread.pk).delete()
    with pytest.raises(notifications.ThreadGone):
        chat_notify.deliver(delivery)
    assert notifications.dead_letter_gone(delivery, "notifier:1", now=clock.now())
    task.refresh_from_db()
    assert task.notification_status == N.DEAD_LETTER
    assert task.notification_attempt_count == 0, "no retries for a thread that is gone"
    assert Alert.objects.filter(kind="dead_letter", task=task).exists()
    assert not Run.objects.exists()


def test_five_failures_dead_letter_and_a_newer_event_revives(acme, alice, thread, settings):
    settings.LONGHAUL_NOTIFIER = "tests.integration.test_notifications.broken_notifier"
    task = finish(submit_sleep(acme, alice, steps=1, thread_id=thread.pk))
    outcomes, now = [], clock.now()
    for attempt in range(5):
        with time_machine.travel(now + timedelta(hours=attempt + 1), tick=False):
            outcomes.append(notifications.deliver(task.pk))
    assert outcomes == ["retry"] * 4 + ["dead_letter"]
    task.refresh_from_db()
    assert task.notification_status == N.DEAD_LETTER and task.notification_attempt_count == 5
    assert Alert.objects.filter(kind="dead_letter", task=task).count() == 1
    with transaction.atomic():
        Task.objects.filter(pk=task.pk).update(name="renamed")
        task.refresh_from_db()
        assert notifications.note(task, event="succeeded", now=clock.now())
    task.refresh_from_db()
    assert task.notification_status == N.PENDING and task.event_version == 2


def broken_notifier(delivery):
    raise ConnectionError("chat is down")


def test_retry_backoff_grows_and_is_capped(settings):
    settings.LONGHAUL_NOTIFY_RETRY_BASE_SECONDS = 2
    settings.LONGHAUL_NOTIFY_RETRY_CAP_SECONDS = 60
    assert [notifications.retry_delay(n).total_seconds() for n in (0, 1, 2, 5, 40)] == [2, 4, 8, 60, 60]


def test_each_event_version_produces_exactly_one_assistant_message(acme, alice, thread):
    task = submit_sleep(acme, alice, steps=2, ask_at_step=2, question="Go on?", thread_id=thread.pk)
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT
    run_queued()
    from tasks import actions

    actions.answer(task, user=alice, text="yes")
    finish(task)
    run_queued()
    task.refresh_from_db()
    assert task.notified_version == task.event_version == 2
    messages = assistant_messages(thread)
    assert len(messages) == 2
    assert "needs your answer: Go on?" in messages[0]
    assert "is done" in messages[1]
    assert not [j for j in queued_jobs() if j[0] == "tasks.jobs.deliver"]


def test_a_pending_notification_whose_thread_is_gone_settles_instead_of_waiting(acme, alice, thread):
    """Deleted behind chat.deletion's back (the admin's delete, a tenant's erasure): nobody is left to tell."""
    task = finish(submit_sleep(acme, alice, steps=1, thread_id=thread.pk))
    assert Task.objects.get(pk=task.pk).notification_status == N.PENDING
    Thread.objects.filter(pk=thread.pk).delete()
    assert notifications.deliver(task.pk) == "nothing"
    task.refresh_from_db()
    assert (task.notification_status, task.next_notification_at) == (N.NONE, None)
