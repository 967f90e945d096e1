"""Gateway pools per model, per tool and per MCP server: concurrency, rate limits, a provider's 429
pausing its pool, a task's cap on calls in flight, and tenants sharing a busy pool by weight."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from project import pools as pool_settings
from tasks import actions, clock, jobs, operations, pools
from tasks.models import Operation, Pool, Task, TaskEvent, Tenant
from tasks.statuses import OperationStatus, TaskStatus
from tests.factories import make_task
from tests.fakes.openai_server import FakeOpenAI, Reply, Status

Op = OperationStatus
PLAN_REPLY = json.dumps({"subquestions": ["What is cancellation?", "How is it delivered?"]})


def waiting_for_tools(tenant: Tenant, owner) -> Task:
    return make_task(tenant, owner, status=TaskStatus.WAITING_TOOL, next_run_at=None)


def call(task: Task, n: int, *, kind: str = "tool", name: str = "search", **fields: Any) -> Operation:
    values: dict[str, Any] = {"status": Op.PENDING, "attempts": 0, "args": {"q": n}}
    values.update(fields)
    return Operation.objects.create(task=task, key=f"{task.pk}:0:r{n}", step=0, n=n, kind=kind, name=name,
                                    args_digest=str(n), fencing_token=0, created_at=clock.now(), **values)


def in_flight(task: Task, n: int, **fields: Any) -> Operation:
    now = clock.now()
    return call(task, n, status=Op.STARTED, attempts=1, lease_owner="gw:0", started_at=now,
                lease_expires_at=now + timedelta(minutes=1), **fields)


def claimed(now=None) -> list[Operation]:
    return operations.claim_batch(owner="gw:1", limit=500, now=now or clock.now())


# --- pools by name ----------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.django_db
def test_a_full_search_pool_leaves_reads_their_own_slots(acme, alice, settings):
    settings.LONGHAUL_TOOL_CONCURRENCY = 2
    busy = waiting_for_tools(acme, alice)
    in_flight(busy, 0)
    in_flight(busy, 1)  # the search pool is full
    waiting = waiting_for_tools(acme, alice)
    search, visit = call(waiting, 0), call(waiting, 1, name="visit", args={"url": "https://example.org/"})

    assert {op.pool for op in (search, visit)} == {"tool:search", "tool:visit"}
    assert [op.pk for op in claimed()] == [visit.pk], "a slow search backend must not stall reads"


@pytest.mark.django_db
def test_a_job_with_little_room_shares_it_among_the_pools_with_calls_due(acme, alice):
    """The job's own room (LONGHAUL_GATEWAY_INFLIGHT less its calls out) is shared among the pools: a backlog
    of model calls must not take every slot a job frees while a search waits (the pools went in the order
    of their names, "model:" before "tool:", each taking all it could)."""
    tasks = [waiting_for_tools(acme, alice) for _ in range(5)]
    models = [call(task, 0, kind="model", name="plan") for task in tasks[:4]]
    search = call(tasks[4], 0)

    taken = operations.claim_batch(owner="gw:1", limit=2, now=clock.now())

    assert sorted(op.pk for op in taken) == [models[0].pk, search.pk]


@pytest.mark.django_db
def test_a_pool_that_needs_less_than_its_share_leaves_the_rest_to_the_others(acme, alice):
    tasks = [waiting_for_tools(acme, alice) for _ in range(5)]
    models = [call(task, 0, kind="model", name="plan") for task in tasks[:4]]
    search = call(tasks[4], 0)

    taken = operations.claim_batch(owner="gw:1", limit=4, now=clock.now())

    assert sorted(op.pk for op in taken) == sorted([search.pk, *(op.pk for op in models[:3])])


@pytest.mark.django_db
def test_the_pool_whose_call_was_asked_for_first_goes_first(acme, alice):
    first, second = waiting_for_tools(acme, alice), waiting_for_tools(acme, alice)
    search = call(first, 0)
    model = call(second, 0, kind="model", name="plan")

    assert [op.pk for op in operations.claim_batch(owner="gw:1", limit=1, now=clock.now())] == [search.pk]
    assert [op.pk for op in operations.claim_batch(owner="gw:2", limit=1, now=clock.now())] == [model.pk]


# A claim of one pool's call: the read of calls whose job died (lost, poison), the pools with calls due; in the
# claim's transaction (BEGIN or SAVEPOINT, and its end), the claims' lock, the pool's row, its calls out per tenant
# (their sum, its room), the candidates with their tenants' weights, their tasks' calls out, the chosen rows locked
# and started. (Opening a claimed call's sealed arguments may read its tenant and key: not counted.)
ONE_POOL_CLAIM_STATEMENTS = 11


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the claims' lock is PostgreSQL's advisory lock")
@pytest.mark.django_db
def test_a_claim_counts_a_pools_calls_out_once_and_writes_no_row_for_a_pool_without_a_rate_limit(acme, alice):
    call(waiting_for_tools(acme, alice), 0)
    assert len(claimed()) == 1  # the search pool's row exists now
    search = call(waiting_for_tools(acme, alice), 0)

    with CaptureQueriesContext(connection) as queries:
        assert [op.pk for op in claimed()] == [search.pk]

    statements = [query["sql"] for query in queries.captured_queries
                  if '"tasks_tenantkey"' not in query["sql"] and not query["sql"].startswith(
                      'SELECT "tasks_task"."tenant_id" AS "tenant_id" FROM "tasks_task" WHERE "tasks_task"."id" =')]
    assert not [sql for sql in statements if sql.startswith('UPDATE "tasks_pool"')], (
        "a pool with no rate limit has no allowance to save at every claim")
    assert len(statements) == ONE_POOL_CLAIM_STATEMENTS, statements


@pytest.mark.django_db
def test_a_claim_fails_a_lost_call_and_a_poison_call_and_starts_the_rest_again(acme, alice, settings):
    gone = clock.now() - timedelta(seconds=1)

    def died_during(**fields: Any) -> Operation:  # a call whose gateway job died: its lease ran out
        values = {"attempts": 1, **fields}
        return call(waiting_for_tools(acme, alice), 0, status=Op.STARTED, lease_owner="gw:0", started_at=gone,
                    lease_expires_at=gone, **values)

    once = died_during(has_side_effects=True)
    hanging = died_during(attempts=settings.LONGHAUL_MAX_ATTEMPTS)
    again = died_during()  # runs again

    assert [op.pk for op in claimed()] == [again.pk]
    once.refresh_from_db()
    hanging.refresh_from_db()
    assert (once.status, once.error_message) == (Op.FAILED, operations.LOST)
    assert (hanging.status, hanging.error_class) == (Op.FAILED, "poison")


@pytest.mark.django_db
def test_each_mcp_server_and_each_configured_pool_has_its_own_limit(acme, alice, settings):
    settings.LONGHAUL_POOLS = {"tool:search": {"concurrency": 1}, "mcp:slow": {"concurrency": 1}}
    tasks = [waiting_for_tools(acme, alice) for _ in range(4)]
    searches = [call(task, 0) for task in tasks[:2]]
    slow = [call(task, 1, kind="mcp", name="tools/call", args={"server": "slow"}) for task in tasks[2:]]
    fast = call(tasks[3], 2, kind="mcp", name="tools/call", args={"server": "fast"})

    assert sorted(op.pk for op in claimed()) == sorted([searches[0].pk, slow[0].pk, fast.pk])


def test_pool_settings_name_what_is_wrong():
    assert pool_settings.parse("") == {}
    assert pool_settings.parse('{"model:openai:gpt-4o": {"tokens_per_minute": 1000}}') == {
        "model:openai:gpt-4o": {"tokens_per_minute": 1000}}
    for raw, words in (("[1]", "JSON object"), ("{", "JSON object"),
                       ('{"search": {}}', "'search' is not a pool"),
                       ('{"tool:search": {"rpm": 1}}', "unknown limit 'rpm'"),
                       ('{"tool:search": {"tokens_per_minute": 5}}', "model pools only"),
                       ('{"tool:search": {"concurrency": 0}}', "at least 1"),
                       ('{"tool:search": {"requests_per_minute": -1}}', "whole number"),
                       ('{"tool:search": {"requests_per_minute": true}}', "whole number")):
        with pytest.raises(ImproperlyConfigured, match=words):
            pool_settings.parse(raw)


# --- rate limits -------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.django_db
def test_a_requests_per_minute_limit_holds_and_refills(acme, alice, settings):
    settings.LONGHAUL_POOLS = {"tool:search": {"requests_per_minute": 2}}
    start = clock.now()
    for _ in range(5):
        call(waiting_for_tools(acme, alice), 0)

    assert len(claimed(start)) == 2, "a new pool starts with a minute's allowance"
    assert claimed(start) == []
    assert operations.rate_held_until(start) == start + timedelta(seconds=30), "one request is back in 30 s"
    assert len(claimed(start + timedelta(seconds=30))) == 1
    assert len(claimed(start + timedelta(minutes=5))) == 2, "the allowance never exceeds a minute's worth"


@pytest.mark.django_db
def test_a_model_pools_tokens_per_minute_are_spent_by_the_answers(acme, alice, settings):
    key = pools.key_of("model", "plan", None)
    settings.LONGHAUL_POOLS = {key: {"tokens_per_minute": 1000}}
    start = clock.now()
    first = call(waiting_for_tools(acme, alice), 0, kind="model", name="plan")
    second = call(waiting_for_tools(acme, alice), 0, kind="model", name="plan")
    assert [op.pk for op in claimed(start)] == [first.pk, second.pk], "tokens are known once a call answers"

    pools.spend_tokens(key, 1600, now=start)  # both answers together: 600 over the minute's 1,000
    third = call(waiting_for_tools(acme, alice), 0, kind="model", name="plan")
    assert claimed(start) == []
    assert claimed(start + timedelta(seconds=30)) == [], "30 s refill 500 tokens: still 100 short"
    assert [op.pk for op in claimed(start + timedelta(seconds=37))] == [third.pk]


# --- a provider's 429 --------------------------------------------------------------


@pytest.fixture
def fake_model(settings):
    with FakeOpenAI(default=Reply(content=PLAN_REPLY)) as server:
        settings.LONGHAUL_MODEL_PROVIDER = "openai"
        settings.LONGHAUL_MODEL_BASE_URL = server.base_url
        settings.LONGHAUL_MODEL = "fake-model"
        settings.LONGHAUL_MODEL_API_KEY = "sk-test"
        settings.LONGHAUL_STEP_SLICE_MS = 0
        yield server


def waiting_for_its_plan(tenant: Tenant, user) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="research", input={"question": "How does asyncio task cancellation work?"}))
    jobs.advance(task.pk)  # the first step asks for the plan
    return task


@pytest.mark.django_db(transaction=True)
def test_a_429_with_retry_after_pauses_the_models_pool_and_tells_its_tasks(fake_model, acme, alice, globex,
                                                                           charlie, settings):
    key = "model:openai:fake-model"
    settings.LONGHAUL_POOLS = {key: {"concurrency": 1}}
    settings.LONGHAUL_METRICS_TOKEN = "scrape"
    first, second = waiting_for_its_plan(acme, alice), waiting_for_its_plan(globex, charlie)
    fake_model.script(Status(429, headers={"Retry-After": "120"}))

    before = clock.now()
    assert operations.run_due(run_for=2) == 1
    assert fake_model.request_count == 1, "nothing else of the pool started while it was paused"

    pool = Pool.objects.get(key=key)
    assert pool.paused_until >= before + timedelta(seconds=120) and pool.pauses == 1
    handed_back = Operation.objects.get(task=first, kind="model")
    assert (handed_back.status, handed_back.attempts) == (Op.PENDING, 0)
    assert handed_back.not_before >= before + timedelta(seconds=120)
    assert Task.objects.get(pk=first.pk).retries == 1, "a 429 draws on the task's one retry budget"
    for task in (first, second):
        told = TaskEvent.objects.filter(task=task, kind=pools.PAUSED).values_list("data", flat=True)
        assert [(d["pool"], d["until"]) for d in told] == [("openai:fake-model", pool.paused_until.isoformat())]
    assert not operations.due_exists(clock.now()), "the sweeper leaves a paused pool to its kick"
    assert operations.rate_held_until(clock.now()) == pool.paused_until

    scraped = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    assert f'longhaul_pool_rate_limited_total{{kind="model",pool="{key}"}} 1.0' in scraped
    assert f'longhaul_pool_paused_seconds{{kind="model",pool="{key}"}} 0.0' not in scraped

    # A task that asks for the pool while it is paused is told at once.
    third = waiting_for_its_plan(acme, alice)
    assert TaskEvent.objects.filter(task=third, kind=pools.PAUSED).count() == 1

    after = pool.paused_until + timedelta(seconds=1)
    assert [op.task_id for op in claimed(after)] == [first.pk], "the refused call runs first when the pause ends"


@pytest.mark.django_db(transaction=True)
def test_a_429_without_retries_left_fails_the_call_and_still_pauses_the_pool(fake_model, acme, alice, settings):
    task = waiting_for_its_plan(acme, alice)
    Task.objects.filter(pk=task.pk).update(budget={**task.budget, "max_retries": 0})
    fake_model.script(Status(429, headers={"Retry-After": "120"}))

    assert operations.run_due(run_for=2) == 1
    op = Operation.objects.get(task=task, kind="model")
    assert (op.status, op.error_class) == (Op.FAILED, "rate_limited")
    assert Pool.objects.get(key="model:openai:fake-model").paused_until is not None, (
        "the provider asked every caller to wait, not only those with retries left")


@pytest.mark.django_db(transaction=True)
def test_a_retry_after_beyond_an_hour_is_an_hours_pause_for_the_call_too(fake_model, acme, alice):
    task = waiting_for_its_plan(acme, alice)
    fake_model.script(Status(429, headers={"Retry-After": "864000"}))

    assert operations.run_due(run_for=2) == 1
    pool = Pool.objects.get(key="model:openai:fake-model")
    op = Operation.objects.get(task=task, kind="model")
    assert pool.paused_until - clock.now() <= pools.MAX_PAUSE
    assert (op.status, op.not_before) == (Op.PENDING, pool.paused_until)


@pytest.mark.django_db(transaction=True)
def test_a_429_for_a_task_cancelled_meanwhile_is_recorded_not_handed_back(fake_model, acme, alice):
    task = waiting_for_its_plan(acme, alice)
    gate = fake_model.hold(lambda body: True)
    fake_model.script(Status(429, headers={"Retry-After": "60"}))

    import threading

    ran = threading.Thread(target=operations.run_due, kwargs={"run_for": 2})
    ran.start()
    try:
        deadline = clock.now() + timedelta(seconds=10)
        while fake_model.held == 0 and clock.now() < deadline:
            threading.Event().wait(0.02)
        actions.request_cancel(Task.objects.get(pk=task.pk), user=alice)
    finally:
        gate.set()
        ran.join(10)
    op = Operation.objects.get(task=task, kind="model")
    assert Task.objects.get(pk=task.pk).status == TaskStatus.CANCELLED
    assert op.status == Op.FAILED, "a call its ended task no longer waits for is closed, not pending for ever"


def test_a_retry_after_of_infinity_says_nothing():
    from tasks.gateway.retry import retry_after_seconds

    assert retry_after_seconds("inf") is None and retry_after_seconds("1e400") is None


@pytest.mark.django_db
def test_a_step_asking_a_paused_pool_and_a_free_one_is_not_held_for_the_pause(acme, alice):
    from tasks.drivers import OpRequest

    now = clock.now()
    until, _ = pools.pause("tool:search", seconds=600, reason="429", now=now)
    task = waiting_for_tools(acme, alice)
    with transaction.atomic():
        due = operations.request(task, token=0, now=now, step=0, requests=[
            OpRequest("tool", "search", {"query": "q"}), OpRequest("tool", "visit", {"url": "https://example.org/"})])
    assert due == now, "the read goes at once"
    with transaction.atomic():
        due = operations.request(task, token=0, now=now, step=0, requests=[OpRequest("tool", "search", {"query": "r"})])
    assert due == until


@pytest.mark.django_db
def test_a_pool_the_admin_listed_before_its_first_call_starts_with_a_full_minute(acme, alice, settings):
    settings.LONGHAUL_POOLS = {"tool:search": {"requests_per_minute": 3}}
    Pool.objects.bulk_create([Pool(key=key) for key in pools.known()], ignore_conflicts=True)  # as the admin does
    for _ in range(5):
        call(waiting_for_tools(acme, alice), 0)
    assert len(claimed()) == 3


@pytest.mark.django_db
def test_a_pools_setting_naming_no_pool_is_warned_about(settings):
    from tasks.checks import pools_named

    settings.LONGHAUL_POOLS = {"tool:serch": {"concurrency": 2}, "tool:search": {"concurrency": 2}}
    warnings = pools_named()
    assert [w.id for w in warnings] == ["longhaul.W001"] and "'tool:serch'" in warnings[0].msg


def test_more_gateway_turns_than_worker_processes_are_warned_about(settings):
    from tasks.checks import gateway_turns

    settings.LONGHAUL_STEP_WORKERS, settings.LONGHAUL_GATEWAY_TURNS = 2, 2
    assert gateway_turns() == []
    settings.LONGHAUL_GATEWAY_TURNS = 3
    [warning] = gateway_turns()
    assert warning.id == "longhaul.W003" and "LONGHAUL_GATEWAY_TURNS is 3, above the 2 worker processes" in warning.msg


@pytest.mark.django_db
def test_a_pages_429_does_not_pause_every_read():
    assert pools.pauses_on_rate_limit("tool:search") and pools.pauses_on_rate_limit("model:openai:x")
    assert not pools.pauses_on_rate_limit("tool:visit")


# --- sharing a busy pool -------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.django_db
def test_a_task_that_fans_out_takes_at_most_its_cap(acme, alice, settings):
    settings.LONGHAUL_TASK_CALLS_IN_FLIGHT = 8
    wide = waiting_for_tools(acme, alice)
    fan = [call(wide, n, name="visit", args={"url": f"https://example.org/{n}"}) for n in range(30)]
    narrow = call(waiting_for_tools(acme, alice), 0, name="visit", args={"url": "https://example.org/x"})

    first = Counter(op.task_id for op in claimed())
    assert first == {wide.pk: 8, narrow.task_id: 1}
    assert claimed() == [], "nothing more while the wide task has 8 calls out"
    for op in fan[:3]:
        assert operations.record(op.pk, owner="gw:1", result={"text": "read"})
    assert Counter(op.task_id for op in claimed()) == {wide.pk: 3}


@pytest.mark.django_db
def test_a_busy_pools_slots_follow_tenant_weights(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_POOLS = {"tool:search": {"concurrency": 4}}
    Tenant.objects.filter(pk=acme.pk).update(weight=3)
    Tenant.objects.filter(pk=globex.pk).update(weight=1)
    # Globex asked first: oldest-first alone would give it every slot.
    for tenant, user in ((globex, charlie), (acme, alice)):
        for _ in range(6):
            call(waiting_for_tools(tenant, user), 0)

    got = Counter(Task.objects.get(pk=op.task_id).tenant_id for op in claimed())
    assert got == {acme.pk: 3, globex.pk: 1}


@pytest.mark.django_db
def test_calls_a_tenant_already_has_out_count_against_its_share(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_POOLS = {"tool:search": {"concurrency": 4}}
    in_flight(waiting_for_tools(acme, alice), 0)
    in_flight(waiting_for_tools(acme, alice), 0)
    # Equal weights, acme asked first and holds 2 of the 4 slots: the 2 left are globex's.
    for tenant, user in ((acme, alice), (globex, charlie)):
        for _ in range(3):
            call(waiting_for_tools(tenant, user), 0)

    got = Counter(Task.objects.get(pk=op.task_id).tenant_id for op in claimed())
    assert got == {globex.pk: 2}


@pytest.mark.django_db
def test_a_tenant_with_many_older_calls_does_not_hide_another_tenants_one(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_POOLS = {"tool:search": {"concurrency": 4}}
    Tenant.objects.filter(pk=globex.pk).update(weight=10)
    for _ in range(70):
        call(waiting_for_tools(acme, alice), 0)
    late = call(waiting_for_tools(globex, charlie), 0)

    assert late.pk in {op.pk for op in claimed()}


def test_choose_gives_leftovers_to_weight_zero_and_skips_capped_tasks():
    candidates = [pools.Candidate(op_id=n, task_id=10, tenant_id=1) for n in range(3)]
    candidates.append(pools.Candidate(op_id=3, task_id=20, tenant_id=2))
    picked = pools.choose(candidates, room=6, tenant_busy=Counter(), task_room={10: 2, 20: 5}, weights={1: 1, 2: 0})
    assert [c.op_id for c in picked] == [0, 1, 3], "task 10 stops at its room; weight 0 gets what is left"
    picked = pools.choose(candidates, room=1, tenant_busy=Counter({1: 5}), task_room={10: 2, 20: 5},
                          weights={1: 1, 2: 0})
    assert [c.op_id for c in picked] == [0], "a weighted tenant goes first however busy it is"


# --- the admin -------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_shows_each_pool_with_its_limits_load_and_pause(acme, alice, settings):
    from django.contrib.auth.models import User

    settings.LONGHAUL_POOLS = {"tool:search": {"concurrency": 3, "requests_per_minute": 90}}
    in_flight(waiting_for_tools(acme, alice), 0)
    pools.pause("tool:search", seconds=90, reason="search API rate-limited the request (HTTP 429)", now=clock.now())
    root = Client()
    root.force_login(User.objects.create_superuser("root", password="root-password-1"))

    page = root.get("/admin/tasks/pool/")
    assert page.status_code == 200
    text = page.content.decode()
    for shown in ("tool:search", "tool:visit", pools.key_of("model", "plan", None), ">90<", "HTTP 429"):
        assert shown in text, shown
    staff = User.objects.create_user("staff", password="staff-password-1", is_staff=True)
    operator = Client()
    operator.force_login(staff)
    assert operator.get("/admin/tasks/pool/").status_code == 403, "a pool's load is every tenant's: superusers only"


@pytest.mark.django_db
@pytest.mark.parametrize("comes_due", ["pending, no wait", "pending, its wait is over", "started, its job died"])
def test_the_sweeper_sees_a_call_due_each_way_a_call_comes_due(acme, alice, settings, comes_due):
    # operations.due_exists reads each way apart, off its own index: none may be left out.
    settings.LONGHAUL_TASK_CALLS_IN_FLIGHT = 8  # room beside the call already out, whatever the defaults
    settings.LONGHAUL_TOOL_CONCURRENCY = 8
    now = clock.now()
    task = waiting_for_tools(acme, alice)
    call(task, 0, not_before=now + timedelta(minutes=5))  # never due in this test
    call(task, 1, status=Op.STARTED, attempts=1, lease_owner="gw:0", started_at=now,
         lease_expires_at=now + timedelta(minutes=1))  # out, its job alive
    assert not operations.due_exists(now)

    if comes_due == "pending, no wait":
        call(task, 2)
    elif comes_due == "pending, its wait is over":
        call(task, 2, not_before=now - timedelta(seconds=1))
    else:
        call(task, 2, status=Op.STARTED, attempts=1, lease_owner="gw:0", started_at=now - timedelta(minutes=2),
             lease_expires_at=now - timedelta(seconds=1))
    assert operations.due_exists(now)
