"""Rows for tests, built plainly. Runtime columns are set directly here only to stage a scene."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User

from tasks import actions, clock
from tasks.models import Task, Tenant
from tasks.statuses import TaskStatus


def make_task(tenant: Tenant, owner: User, *, status: str = TaskStatus.QUEUED, **fields: Any) -> Task:
    now = clock.now()
    values: dict[str, Any] = {
        "kind": "sleep", "name": "a task", "input": {"steps": 3, "step_seconds": 0, "fail_at_step": None,
                                                     "fail_kind": None, "fail_times": 1, "side_effect": False},
        "budget": {}, "created_at": now, "updated_at": now,
    }
    if status in (TaskStatus.RUNNING, TaskStatus.RETRY_WAIT):
        values["next_run_at"] = now
        values["started_at"] = now
    values.update(fields)
    return Task.objects.create(tenant=tenant, owner=owner, status=status, **values)


def submit_sleep(tenant: Tenant, owner: User, *, key: str | None = None, thread_id: int | None = None,
                 **spec: Any) -> Task:
    task, _ = actions.submit(
        tenant=tenant, user=owner,
        submission=actions.Submission(kind="sleep", input={"steps": 3, **spec}, idempotency_key=key,
                                      thread_id=thread_id, internal=True),
    )
    return task
