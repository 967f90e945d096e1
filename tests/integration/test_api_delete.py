"""DELETE /api/tasks/{id}: a task that has ended goes, with everything derived from it; the audit entry
keeps who, when and how many rows of each class, never content (DESIGN §14)."""

from __future__ import annotations

import pytest

from chat import runs
from chat.models import Message, Run, Thread
from tasks import jobs
from tasks.models import AuditEntry, Checkpoint, IdempotencyRecord, Operation, SleepEffect, Task, TaskEvent
from tasks.statuses import TERMINAL, TaskStatus
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
