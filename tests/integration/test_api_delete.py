"""DELETE /api/tasks/{id}: a task that has ended goes, with everything derived from it; the audit entry
keeps who, when and how many rows of each class, never content (DESIGN §14)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from chat import runs
from chat.models import Message, Run, Thread
from tasks import clock, deletion, jobs, sweeper
from tasks.models import AuditEntry, Checkpoint, IdempotencyRecord, Operation, SleepEffect, Task, TaskEvent
from tasks.statuses import TERMINAL, TaskStatus
from tests import stored
from tests.factories import make_task, submit_sleep
from webhooks import endpoints
from webhooks.models import Delivery

pytestmark = pytest.mark.django_db


def run_to_end(task: Task) -> Task:
    for _ in range(20):
        task.refresh_from_db()
        if task.status in TERMINAL:
            return task
        jobs.advance(task.pk)
    raise AssertionError(f"still {task.status}")


def test_an_ended_task_is_deleted_with_everything_derived_and_an_audit_of_counts(acme, alice, alice_api, settings):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True
    endpoints.register(tenant=acme, actor=alice, owner=alice, url="http://127.0.0.1:9/hook",
                       events=["task.succeeded"])
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    task = run_to_end(submit_sleep(acme, alice, key="delete-me-1", thread_id=thread.pk, side_effect=True,
                                   step_seconds=0))
    assert task.status == TaskStatus.SUCCEEDED
    notification, _ = runs.start_run(thread, kind=Run.Kind.NOTIFICATION, user_text="", hidden=True, key=None,
                                     task_id=task.pk, task_version=1)
    told = Message.objects.filter(run=notification).count()
    keep = make_task(acme, alice, status=TaskStatus.SUCCEEDED)
    derived = {model: model.objects.filter(task=task).count()
               for model in (TaskEvent, Checkpoint, Operation, SleepEffect, IdempotencyRecord, Delivery)}
    assert all(derived.values()), derived

    response = alice_api.delete(f"/api/tasks/{task.public_id}")

    assert response.status_code == 204, response.content
    assert not Task.objects.filter(pk=task.pk).exists()
    assert {model: model.objects.filter(task_id=task.pk).count() for model in derived} == dict.fromkeys(derived, 0)
    assert not Run.objects.filter(pk=notification.pk).exists()
    assert Message.objects.filter(thread=thread).count() >= told, "the conversation keeps what it said"
    assert Task.objects.filter(pk=keep.pk).exists()
    audit = AuditEntry.objects.get(action="task.delete")
    assert audit.target_id == str(task.public_id) and audit.actor == alice and audit.tenant == acme
    assert audit.details["deleted"]["task"] == 1
    assert audit.details["deleted"]["taskevent"] == derived[TaskEvent]
    assert audit.details["deleted"]["checkpoint"] == derived[Checkpoint]
    assert audit.details["deleted"]["delivery"] == derived[Delivery]
    assert "a task" not in str(audit.details) and "steps" not in str(audit.details), "counts, never content"

    # Deleting twice answers 404 and changes nothing.
    again = alice_api.delete(f"/api/tasks/{task.public_id}")
    assert again.status_code == 404 and again.json()["code"] == "not_found"
    assert AuditEntry.objects.filter(action="task.delete").count() == 1


@pytest.mark.parametrize("status", [TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.WAITING_INPUT,
                                    TaskStatus.PAUSED])
def test_a_task_that_may_still_run_is_refused_saying_to_cancel_first(acme, alice, alice_api, status):
    task = make_task(acme, alice, status=status)
    response = alice_api.delete(f"/api/tasks/{task.public_id}")
    assert response.status_code == 409
    assert response.json()["code"] == "task_active" and "cancel it first" in response.json()["error"]
    assert Task.objects.filter(pk=task.pk).exists()
    assert not AuditEntry.objects.filter(action="task.delete").exists()


def test_another_tenants_task_answers_404_and_stays(acme, alice_api, globex, charlie):
    theirs = make_task(globex, charlie, status=TaskStatus.FAILED)
    response = alice_api.delete(f"/api/tasks/{theirs.public_id}")
    assert response.status_code == 404
    assert Task.objects.filter(pk=theirs.pk).exists()


def test_a_thread_goes_with_its_messages_runs_and_tasks_its_running_task_once_cancelled(acme, alice, alice_api):
    """DELETE /api/threads/{id}: the ended tasks go at once, a parked one is cancelled and goes at once, a
    running one is asked to cancel, disappears, and is deleted by the sweeper when its worker has ended it."""
    thread = Thread.objects.create(tenant=acme, owner=alice, title="to forget")
    ended = run_to_end(submit_sleep(acme, alice, key="thread-ended", thread_id=thread.pk, step_seconds=0))
    parked = make_task(acme, alice, status=TaskStatus.PAUSED, thread=thread)
    held = make_task(acme, alice, status=TaskStatus.RUNNING, thread=thread, lease_owner="worker:1",
                     lease_expires_at=clock.now() + timedelta(minutes=5))
    run, _ = runs.start_run(thread, kind=Run.Kind.CHAT, user_text="hello", hidden=False, key=None)
    other_thread = Thread.objects.create(tenant=acme, owner=alice, title="kept")
    kept = make_task(acme, alice, status=TaskStatus.SUCCEEDED, thread=other_thread)

    response = alice_api.delete(f"/api/threads/{thread.public_id}")

    assert response.status_code == 204, response.content
    assert not Thread.objects.filter(pk=thread.pk).exists()
    assert not Message.objects.filter(thread_id=thread.pk).exists() and not Run.objects.filter(pk=run.pk).exists()
    assert not Task.objects.filter(pk__in=[ended.pk, parked.pk]).exists()
    held.refresh_from_db()
    assert held.cancel_requested_at is not None and held.delete_requested_at is not None and held.thread is None
    assert alice_api.get(f"/api/tasks/{held.public_id}").status_code == 404, "a deleted task is gone at once"
    assert str(held.public_id) not in str(alice_api.get("/api/tasks").json())
    assert Task.objects.filter(pk=kept.pk).exists() and Thread.objects.filter(pk=other_thread.pk).exists()
    audit = AuditEntry.objects.get(action="thread.delete")
    assert audit.target_id == str(thread.public_id) and audit.actor == alice and audit.tenant == acme
    assert audit.details["deleted"]["task"] == 2 and audit.details["deleted"]["thread"] == 1
    assert audit.details["deleted"]["message"] >= 1 and audit.details["tasks_pending"] == 1
    assert "hello" not in str(audit.details) and "to forget" not in str(audit.details), "counts, never content"

    # The worker reaches its safe point: the task is cancelled, and the next sweep deletes it.
    assert sweeper.run_once(now=clock.now())["deletions_finished"] == 0, "still running: nothing to delete yet"
    Task.objects.filter(pk=held.pk).update(lease_owner="", lease_expires_at=None)
    jobs.advance(held.pk)
    assert Task.objects.get(pk=held.pk).status == TaskStatus.CANCELLED
    assert sweeper.run_once(now=clock.now())["deletions_finished"] == 1
    assert not Task.objects.filter(pk=held.pk).exists()
    after = AuditEntry.objects.get(action="task.delete", target_id=str(held.public_id))
    assert after.actor == alice and after.details["after_cancel"] is True

    again = alice_api.delete(f"/api/threads/{thread.public_id}")
    assert again.status_code == 404
    assert AuditEntry.objects.filter(action="thread.delete").count() == 1


def test_another_tenants_thread_answers_404_and_stays(acme, alice_api, globex, charlie):
    theirs = Thread.objects.create(tenant=globex, owner=charlie, title="theirs")
    task = make_task(globex, charlie, status=TaskStatus.RUNNING, thread=theirs)
    response = alice_api.delete(f"/api/threads/{theirs.public_id}")
    assert response.status_code == 404
    assert Thread.objects.filter(pk=theirs.pk).exists()
    task.refresh_from_db()
    assert task.cancel_requested_at is None and task.delete_requested_at is None
    assert not AuditEntry.objects.filter(action="thread.delete").exists()


def test_a_running_task_of_a_deleted_thread_has_nobody_left_to_tell(acme, alice, alice_api):
    """Its outbox settles with the thread: a pending notification would wait for a thread that is gone."""
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    held = make_task(acme, alice, status=TaskStatus.RUNNING, thread=thread, lease_owner="worker:1",
                     lease_expires_at=clock.now() + timedelta(minutes=5), notification_status="pending",
                     next_notification_at=clock.now(), event_version=2)
    assert alice_api.delete(f"/api/threads/{thread.public_id}").status_code == 204
    held.refresh_from_db()
    assert (held.thread_id, held.notification_status, held.next_notification_at) == (None, "none", None)
    Task.objects.filter(pk=held.pk).update(lease_owner="", lease_expires_at=None)
    jobs.advance(held.pk)
    held.refresh_from_db()
    assert held.status == TaskStatus.CANCELLED and held.notification_status == "none", "its end tells nobody"


def test_a_pending_deletion_whose_content_fails_its_check_is_done_and_holds_up_no_other(acme, alice):
    """The sweeper's deletions read no content: a row that cannot be opened is deleted all the same."""
    now = clock.now()
    broken, fine = (make_task(acme, alice, status=TaskStatus.CANCELLED, input={"question": "q"},
                              delete_requested_at=now, delete_requested_by=alice) for _ in range(2))
    no_key_opens = f'{{"lh_sealed": "lh1:{acme.pk}:1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}}'
    stored.write("tasks_task", "input", broken.pk, no_key_opens)
    assert deletion.finish_pending(now, batch=10) == 2
    assert not Task.objects.filter(pk__in=[broken.pk, fine.pk]).exists()
