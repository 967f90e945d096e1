"""Model and tool pools: a slot held by a gateway job that died is free again when its lease expires."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine

from tasks import clock, operations
from tasks.models import Operation, Task
from tasks.statuses import OperationStatus, TaskStatus
from tests.factories import make_task

Op = OperationStatus
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _one_model_slot(settings):
    settings.LONGHAUL_MODEL_CONCURRENCY = 1
    settings.LONGHAUL_OPERATION_LEASE_SECONDS = 60


def waiting_for_the_model(tenant, owner) -> Task:
    return make_task(tenant, owner, status=TaskStatus.RUNNING, next_run_at=None, waiting_reason="model")


def model_call(task: Task, n: int, **fields: Any) -> Operation:
    values: dict[str, Any] = {"status": Op.PENDING, "attempts": 0}
    values.update(fields)
    return Operation.objects.create(task=task, key=f"{task.pk}:0:r{n}", step=0, n=n, kind="model", name="chat",
                                    args={"prompt": n}, args_digest=str(n), fencing_token=0,
                                    created_at=clock.now(), **values)


def held_by_a_dead_job(task: Task, n: int, *, expires_in: timedelta) -> Operation:
    return model_call(task, n, status=Op.STARTED, attempts=1, lease_owner="dead-host:4242",
                      lease_expires_at=clock.now() + expires_in, started_at=clock.now())


def test_a_held_model_slot_blocks_the_pool_until_its_lease_expires(acme, alice):
    stuck = held_by_a_dead_job(waiting_for_the_model(acme, alice), 0, expires_in=timedelta(seconds=30))
    pending = model_call(waiting_for_the_model(acme, alice), 0)
    assert operations.claim_batch(owner="gw:1", limit=10, now=clock.now()) == []

    later = stuck.lease_expires_at + timedelta(seconds=1)
    claimed = operations.claim_batch(owner="gw:1", limit=10, now=later)
    assert [op.pk for op in claimed] == [stuck.pk], "the dead job's call is taken over first, within the cap"
    stuck.refresh_from_db()
    assert (stuck.lease_owner, stuck.attempts) == ("gw:1", 2)
    assert Operation.objects.get(pk=pending.pk).status == Op.PENDING

    with time_machine.travel(later, tick=False):
        assert operations.record(stuck.pk, owner="gw:1", result={"text": "done"})
    claimed = operations.claim_batch(owner="gw:1", limit=10, now=later)
    assert [op.pk for op in claimed] == [pending.pk]


def test_a_slot_whose_task_stopped_waiting_is_free_for_a_pending_call(acme, alice):
    # The job died holding a call of a task that was cancelled since: nobody takes that call
    # over, and once its lease expires the slot goes to another task's pending call.
    gone = held_by_a_dead_job(make_task(acme, alice, status=TaskStatus.CANCELLED), 0,
                              expires_in=timedelta(seconds=30))
    pending = model_call(waiting_for_the_model(acme, alice), 0)
    assert operations.claim_batch(owner="gw:1", limit=10, now=clock.now()) == []
    claimed = operations.claim_batch(owner="gw:1", limit=10, now=gone.lease_expires_at + timedelta(seconds=1))
    assert [op.pk for op in claimed] == [pending.pk]
