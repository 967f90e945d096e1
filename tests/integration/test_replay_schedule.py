"""The admission records and their replay: each decision leaves its record, and replaying the records
under the recorded policy makes the decisions that were made (manage.py replay_schedule)."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
import time_machine
from django.core.management import CommandError, call_command

from tasks import actions, clock, deletion, jobs, replay, retention
from tasks.errors import QuotaExceeded
from tasks.models import AdmissionRecord, Task, TaskEvent, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus
from tests.conftest import make_user

S = TaskStatus
pytestmark = pytest.mark.django_db
START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _policy(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0  # one step per advance: a task ends exactly when the script says
    settings.LONGHAUL_AGING_SECONDS = 60
    settings.LONGHAUL_SHED_THRESHOLD = 0.8
    settings.LONGHAUL_MAX_RUNNING = 3
    # A slot taken back at a step boundary shows in the records as its release, but the yielded task's
    # second admission is not replayed (as a resumed task's is not): fidelity is checked without them.
    settings.LONGHAUL_TAKE_SLOTS_BACK = False


def submit(tenant: Tenant, user, *, priority: int = 0, steps: int = 1, **spec) -> Task | None:
    """Submit as the API does; None when refused."""
    try:
        return actions.submit(tenant=tenant, user=user, submission=actions.Submission(
            kind="sleep", input={"steps": steps, **spec}, priority=priority, internal=True))[0]
    except QuotaExceeded:
        return None


def recorded_admissions() -> list[int]:
    """Task ids in the order the runtime admitted them (its events, not the records)."""
    return list(TaskEvent.objects.filter(kind="admitted").order_by("id").values_list("task_id", flat=True))


def task_ids(order: list[replay.Admission]) -> list[int | None]:
    return [admission.task_id for admission in order]


def run_workload(tenants: list[tuple[Tenant, object]], *, seed: int, turns: int) -> None:
    """Arrivals and ends, a few seconds apart, through the real submission, admission and workers:
    submissions outpace ends, so queues build and the policy decides who goes next."""
    rng = random.Random(seed)
    with time_machine.travel(START, tick=False) as traveller:
        for _ in range(turns):
            traveller.shift(timedelta(seconds=rng.randint(1, 9)))
            running = list(Task.objects.filter(status__in=HOLDS_SLOT).order_by("id"))
            if running and rng.random() < 0.45:
                jobs.advance(rng.choice(running).pk)  # its one step: it ends and frees its slot
            else:
                tenant, user = rng.choice(tenants)
                submit(tenant, user, priority=rng.randint(-3, 5))
        while Task.objects.filter(status__in=HOLDS_SLOT).exists():  # the rest run to their end
            traveller.shift(timedelta(seconds=rng.randint(1, 9)))
            jobs.advance(Task.objects.filter(status__in=HOLDS_SLOT).order_by("id").first().pk)


@pytest.fixture
def three_tenants(acme, alice, globex, charlie) -> list[tuple[Tenant, object]]:
    Tenant.objects.filter(pk=acme.pk).update(weight=3, max_running=3)
    Tenant.objects.filter(pk=globex.pk).update(weight=1, max_running=2)
    initech = Tenant.objects.create(slug="initech", name="Initech", weight=2, max_running=3, max_queued=5)
    acme.refresh_from_db()
    globex.refresh_from_db()
    return [(acme, alice), (globex, charlie), (initech, make_user("dave", initech))]


@pytest.mark.smoke
@pytest.mark.parametrize("seed", [5, 7])  # initech's refusals: shed_low_priority with 5, tenant_queue_full with 7
def test_replaying_under_the_recorded_policy_makes_the_recorded_admissions(three_tenants, seed):
    run_workload(three_tenants, seed=seed, turns=90)
    end = clock.now()
    admitted = recorded_admissions()
    arrived = list(Task.objects.order_by("created_at", "id").values_list("id", flat=True))
    assert admitted != arrived, "the workload must make the policy choose, not serve arrivals in turn"

    report = replay.replay(START, end, replay.Overrides(), now=end)

    assert task_ids(report.actual_order) == admitted
    assert task_ids(report.replayed_order) == admitted
    assert [a.at for a in report.replayed_order] == [a.at for a in report.actual_order]
    figures = report.as_dict()["tenants"]
    assert figures["initech"]["actual"]["refused"] > 0, "the workload must fill initech's queue"
    for sides in figures.values():
        assert sides["replayed"] == sides["actual"]


def test_replaying_with_other_weights_or_aging_admits_in_another_order(three_tenants):
    run_workload(three_tenants, seed=7, turns=90)
    end = clock.now()
    admitted = recorded_admissions()

    reweighted = replay.replay(START, end, replay.Overrides(weights={"acme": 1, "globex": 6}), now=end)
    assert task_ids(reweighted.replayed_order) != admitted
    globex = reweighted.as_dict()["tenants"]["globex"]
    assert globex["replayed"]["wait_p50"] < globex["actual"]["wait_p50"], "more weight, shorter waits"

    impatient = replay.replay(START, end, replay.Overrides(aging_seconds=1), now=end)
    assert task_ids(impatient.replayed_order) != admitted
    ageless = replay.replay(START, end, replay.Overrides(aging_seconds=10**9), now=end)
    assert task_ids(ageless.replayed_order) != admitted, "aging decided some of the recorded admissions"


def test_a_larger_system_cap_admits_everything_on_arrival(three_tenants):
    run_workload(three_tenants, seed=7, turns=90)
    end = clock.now()
    report = replay.replay(START, end, replay.Overrides(max_running=1000), now=end).as_dict()
    # Each tenant's own max_running still holds, so only the lightest tenant may never have waited.
    assert report["tenants"]["acme"]["replayed"]["wait_max"] < report["tenants"]["acme"]["actual"]["wait_max"]


@pytest.mark.smoke
def test_each_decision_is_recorded_where_it_happens_and_outlives_the_task(acme, alice, settings):
    Tenant.objects.filter(pk=acme.pk).update(max_running=1, max_queued=1)
    acme.refresh_from_db()
    with time_machine.travel(START, tick=False) as traveller:
        asking = submit(acme, alice, steps=2, ask_at_step=2, question="Go on?")
        traveller.shift(timedelta(seconds=1))
        waiting = submit(acme, alice)
        traveller.shift(timedelta(seconds=1))
        assert submit(acme, alice, priority=5) is None  # acme's one place in the queue is taken
        traveller.shift(timedelta(seconds=1))
        jobs.advance(asking.pk)  # step 1
        traveller.shift(timedelta(seconds=1))
        jobs.advance(asking.pk)  # step 2 asks: no slot while it waits; the queued task gets it
        traveller.shift(timedelta(seconds=1))
        actions.answer(asking, user=alice, text="yes")  # queued again, behind the one running
        traveller.shift(timedelta(seconds=1))
        jobs.advance(waiting.pk)  # it ends; the answered task is admitted again
        traveller.shift(timedelta(seconds=1))
        jobs.advance(asking.pk)
    at = [START + timedelta(seconds=n) for n in range(8)]
    asking.refresh_from_db()
    assert asking.status == S.SUCCEEDED

    fields = ("arrived_at", "admitted_at", "started_at", "slot_released_at", "finished_at", "outcome")
    first = AdmissionRecord.objects.values(*fields).get(task_id=asking.pk)
    assert first == {"arrived_at": at[0], "admitted_at": at[0], "started_at": at[3], "slot_released_at": at[4],
                     "finished_at": at[7], "outcome": S.SUCCEEDED}, "the first admission and release are kept"
    second = AdmissionRecord.objects.values(*fields).get(task_id=waiting.pk)
    assert second == {"arrived_at": at[1], "admitted_at": at[4], "started_at": at[6], "slot_released_at": at[6],
                      "finished_at": at[6], "outcome": S.SUCCEEDED}
    refused = AdmissionRecord.objects.get(refused=True)
    assert (refused.task_id, refused.tenant_id, refused.priority, refused.kind, refused.rule, refused.arrived_at) == (
        None, acme.pk, 5, "sleep", "tenant_queue_full", at[2])
    assert (refused.max_running, refused.max_queued, refused.weight, refused.system_max_running,
            refused.aging_seconds) == (1, 1, 1, 3, 60.0), "the policy in force is recorded with the decision"

    deletion.delete_task(asking, user=alice)
    assert AdmissionRecord.objects.filter(task_id=asking.pk).exists(), "a record is no part of its task"


def test_a_task_cancelled_while_queued_leaves_the_replays_queue_when_it_left_the_real_one(acme, alice):
    Tenant.objects.filter(pk=acme.pk).update(max_running=1)
    with time_machine.travel(START, tick=False) as traveller:
        first = submit(acme, alice)
        traveller.shift(timedelta(seconds=1))
        cancelled = submit(acme, alice, priority=5)
        traveller.shift(timedelta(seconds=1))
        last = submit(acme, alice)
        traveller.shift(timedelta(seconds=1))
        actions.request_cancel(cancelled, user=alice)
        traveller.shift(timedelta(seconds=5))
        jobs.advance(first.pk)
        traveller.shift(timedelta(seconds=5))
        jobs.advance(last.pk)
    record = AdmissionRecord.objects.get(task_id=cancelled.pk)
    assert (record.admitted_at, record.outcome) == (None, S.CANCELLED)
    report = replay.replay(START, clock.now(), replay.Overrides(), now=clock.now())
    assert task_ids(report.replayed_order) == [first.pk, last.pk]
    assert report.as_dict()["tenants"]["acme"]["replayed"]["not_admitted"] == 1


def call(*args: str) -> str:
    out = StringIO()
    call_command("replay_schedule", *args, stdout=out)
    return out.getvalue()


def test_the_command_prints_a_table_and_one_json_document(three_tenants):
    run_workload(three_tenants, seed=3, turns=20)
    window = ("--from", START.isoformat(), "--to", (clock.now() + timedelta(seconds=1)).isoformat())

    table = call(*window, "--weights", "acme=1,globex=2")
    assert "wait p50" in table and "slot share" in table and "refused" in table
    assert "weights acme=1, globex=2, initech=2" in table
    assert {line.split()[0] for line in table.splitlines()[-3:]} == {"acme", "globex", "initech"}

    document = json.loads(call(*window, "--json", "--max-running", "5", "--aging-seconds", "30"))
    assert set(document) == {"from", "to", "arrivals", "policy", "tenants"}
    assert document["arrivals"] == AdmissionRecord.objects.count()
    assert (document["policy"]["replayed"]["max_running"], document["policy"]["recorded"]["max_running"]) == (5, 3)
    assert document["policy"]["replayed"]["aging_seconds"] == 30
    assert set(document["tenants"]) == {"acme", "globex", "initech"}
    for sides in document["tenants"].values():
        assert set(sides) == {"replayed", "actual"}
        assert set(sides["replayed"]) == {"admitted", "wait_p50", "wait_p95", "wait_max", "slot_share", "refused",
                                          "refused_by_rule", "not_admitted"}
    shares = [sides["actual"]["slot_share"] for sides in document["tenants"].values()]
    assert sum(shares) == pytest.approx(1, abs=0.001)


@pytest.mark.parametrize(("args", "message"), [
    (("--weights", "acme=x"), "acme=x: the weight must be a whole number"),
    (("--weights", "acme"), "'acme' is not slug=weight"),
    (("--weights", "acme=1,nobody=2"), "unknown tenants: nobody"),
    (("--to", "2026-03-01"), "must be after --from"),
    (("--max-running", "0"), "--max-running must be at least 1"),
    (("--aging-seconds", "0"), "--aging-seconds must be at least 1"),
])
def test_bad_arguments_are_refused_with_what_is_wrong(acme, args, message):
    with pytest.raises(CommandError, match=message):
        call("--from", "2026-03-02", *args)


def test_a_moment_that_is_not_iso_is_named():
    with pytest.raises(CommandError, match="--from 'yesterday' is not an ISO date"):
        call("--from", "yesterday")


def test_old_records_are_purged_with_their_retention(acme, alice, settings):
    settings.LONGHAUL_RETENTION_ADMISSIONS_DAYS = 30
    now = clock.now()
    with time_machine.travel(now - timedelta(days=31), tick=False):
        old = submit(acme, alice)
    with time_machine.travel(now - timedelta(days=29), tick=False):
        recent = submit(acme, alice)
    assert retention.purge(now)["admissions"] == 1
    assert list(AdmissionRecord.objects.values_list("task_id", flat=True)) == [recent.pk]
    assert Task.objects.filter(pk=old.pk).exists(), "the task itself is another class's business"


def test_the_admin_lists_an_operators_own_tenants_records_only(acme, alice, globex, charlie):
    from django.test import Client

    from tests.integration.test_admin import make_operator

    mine, theirs = submit(acme, alice), submit(globex, charlie)
    operator = make_operator("acme-operator", acme, permissions=("tasks.view_admissionrecord",))
    client = Client()
    client.force_login(operator)

    page = client.get("/admin/tasks/admissionrecord/")
    assert page.status_code == 200
    shown = {record.task_id for record in page.context["cl"].result_list}
    assert shown == {mine.pk}, f"globex's task {theirs.pk} must not be listed to an acme operator"
