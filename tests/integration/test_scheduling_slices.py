"""Between steps a long task yields: with several tasks running, each advances in turn."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.utils.module_loading import import_string
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from tasks import clock
from tasks.models import Checkpoint, Task
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep

pytestmark = pytest.mark.django_db


def deliver_next_kick() -> bool:
    """Do what one worker does with the broker: take the oldest due message and run it."""
    with transaction.atomic():
        row = (OrmQ.objects.select_for_update(skip_locked=True).filter(lock__lte=clock.now())
               .order_by("lock", "id").first())
        if row is None:
            return False
        package = SignedPackage.loads(row.payload)
        row.delete()
    import_string(package["func"])(*package["args"])
    return True


def run_broker(*, limit: int) -> None:
    for _ in range(limit):
        if not deliver_next_kick():
            return
    raise AssertionError(f"the broker still had messages after {limit}")


@pytest.mark.parametrize("slice_ms", [0, 60_000])
def test_running_tasks_take_turns_step_by_step(acme, alice, settings, slice_ms):
    # Even with a long time slice, a step yields when other work waits in the broker.
    settings.LONGHAUL_STEP_SLICE_MS = slice_ms
    OrmQ.objects.all().delete()
    tasks = [submit_sleep(acme, alice, steps=3) for _ in range(3)]
    run_broker(limit=100)
    assert all(t.status == TaskStatus.SUCCEEDED for t in Task.objects.filter(pk__in=[t.pk for t in tasks]))
    order = list(Checkpoint.objects.order_by("id").values_list("task_id", flat=True))
    ids = [t.pk for t in tasks]
    assert order == ids * 3, "steps interleave round-robin, one step per turn"
