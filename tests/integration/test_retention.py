"""Retention: each data class is forgotten after its own number of days, in bounded batches, and
never for a task that has not ended."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from chat.models import Message, Thread
from project import retention as rules
from tasks import actions, clock, retention, sweeper
from tasks.errors import InvalidInput
from tasks.events import NewEvent, append
from tasks.models import AuditEntry, Checkpoint, Operation, RetentionMark, Task, TaskEvent
from tasks.statuses import TaskStatus
from tests.factories import make_task
from tests.integration.test_metrics import TOKEN, bearer, samples, scrape, value

S = TaskStatus
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _retention(settings):
    settings.LONGHAUL_RETENTION_EVENTS_DAYS = 90
    settings.LONGHAUL_RETENTION_CHECKPOINTS_DAYS = 7
    settings.LONGHAUL_RETENTION_OPERATION_PAYLOADS_DAYS = 30
    settings.LONGHAUL_RETENTION_RESULTS_DAYS = 0
    settings.LONGHAUL_RETENTION_MESSAGES_DAYS = 0
    settings.LONGHAUL_RETENTION_AUDIT_DAYS = 0
    settings.LONGHAUL_RETENTION_ADMISSIONS_DAYS = 0  # tests/integration/test_replay_schedule.py purges them


def task_with_data(tenant, user, *, status: str = S.SUCCEEDED, ended_days_ago: float | None = 100) -> Task:
    now = clock.now()
    finished = now - timedelta(days=ended_days_ago) if ended_days_ago is not None else None
    task = make_task(tenant, user, status=status, finished_at=finished, result={"report": "kept?"}, current_step=3)
    with transaction.atomic():
        append(task, [NewEvent("queued"), NewEvent("step_done"), NewEvent(status)], status=status, at=now)
    for step in (1, 2, 3):
        Checkpoint.objects.create(task=task, step=step, fencing_token=1, state={"step": step}, schema_version=1, at=now)
    Operation.objects.create(task=task, key=f"{task.pk}:1:r0", step=1, n=0, kind="tool", name="search",
                             args={"query": "secret words"}, result={"hits": ["secret"]}, args_digest="d",
                             fencing_token=1, status="succeeded", created_at=now)
    return task


def data_of(task: Task) -> dict:
    op = Operation.objects.get(task=task)
    task.refresh_from_db()
    return {"events": TaskEvent.objects.filter(task=task).count(),
            "checkpoints": sorted(Checkpoint.objects.filter(task=task).values_list("step", flat=True)),
            "payload": (op.args, op.result), "result": task.result}


KEPT = {"events": 3, "checkpoints": [1, 2, 3], "payload": ({"query": "secret words"}, {"hits": ["secret"]}),
        "result": {"report": "kept?"}}


@pytest.mark.smoke
def test_an_old_ended_tasks_data_is_forgotten_class_by_class_and_its_last_checkpoint_kept(acme, alice):
    old = task_with_data(acme, alice, ended_days_ago=100)
    counts = retention.purge(clock.now())
    assert counts == {"events": 3, "checkpoints": 2, "operation_payloads": 1}
    assert data_of(old) == {"events": 0, "checkpoints": [3], "payload": (None, None), "result": {"report": "kept?"}}
    assert Task.objects.filter(pk=old.pk).exists(), "the task row stays"


def test_each_class_waits_its_own_number_of_days(acme, alice):
    task = task_with_data(acme, alice, ended_days_ago=10)  # past checkpoints' 7 days only
    retention.purge(clock.now())
    assert data_of(task) == {**KEPT, "checkpoints": [3]}


@pytest.mark.parametrize("status", [S.PARTIAL, S.PAUSED, S.RUNNING, S.WAITING_INPUT])
def test_a_task_that_has_not_ended_keeps_everything_however_old(acme, alice, status):
    task = task_with_data(acme, alice, status=status, ended_days_ago=400)  # a partial task has a finished_at
    assert retention.purge(clock.now()) == {"events": 0, "checkpoints": 0, "operation_payloads": 0}
    assert data_of(task) == KEPT


def test_results_messages_and_audit_are_forgotten_only_when_set(acme, alice, settings):
    task = task_with_data(acme, alice, ended_days_ago=100)
    thread = Thread.objects.create(tenant=acme, owner=alice)
    old_at = clock.now() - timedelta(days=100)
    Message.objects.create(thread=thread, role="user", content="an old question", created_at=old_at)
    Message.objects.create(thread=thread, role="user", content="a new question", created_at=clock.now())
    AuditEntry.objects.create(tenant=acme, actor=alice, action="task.cancel", target_type="task", target_id="x",
                              at=old_at)
    retention.purge(clock.now())
    assert data_of(task)["result"] == {"report": "kept?"}
    assert Message.objects.count() == 2 and AuditEntry.objects.count() == 1

    settings.LONGHAUL_RETENTION_RESULTS_DAYS = 30
    settings.LONGHAUL_RETENTION_MESSAGES_DAYS = 30
    settings.LONGHAUL_RETENTION_AUDIT_DAYS = 99
    counts = retention.purge(clock.now())
    assert (counts["results"], counts["messages"], counts["audit"]) == (1, 1, 1)
    assert data_of(task)["result"] is None
    assert list(Message.objects.values_list("content", flat=True)) == ["a new question"]
    assert Thread.objects.filter(pk=thread.pk).exists()


def test_a_pass_is_bounded_and_the_next_one_goes_on_where_it_stopped(acme, alice):
    moment = clock.now() - timedelta(days=100)
    tasks = [task_with_data(acme, alice) for _ in range(5)]
    Task.objects.filter(pk__in=[t.pk for t in tasks]).update(finished_at=moment)  # one moment for all five
    passes = [retention.purge(clock.now(), batch=2)["events"] for _ in range(12)]
    assert max(passes) == 2, "a pass deletes at most a batch of rows, however many its tasks have"
    assert sum(passes) == 15 and passes[-1] == 0
    assert not TaskEvent.objects.exists()
    mark = RetentionMark.objects.get(data_class="events")
    assert (mark.up_to, mark.up_to_id, mark.purged) == (moment, max(t.pk for t in tasks), 15)


def test_the_sweeper_purges_and_metrics_count_by_class(acme, alice, settings):
    settings.LONGHAUL_METRICS_TOKEN = TOKEN
    task_with_data(acme, alice)
    assert sweeper.run_once(now=clock.now())["retention_purged"] == 6
    found = samples(scrape(**bearer(TOKEN)))
    assert value(found, "longhaul_retention_purged_total", data_class="events") == 3
    assert value(found, "longhaul_retention_purged_total", data_class="checkpoints") == 2


def test_audit_must_outlive_every_other_class():
    days = dict(rules.DEFAULT_DAYS)
    rules.check(days)  # the defaults: audit kept for ever
    with pytest.raises(ImproperlyConfigured, match="LONGHAUL_RETENTION_AUDIT_DAYS must be 0 or at least "
                                                   "LONGHAUL_RETENTION_EVENTS_DAYS"):
        rules.check({**days, "results": 10, "messages": 10, "audit": 30})
    with pytest.raises(ImproperlyConfigured, match="LONGHAUL_RETENTION_RESULTS_DAYS"):
        rules.check({**days, "messages": 10, "audit": 400})
    rules.check({**days, "results": 10, "messages": 10, "audit": 400})


def test_a_tenant_keeps_its_data_for_its_own_number_of_days_and_others_for_the_systems(acme, alice, globex, charlie):
    """Acme forgets events after 10 days and keeps checkpoints for ever; Globex follows the system (90 and 7)."""
    actions.set_retention(acme, user=alice, overrides={"events": 10, "checkpoints": 0})
    ours = task_with_data(acme, alice, ended_days_ago=20)
    theirs = task_with_data(globex, charlie, ended_days_ago=20)

    for _ in range(3):
        retention.purge(clock.now())

    assert data_of(ours) == {**KEPT, "events": 0}
    assert data_of(theirs) == {**KEPT, "checkpoints": [3]}
    marks = dict(RetentionMark.objects.filter(tenant=acme).values_list("data_class", "purged"))
    assert marks == {"events": 3}, "the tenant's pass has its own watermark"
    assert RetentionMark.objects.get(data_class="checkpoints", tenant=None).purged == 2


def test_a_tenants_override_is_refused_naming_the_field_and_nothing_changes(acme, alice):
    with pytest.raises(InvalidInput, match="events must be a whole number of days") as out_of_range:
        actions.set_retention(acme, user=alice, overrides={"events": rules.MAX_DAYS + 1})
    assert out_of_range.value.field == "events"
    with pytest.raises(InvalidInput, match="unknown data class 'secrets'"):
        actions.set_retention(acme, user=alice, overrides={"secrets": 3})
    with pytest.raises(InvalidInput, match="audit must be 0 or at least events") as short_audit:
        actions.set_retention(acme, user=alice, overrides={"audit": 30})  # the system keeps events 90 days
    assert short_audit.value.field == "audit"
    acme.refresh_from_db()
    assert acme.retention == {} and not AuditEntry.objects.filter(action="tenant.retention").exists()


def test_a_tenant_that_drops_its_override_is_purged_by_the_systems_pass_again(acme, alice, globex, charlie):
    """The system's watermark went past the tenant's rows while they were left out: it walks them again."""
    actions.set_retention(acme, user=alice, overrides={"events": 0})  # acme keeps events for ever
    ours = task_with_data(acme, alice, ended_days_ago=100)
    theirs = task_with_data(globex, charlie, ended_days_ago=99)  # ended after ours: the watermark passes ours
    retention.purge(clock.now())
    assert (data_of(ours)["events"], data_of(theirs)["events"]) == (3, 0)

    actions.set_retention(acme, user=alice, overrides={})
    retention.purge(clock.now())
    assert data_of(ours)["events"] == 0
