"""The hot path's statements: a step that continues in place commits in one fenced UPDATE (checkpoint,
events, next step due) with no read of the row first, and falls back to the locked commit when the
row moved on under it. A step that asks for calls (research, MCP) commits them the same way, after
reading the last step's calls once."""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.db import DatabaseError, DataError, close_old_connections, connection, transaction
from django.test.utils import CaptureQueriesContext
from django_q.models import OrmQ

from tasks import (
    actions,
    clock,
    events,
    jobs,
    kicks,
    leases,
    operations,
    prepared,
    requested,
    runner,
    sealed,
    transitions,
)
from tasks.context import StepContext
from tasks.drivers import Continue, OpRequest, get_driver
from tasks.errors import LeaseLost, TamperedContent
from tasks.events import NewEvent
from tasks.models import AdmissionRecord, Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep

pytestmark = pytest.mark.django_db(transaction=True)  # real BEGIN and COMMIT, not savepoints
# The waiting probe and the fenced UPDATE, which commits alone (on PostgreSQL the same statement writes the
# checkpoint and the events); SQLite's is a transaction: BEGIN, the UPDATE, the checkpoint and the events with
# a statement each, COMMIT.
IN_PLACE_STATEMENTS = {"postgresql": 2, "sqlite": 6}
# A research step after a kick: the claim (with the checkpoint and the last step's calls); the fenced UPDATE, which
# writes the checkpoint, the events, the calls (while none of their pools is paused) and their gateway kick (while
# no job holds the turn) too, and commits alone; the turn's closing look.
RESUMED_WITH_CALLS_STATEMENTS = 3
MOVES_ON = Continue({"done": 1, "of": 3})
ASKS_FOR_CALLS = Continue({"done": 1, "of": 3}, requests=[OpRequest(kind="tool", name="search",
                                                                     args={"query": "asyncio cancellation"})])


def steps_of(queries: list[dict]) -> list[list[str]]:
    """The statements of each commit (a transaction, or a step's fenced UPDATE committed alone), with what
    ran before it since the commit before."""
    steps, current, in_transaction = [], [], False
    for query in queries:
        sql = query["sql"]
        current.append(sql)
        in_transaction = (in_transaction or sql == "BEGIN") and sql != "COMMIT"
        if sql == "COMMIT" or (not in_transaction and sql.startswith("WITH moved AS (UPDATE")):
            steps.append(current)
            current = []
    return steps


def test_a_step_that_continues_in_place_sends_two_statements_and_one_write_of_its_row(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    task = submit_sleep(acme, alice, steps=5)
    OrmQ.objects.all().delete()  # nothing waiting: the worker keeps the lease between steps
    with CaptureQueriesContext(connection) as queries:
        jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED

    transactions = steps_of(queries.captured_queries)
    if connection.vendor != "postgresql":
        transactions = transactions[1:]  # the claim, a transaction of its own (on PostgreSQL, one statement)
    _first, *in_place, _last = transactions
    assert len(in_place) == 3, transactions
    for statements in in_place:
        assert len(statements) <= IN_PLACE_STATEMENTS[connection.vendor], statements
        # (The probe asks whether other tasks are due: it reads no row this task's commit wrote.)
        reads = [sql for sql in statements
                 if sql.startswith("SELECT") and "tasks_" in sql and not _is_probe(sql)]
        assert not reads, f"a step run in place read again what its last commit wrote: {reads}"
        updates = [sql for sql in statements if sql.startswith(("UPDATE", "WITH moved AS (UPDATE"))]
        assert len(updates) == 1, f"the fence, the step and the event seqs are one UPDATE: {updates}"
        if connection.vendor == "postgresql":
            assert "BEGIN" not in statements, f"the UPDATE commits alone: {statements}"
            assert 'INSERT INTO "tasks_checkpoint"' in updates[0], f"the checkpoint is the UPDATE's: {statements}"
            assert 'INSERT INTO "tasks_taskevent"' in updates[0], f"and so are the events: {statements}"
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == [1, 2, 3, 4, 5]
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_step_after_a_kick_reads_its_checkpoint_and_calls_with_its_claim(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0  # one step a job: each step after the first is claimed after a kick
    task = submit_sleep(acme, alice, steps=3)
    jobs.advance(task.pk)
    with CaptureQueriesContext(connection) as queries:
        jobs.advance(task.pk)

    statements = [query["sql"] for query in queries.captured_queries]
    before_commit = statements[:statements.index("BEGIN")]
    assert not [sql for sql in before_commit if 'FROM "tasks_checkpoint"' in sql or 'FROM "tasks_operation"' in sql], (
        f"the claim brought the checkpoint and said the step before asked for no call: {before_commit}")
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED
    # Each step went on from the one before: the state the claims brought was the last checkpoint's.
    assert [c.state["done"] for c in Checkpoint.objects.filter(task=task).order_by("step")] == [1, 2, 3]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_the_claim_brings_the_latest_checkpoint_as_a_read_of_it_would(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_sleep(acme, alice, steps=4)
    jobs.advance(task.pk)
    jobs.advance(task.pk)
    Task.objects.filter(pk=task.pk).update(lease_owner="", next_run_at=clock.now())

    claimed = leases.claim(task.pk, owner="worker-b", now=clock.now())

    assert claimed is not None and claimed.resume is not None
    latest = Checkpoint.objects.filter(task=task).order_by("-step").first()
    brought = claimed.resume.checkpoint
    assert (brought.pk, brought.step, brought.fencing_token, brought.schema_version, brought.at) == (
        latest.pk, latest.step, latest.fencing_token, latest.schema_version, latest.at)
    assert brought.state == latest.state == {"done": 2, "of": 4}
    assert claimed.resume.calls == ()


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_worker_that_claims_a_task_opens_its_sealed_checkpoint_without_asking_its_tenant_again(
        acme, alice, settings):
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_sleep(acme, alice, steps=4)
    jobs.advance(task.pk)
    Task.objects.filter(pk=task.pk).update(lease_owner="", next_run_at=clock.now())
    sealed._row_tenants.clear()  # a worker process that has not seen this task yet

    with CaptureQueriesContext(connection) as queries:
        claimed = leases.claim(task.pk, owner="worker-b", now=clock.now())

    assert claimed is not None and claimed.resume.checkpoint.state == {"done": 1, "of": 4}
    statements = [query["sql"] for query in queries.captured_queries]
    assert len(statements) == 1, f"the claim alone: its row said the tenant the checkpoint is sealed for: {statements}"


@pytest.mark.parametrize("outcome", [MOVES_ON, ASKS_FOR_CALLS], ids=["moves on", "asks for calls"])
def test_a_stop_asked_for_during_the_step_is_honoured_by_the_locked_commit(acme, alice, settings, outcome):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    task = submit_sleep(acme, alice, steps=3)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    actions.request_cancel(task=Task.objects.get(pk=task.pk), user=alice, reason="enough")

    ctx = StepContext(held, token=held.fencing_token)
    kept = runner._commit(held, held.fencing_token, get_driver("sleep"), outcome, ctx, keep_lease=True,
                          state_before={})

    assert kept is None, "the worker must not run another step of a task asked to stop"
    task.refresh_from_db()
    assert task.status == TaskStatus.CANCELLED
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == [1]
    assert not Operation.objects.filter(task=task).exclude(status="failed").exists(), "no call is left to run"
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))


@pytest.mark.parametrize("outcome", [MOVES_ON, ASKS_FOR_CALLS], ids=["moves on", "asks for calls"])
def test_a_fenced_out_worker_writes_nothing_without_reading_the_row_first(acme, alice, outcome):
    task = submit_sleep(acme, alice, steps=3)
    stale = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert stale is not None
    Task.objects.filter(pk=task.pk).update(fencing_token=stale.fencing_token + 1, lease_owner="worker:2")
    before = Task.objects.get(pk=task.pk).last_event_seq

    ctx = StepContext(stale, token=stale.fencing_token)
    with pytest.raises(LeaseLost):
        runner._commit(stale, stale.fencing_token, get_driver("sleep"), outcome, ctx, keep_lease=True,
                       state_before={})
    assert not Checkpoint.objects.filter(task=task).exists()
    assert not Operation.objects.filter(task=task).exists()
    assert Task.objects.get(pk=task.pk).last_event_seq == before


def test_the_checkpoint_the_fenced_update_writes_is_sealed_and_reads_back_as_written(acme, alice, settings):
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    task = submit_sleep(acme, alice, steps=3)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    state = {"done": 1, "of": 3, "note": "a-marker-only-this-checkpoint-holds", "at": [1.5, None, True]}

    ctx = StepContext(held, token=held.fencing_token)
    kept = runner._commit(held, held.fencing_token, get_driver("sleep"), Continue(state), ctx, keep_lease=True,
                          state_before={})

    assert kept is not None
    written = Checkpoint.objects.get(task=task)
    assert (written.step, written.fencing_token, written.schema_version, written.state) == (
        1, held.fencing_token, get_driver("sleep").schema_version, state)
    assert written.at == Task.objects.get(pk=task.pk).last_progress_at
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT state FROM {Checkpoint._meta.db_table} WHERE id = %s", [written.pk])
        (stored,) = cursor.fetchone()
    assert "a-marker-only-this-checkpoint-holds" not in str(stored), "the checkpoint was written in the clear"


def test_the_events_the_fenced_update_writes_take_the_seqs_it_reserved_sealed_and_heard_as_written(
        acme, alice, settings):
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    task = submit_sleep(acme, alice, steps=3)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    before = Task.objects.get(pk=task.pk).last_event_seq
    heard: list[tuple[int, str, dict]] = []
    in_its_transaction: list[bool] = []

    def listener(_task: Task, batch) -> None:
        heard.extend((event.seq, event.kind, event.data) for event in batch)
        in_its_transaction.append(connection.in_atomic_block)

    said = [NewEvent("progress", {"note": "a-marker-only-this-event-holds"}), NewEvent("progress", {"n": 2})]
    events.on_append(listener, kinds={"progress"})
    try:
        kept = runner._commit(held, held.fencing_token, get_driver("sleep"), Continue({"done": 1, "of": 3},
                              events=said), StepContext(held, token=held.fencing_token), keep_lease=True,
                              state_before={})
    finally:
        del events._listeners[listener]

    assert kept is not None
    # What a listener writes commits with the events: a step whose events one hears is not committed alone.
    assert in_its_transaction == [True]
    row = Task.objects.get(pk=task.pk)
    written = TaskEvent.objects.filter(task=task, seq__gt=before).order_by("seq")
    stored = list(written.values_list("seq", "kind", "data"))
    assert [seq for seq, _, _ in stored] == list(range(before + 1, row.last_event_seq + 1)), "gapless, up to the row's"
    assert [(kind, data) for _, kind, data in stored if kind == "progress"] == [(e.kind, e.data) for e in said]
    assert heard == stored, "listeners hear the events with the seqs they were written with"
    assert set(written.values_list("status", flat=True)) == {TaskStatus.RUNNING}
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT data FROM {TaskEvent._meta.db_table} WHERE task_id = %s", [task.pk])
        assert "a-marker-only-this-event-holds" not in str(cursor.fetchall()), "an event was written in the clear"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite does not hold a text to its column's length")
def test_an_event_too_long_for_its_column_is_refused_by_the_fenced_update_not_cut_short(acme, alice):
    task = submit_sleep(acme, alice, steps=3)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    before = Task.objects.get(pk=task.pk).last_event_seq
    with pytest.raises(DataError), transaction.atomic():
        transitions.commit_step(held, token=held.fencing_token, now=clock.now(), keep_lease=True,
                                events=[NewEvent("k" * (TaskEvent._meta.get_field("kind").max_length + 1))])
    assert Task.objects.get(pk=task.pk).last_event_seq == before
    assert not TaskEvent.objects.filter(task=task, kind__startswith="kkk").exists()


def submit_research(tenant, user) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="research", input={"question": "How does asyncio task cancellation work?"}))
    return task


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="counts PostgreSQL's statements (one-statement claim)")
def test_a_step_resumed_after_its_calls_reads_them_with_its_claim_and_asks_for_more_without_reading_the_row(
        acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_research(acme, alice)
    jobs.advance(task.pk)  # the plan: one model call
    operations.run_due(run_for=5)
    task.refresh_from_db()
    asked_at = task.current_step
    assert not operations.unfinished(task.pk, asked_at - 1)

    with CaptureQueriesContext(connection) as queries:
        jobs.advance(task.pk)

    task.refresh_from_db()
    assert task.current_step == asked_at + 1
    assert operations.unfinished(task.pk, asked_at), "the step asked for its searches"
    statements = [query["sql"] for query in queries.captured_queries]
    assert "BEGIN" not in statements, f"the step's commit is one statement, committed alone: {statements}"
    [commit] = [sql for sql in statements if sql.startswith("WITH moved AS (UPDATE")]
    for table in ("tasks_checkpoint", "tasks_taskevent", "tasks_operation", "django_q_ormq"):
        assert f'INSERT INTO "{table}"' in commit, f"the statement writes {table} too: {commit}"
    before_commit = statements[:statements.index(commit)]
    assert len(before_commit) == 1 and "tasks_operation o" in before_commit[0], (
        f"the claim reads the last step's calls, for the wait check and the driver, and nothing reads the row "
        f"before the step's commit, a fenced UPDATE: {before_commit}")
    assert not [sql for sql in statements if "COUNT(" in sql], f"a new step's calls are numbered from 0: {statements}"
    assert len(statements) <= RESUMED_WITH_CALLS_STATEMENTS, statements
    assert list(Operation.objects.filter(task=task, step=asked_at).order_by("n").values_list("n", flat=True)) == (
        list(range(Operation.objects.filter(task=task, step=asked_at).count())))
    assert Checkpoint.objects.filter(task=task, step=task.current_step).exists()
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_the_claim_brings_the_last_steps_calls_as_the_runners_own_read_of_them_would(acme, alice, settings):
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_research(acme, alice)
    jobs.advance(task.pk)  # the plan: one model call
    operations.run_due(run_for=5)
    jobs.advance(task.pk)  # the searches
    task.refresh_from_db()
    step = task.current_step - 1
    searches = list(Operation.objects.filter(task=task, step=step).order_by("n"))
    assert len(searches) >= 2
    # Beside the searches: one finished, one failed; a call of the task's end and a local effect, which are no
    # step's outcomes; a watch, which the task does not wait for.
    Operation.objects.filter(pk=searches[0].pk).update(status="succeeded", result=sealed.Sealed(
        acme.pk, {"results": [{"url": "https://docs.python.org/3/", "title": "Python"}]}))
    Operation.objects.filter(pk=searches[1].pk).update(status="failed", error_class="transient",
                                                       error_message="the search API timed out")
    extra = {"a0": "gateway", "e0": "local", f"{operations.WATCH_PREFIX}0": "gateway"}
    for n, (suffix, mode) in enumerate(extra.items(), start=len(searches)):
        Operation.objects.create(task=task, key=f"{task.pk}:{step}:{suffix}", step=step, n=n, kind="tool",
                                 name="search", mode=mode, args_digest="-", fencing_token=task.fencing_token,
                                 args={"query": suffix}, status="pending")
    Operation.objects.filter(pk__in=[op.pk for op in searches[2:]]).update(status="succeeded")
    Task.objects.filter(pk=task.pk).update(status=TaskStatus.RUNNING, waiting_reason="", lease_owner="",
                                           next_run_at=clock.now())
    stored = Operation.objects.filter(pk=searches[0].pk).values_list("result", flat=True).query
    with connection.cursor() as cursor:
        cursor.execute(*stored.sql_with_params())
        assert cursor.fetchone()[0].startswith('{"lh_sealed"'), "the result is stored sealed"

    claimed = leases.claim_next(owner="worker-b", now=clock.now())

    assert claimed is not None and claimed.pk == task.pk and claimed.resume is not None
    brought = operations.read_outcomes(claimed.resume.calls)
    assert brought == operations.outcomes_and_wait(task.pk, step)
    outcomes, waits = brought
    assert [call.key.rpartition(":")[2] for call in claimed.resume.calls] == (
        [op.key.rpartition(":")[2] for op in searches] + [f"{operations.WATCH_PREFIX}0"])
    assert outcomes[0].ok and outcomes[0].result["results"][0]["title"] == "Python"  # opened
    assert outcomes[0].args == searches[0].args and outcomes[0].usage == {}
    assert (outcomes[1].ok, outcomes[1].finished, outcomes[1].error_message) == (
        False, True, "the search API timed out")
    assert not waits, "the watch still out is not waited for"


def research_after_its_plan(acme, alice) -> tuple[Task, Operation]:
    """A research task whose plan call has been recorded, due for the step that reads it."""
    task = submit_research(acme, alice)
    jobs.advance(task.pk)  # the plan: one model call
    operations.run_due(run_for=5)
    task.refresh_from_db()
    [plan] = Operation.objects.filter(task=task, step=task.current_step - 1)
    assert plan.status == "succeeded" and task.next_run_at is not None
    return task, plan


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_call_result_sealed_for_another_tenant_is_refused_by_the_claim_as_by_a_read(
        acme, alice, globex, charlie, settings):
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    settings.LONGHAUL_STEP_SLICE_MS = 0
    ours, plan = research_after_its_plan(acme, alice)
    theirs, their_plan = research_after_its_plan(globex, charlie)
    with connection.cursor() as cursor:  # their plan's sealed result, copied into ours in the database
        cursor.execute("UPDATE tasks_operation SET result = (SELECT result FROM tasks_operation WHERE id = %s) "
                       "WHERE id = %s", [their_plan.pk, plan.pk])

    with pytest.raises(TamperedContent, match="sealed for another tenant"):
        leases.claim(ours.pk, owner="worker-b", now=clock.now())
    with pytest.raises(TamperedContent, match="sealed for another tenant"):
        operations.outcomes_and_wait(ours.pk, plan.step)
    claimed = leases.claim(theirs.pk, owner="worker-b", now=clock.now())
    assert claimed.resume.calls[0].result == their_plan.result, "their own row reads as it is"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_claim_whose_reads_are_older_than_the_row_it_took_brings_nothing_for_the_step(acme, alice, settings):
    """A claim by kick that waited for another worker's commit returns the row as that commit left it, but reads
    the checkpoint and the calls as they were when the statement started: the step must read them itself."""
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task, plan = research_after_its_plan(acme, alice)
    # The row moved one step past what the claim's reads can see, as the commit it waited for would move it.
    Task.objects.filter(pk=task.pk).update(current_step=task.current_step + 1)

    claimed = leases.claim(task.pk, owner="worker-b", now=clock.now())

    assert claimed is not None and claimed.current_step == task.current_step + 1
    assert claimed.resume is None, "the checkpoint and the calls read are not this step's"
    Task.objects.filter(pk=task.pk).update(current_step=task.current_step, lease_owner="", next_run_at=clock.now())
    claimed = leases.claim(task.pk, owner="worker-b", now=clock.now())
    assert claimed.resume is not None and [op.pk for op in claimed.resume.calls] == [plan.pk], "in step, it does"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_a_prepared_statement_given_more_values_than_placeholders_is_refused_before_it_is_sent():
    # (Not under CaptureQueriesContext: the query log composes the statement first, and that refuses it too.)
    with pytest.raises(DatabaseError, match="the statement has 1 placeholders but 2 parameters"):
        prepared.fetchone("SELECT %s::int", [1, 2])

    assert connection.connection.prepare_threshold is None, "psycopg would count and keep Django's statements"
    assert prepared.fetchone("SELECT %s::int", [1]) == (1,)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="numbered placeholders are PostgreSQL's")
def test_a_batch_statement_sent_numbered_is_refused_for_a_wrong_count_of_values_and_answers_as_written():
    """A batch's statement (prepared.fetchall, prepared.rowcount): written with Django's placeholders, sent with
    PostgreSQL's own."""
    with pytest.raises(DatabaseError, match="the statement has 2 placeholders but 1 parameters"):
        prepared.fetchall("SELECT %s::int, %s::int", [1])

    rows = prepared.fetchall("SELECT n FROM unnest(%s::int[]) AS t(n) WHERE %s LIKE 'a%%'", [[1, 2], "ab"])
    assert rows == [(1,), (2,)]
    assert prepared.rowcount("SELECT n FROM unnest(%s::int[]) AS t(n)", [[1, 2, 3]]) == 3


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_a_statement_given_its_list_as_one_array_is_prepared_once_a_parameter_type_and_answers_every_row():
    """prepared.rows: a statement whose text a list of values does not change (`= ANY(%s)`), prepared. psycopg
    sends a list of small integers as smallint[] and one holding a larger as bigint[]: one statement each."""
    sql = "SELECT n FROM unnest(%s::bigint[]) AS t(n) WHERE n > %s ORDER BY n"
    assert prepared.rows(sql, [[3, 1, 2], 1]) == [(2,), (3,)]
    assert prepared.rows(sql, [[4, 1], 1]) == [(4,)], "another list of the same type: the same statement"
    assert prepared.rows(sql, [[5, 2**40], 1]) == [(5,), (2**40,)], "larger values: one more"
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", ["%unnest($1::bigint[])%"])
        assert cursor.fetchone()[0] == 2


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_the_claimed_task_is_its_row_as_a_read_of_it_would_be(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    task = submit_sleep(acme, alice, steps=3)
    jobs.advance(task.pk)  # its first step: the next claim is the one-statement claim
    Task.objects.filter(pk=task.pk).update(lease_owner="", next_run_at=clock.now())

    claimed = leases.claim_next(owner="worker-b", now=clock.now())

    assert claimed is not None and claimed.resume is not None
    read = Task.objects.get(pk=task.pk)
    fields = [field.attname for field in Task._meta.concrete_fields]
    assert [getattr(claimed, name) for name in fields] == [getattr(read, name) for name in fields]
    assert claimed.input["steps"] == 3  # opened, as a read opens it
    assert claimed.lease_owner == "worker-b" and claimed.status == TaskStatus.RUNNING
    latest = Checkpoint.objects.filter(task=task).latest("step")
    brought = claimed.resume.checkpoint
    assert [getattr(brought, f.attname) for f in Checkpoint._meta.concrete_fields] == [
        getattr(latest, f.attname) for f in Checkpoint._meta.concrete_fields]
    assert claimed.resume.calls == ()


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
@pytest.mark.parametrize("by", ["kick", "next"], ids=["claimed by its kick", "claimed as the task due longest"])
def test_a_tasks_first_claim_is_one_statement_that_records_when_it_started(acme, alice, by):
    task = submit_sleep(acme, alice, steps=2)
    events_before = list(task.events.values_list("seq", "kind"))
    now = clock.now()

    with CaptureQueriesContext(connection) as queries:
        claimed = (leases.claim(task.pk, owner="worker-a", now=now) if by == "kick"
                   else leases.claim_next(owner="worker-a", now=now))

    assert claimed is not None and claimed.pk == task.pk
    statements = [query["sql"] for query in queries.captured_queries]
    assert len(statements) == 1, f"a first claim is one statement: {statements}"
    assert (claimed.resume.checkpoint, claimed.resume.calls) == (None, ())
    assert claimed.resume.waiting == leases.Waiting(jobs=False, steps=False), "nothing else waits"
    read = Task.objects.get(pk=task.pk)
    assert (read.lease_owner, read.fencing_token, read.attempts) == ("worker-a", task.fencing_token + 1, 1)
    fields = [field.attname for field in Task._meta.concrete_fields]
    assert [getattr(claimed, name) for name in fields] == [getattr(read, name) for name in fields]
    assert AdmissionRecord.objects.get(task_id=task.pk).started_at == now
    assert list(task.events.values_list("seq", "kind")) == events_before, "a first claim is no event"

    # Released before its step ran, its attempts at 0 again (paused and resumed before its first step): the
    # next claim looks like a first one, and its start still stays the first claim's.
    Task.objects.filter(pk=task.pk).update(lease_owner="", lease_expires_at=None, attempts=0)
    later = now + timedelta(seconds=1)
    assert leases.claim(task.pk, owner="worker-b", now=later) is not None
    assert AdmissionRecord.objects.get(task_id=task.pk).started_at == now


def _is_probe(sql: str) -> bool:
    """kicks.waiting's statement, what else waits for a worker: two EXISTS in one SELECT. Told apart by its shape,
    not its spacing, from the one-EXISTS probes of a task's end (scheduling's anyone queued, the webhooks' anyone
    listening), which are not what these tests count."""
    return PROBE.match(sql) is not None


PROBE = re.compile(r"SELECT\s+EXISTS\s*\(.*\),\s*EXISTS\s*\(", re.DOTALL)


def _probes(statements: list[str]) -> list[str]:
    return [sql for sql in statements if _is_probe(sql)]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_worker_going_on_from_task_to_task_sends_two_statements_a_step(acme, alice, settings, monkeypatch):
    """The claim of the task due longest also says what else waits, so the step it claimed commits by that
    answer: the claim, and the fenced UPDATE committed alone."""
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    monkeypatch.setattr(runner, "CLAIM_ANSWER_STANDS", 60.0)  # however slow this machine runs a step
    tasks = [submit_sleep(acme, alice, steps=3) for _ in range(3)]
    OrmQ.objects.all().delete()  # no job waits: the worker goes on from task to task
    with CaptureQueriesContext(connection) as queries:
        jobs.advance(tasks[0].pk)

    assert set(Task.objects.filter(pk__in=[t.pk for t in tasks]).values_list("status", flat=True)) == {
        TaskStatus.SUCCEEDED}
    going_on = [statements for statements in steps_of(queries.captured_queries)
                if statements[-1].startswith("WITH moved AS (UPDATE")]
    # Each task's first two steps went on to the task due longest (the third ends its task, in a transaction).
    assert len(going_on) == 6, going_on
    for statements in going_on:
        assert len(statements) == 2 and "WITH picked AS" in statements[0], (
            f"a step going on sends its claim and its commit: {statements}")
    assert [c.state["done"] for c in Checkpoint.objects.filter(task=tasks[1]).order_by("step")] == [1, 2, 3]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_step_asks_again_what_waits_when_its_claim_is_no_longer_fresh(acme, alice, settings, monkeypatch):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    monkeypatch.setattr(runner, "CLAIM_ANSWER_STANDS", -1.0)  # every step outlasts it
    first, _ = submit_sleep(acme, alice, steps=2), submit_sleep(acme, alice, steps=2)
    OrmQ.objects.all().delete()
    with CaptureQueriesContext(connection) as queries:
        jobs.advance(first.pk)

    commits = steps_of(queries.captured_queries)
    going_on = [statements for statements in commits if statements[-1].startswith("WITH moved AS (UPDATE")]
    assert going_on and all(len(_probes(statements)) == 1 for statements in going_on), going_on


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_job_waiting_at_the_claim_hands_the_next_step_on_with_a_kick(acme, alice, settings, monkeypatch):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    monkeypatch.setattr(runner, "CLAIM_ANSWER_STANDS", 60.0)
    task = submit_sleep(acme, alice, steps=3)
    OrmQ.objects.all().delete()
    kicks.kick("deliver", 0)  # a job in the cluster's own queue: the worker makes way for it after one step
    with CaptureQueriesContext(connection) as queries:
        jobs.advance(task.pk)

    assert not _probes([query["sql"] for query in queries.captured_queries]), "the claim said a job waits"
    task.refresh_from_db()
    assert (task.current_step, task.lease_owner) == (1, "")
    assert OrmQ.objects.filter(key=kicks.queue_of("advance")).count() == 1, "its next step has a kick"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
@pytest.mark.parametrize("by", ["kick", "next"])
@pytest.mark.parametrize("setting", ["nothing", "another due", "another held", "a job", "a gateway kick",
                                     "a gateway kick, turn held", "a step kick only"])
def test_the_claims_look_at_what_waits_is_the_probes(acme, alice, setting, by):
    """The claim asks kicks.waiting's two questions in its own statement (the claimed task left out): for each
    kind of work that may wait, its answer is the probe's, asked right after it. Both forms of the claim: by
    a kick (this task) and the task due longest."""
    claimed_first = submit_sleep(acme, alice, steps=2)
    OrmQ.objects.all().delete()
    if setting in ("another due", "another held"):
        other = submit_sleep(acme, alice, steps=2)
        if setting == "another held":
            Task.objects.filter(pk=other.pk).update(lease_owner="w:9", lease_expires_at=clock.now() + timedelta(
                seconds=60))
    elif setting == "a job":
        kicks.kick("deliver", 0)
    elif setting.startswith("a gateway kick"):
        kicks.kick("operations", 0)
    elif setting == "a step kick only":
        kicks.kick("advance", claimed_first.pk)  # a hint for a task the worker takes from the table itself
    with contextlib.ExitStack() as held:
        if setting.endswith("turn held"):
            gateway_job = held.enter_context(psycopg.connect(requested.conninfo(), autocommit=True))
            gateway_job.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
        now = clock.now()
        claimed = (leases.claim(claimed_first.pk, owner="worker-a", now=now) if by == "kick"
                   else leases.claim_next(owner="worker-a", now=now))
        assert claimed is not None and claimed.pk == claimed_first.pk and claimed.resume is not None
        probed = kicks.waiting(now=now, besides=claimed.pk)

    expected = {"nothing": (False, False), "another due": (False, True), "another held": (False, False),
                "a job": (True, False), "a gateway kick": (True, False), "a gateway kick, turn held": (False, False),
                "a step kick only": (False, False)}[setting]
    assert claimed.resume.waiting == probed == leases.Waiting(*expected)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the one-statement claim is PostgreSQL's")
def test_a_claims_answer_is_as_old_as_the_moment_it_was_sent_not_as_it_came_back(acme, alice):
    """A claim by kick waits for its row's lock (a recorder holds it, say): what it says waits was read
    before that wait, and must count as that old, or a step would trust it however long ago it was read."""
    task = submit_sleep(acme, alice, steps=2)
    claiming_pid = connection.cursor().connection.info.backend_pid
    released: list[float] = []

    def let_go_once_the_claim_waits(holder) -> None:
        # No sleep: the holder lets go once the server shows the claim waiting for the row's lock.
        with _other_session() as watcher:
            watcher.autocommit = True
            for _ in range(2000):
                if watcher.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                   [claiming_pid]).fetchone()[0]:
                    break
                time.sleep(0.005)
        released.append(time.monotonic())
        holder.commit()

    with _other_session() as holder:
        holder.execute(f"SELECT 1 FROM {Task._meta.db_table} WHERE id = %s FOR UPDATE", [task.pk])
        letting_go = threading.Thread(target=let_go_once_the_claim_waits, args=(holder,))
        letting_go.start()
        claimed = leases.claim(task.pk, owner="worker-a", now=clock.now())
        letting_go.join()

    assert claimed is not None and claimed.resume is not None
    assert claimed.resume.read_at < released[0], "the answer's age leaves out the wait for the lock"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_the_claim_and_the_probe_are_planned_once_per_connection(acme, alice):
    for _ in range(3):
        submit_sleep(acme, alice, steps=2)
    connection.close()  # a session of its own: no statement an earlier test prepared
    for _ in range(8):  # PostgreSQL weighs a plan for every call against custom plans for the first five
        leases.claim_next(owner="worker-b", now=clock.now())
        kicks.waiting(now=clock.now(), besides=0)

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans FROM pg_prepared_statements")
        rows = cursor.fetchall()
    assert len(rows) == 2, rows  # the claim and the probe, nothing of Django's
    assert connection.connection.prepare_threshold is None, "psycopg would count and keep Django's statements"
    kept = {"claim" if "WITH picked" in statement else "probe": plans for statement, plans in rows}
    assert kept.keys() == {"claim", "probe"}, kept
    assert all(plans > 0 for plans in kept.values()), f"a statement is planned again at every call: {kept}"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_a_steps_commit_is_planned_once_per_connection(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    task = submit_sleep(acme, alice, steps=9)
    OrmQ.objects.all().delete()  # nothing waiting: the steps run in place, one commit each
    connection.close()  # a session of its own: no statement an earlier test prepared
    jobs.advance(task.pk)
    assert Task.objects.get(pk=task.pk).status == TaskStatus.SUCCEEDED

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements "
                       "WHERE statement LIKE 'WITH moved AS (UPDATE%%'")
        rows = cursor.fetchall()
    # The steps between the first and the last send the same statement (their values are its parameters).
    assert max((runs for _, runs in rows), default=0) >= 7, rows


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the written UPDATE is PostgreSQL's")
def test_the_fenced_updates_values_are_stored_as_update_stores_them(acme, alice, settings):
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    by_orm, by_hand = submit_sleep(acme, alice, steps=3), submit_sleep(acme, alice, steps=3)
    now = clock.now()
    values = {"result": {"answer": "forty-two", "n": [1, 2]}, "result_version": 3, "lease_owner": "",
              "lease_expires_at": None, "next_run_at": now, "waiting_reason": "model", "tracking_degraded": True,
              "attempts": 0, "stalled_at": None, "remote_poll_error": "a note", "status": TaskStatus.RUNNING}
    sealed_values = sealed.wrap(Task, acme.pk, values)
    Task.objects.filter(pk=by_orm.pk).update(**sealed_values)
    sql, params = transitions._fenced_update({"id": by_hand.pk, "version": by_hand.version}, transitions.NOT_HELD,
                                             sealed_values, reserved=0)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        assert cursor.rowcount == 1

    columns = [Task._meta.get_field(name).column for name in values]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, {', '.join(columns)} FROM {Task._meta.db_table} WHERE id IN (%s, %s)",
                       [by_orm.pk, by_hand.pk])
        stored = {row[0]: row[1:] for row in cursor.fetchall()}
    result_at = list(values).index("result")
    assert stored[by_hand.pk][:result_at] + stored[by_hand.pk][result_at + 1:] == (
        stored[by_orm.pk][:result_at] + stored[by_orm.pk][result_at + 1:])
    assert "forty-two" not in str(stored[by_hand.pk][result_at]), "the result was written in the clear"
    assert Task.objects.get(pk=by_hand.pk).result == Task.objects.get(pk=by_orm.pk).result == values["result"]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_a_prepared_statement_past_psycopgs_cache_limits_binds_every_value(acme):
    """Longer than 4,096 bytes, with more than 50 parameters and a literal %, as a step's commit can be."""
    values = [f"v{n}%" for n in range(60)]
    sql = f"SELECT {', '.join('%s::text' for _ in values)}, 'a%%b' /* {'x' * 5000} */"

    with CaptureQueriesContext(connection) as queries:
        row = prepared.fetchone(sql, values)
        again = prepared.fetchone(sql, list(reversed(values)))

    assert row == (*values, "a%b") and again == (*reversed(values), "a%b")
    assert "'v0%'" in queries.captured_queries[0]["sql"], "the query log shows the statement with its values"


def _other_session():
    """A connection of its own to the test database (what another process would be)."""
    return connection.get_new_connection(connection.get_connection_params())


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_the_claim_after_the_database_dropped_the_connection_opens_another(acme, alice):
    """A job's start asks for a health check (CONN_HEALTH_CHECKS); the prepared claim, a job's first
    statement, must run it as Django's own cursors do, or the job fails after every database restart."""
    task = submit_sleep(acme, alice, steps=2)
    leases.claim_next(owner="worker-a", now=clock.now())  # prepared on this connection
    Task.objects.filter(pk=task.pk).update(lease_owner="", next_run_at=clock.now())
    with _other_session() as other:
        other.execute("SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid])
    close_old_connections()  # what django-q2 does before every job

    assert leases.claim_next(owner="worker-b", now=clock.now()) is not None


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="prepared statements are PostgreSQL's")
def test_the_claim_goes_on_after_a_migration_changes_a_column_it_returns(acme, alice):
    """PostgreSQL refuses a kept plan whose result's types changed; a worker started before the migration
    must not fail every claim until its connection grows old."""
    task = submit_sleep(acme, alice, steps=2)
    leases.claim_next(owner="worker-a", now=clock.now())
    Task.objects.filter(pk=task.pk).update(lease_owner="", next_run_at=clock.now())
    table = Task._meta.db_table
    try:
        with _other_session() as other:
            other.execute(f"ALTER TABLE {table} ALTER COLUMN name TYPE varchar(250)")
            other.commit()

        assert leases.claim_next(owner="worker-b", now=clock.now()) is not None
        assert kicks.waiting(now=clock.now(), besides=0) is not None
    finally:
        with _other_session() as other:
            other.execute(f"ALTER TABLE {table} ALTER COLUMN name TYPE varchar(200)")
            other.commit()
        connection.close()  # its statements were planned for varchar(250)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="DUE_WHERE is sent on PostgreSQL only (SQLite "
                    "compares the raw times as text)")
def test_the_prepared_statements_due_condition_finds_the_rows_the_orms_does(acme, alice):
    """leases.DUE_WHERE (the claim's and the probe's SQL) is leases.due() written out a second time; every
    status, due time and lease a row can have, the two agree row for row (on SQLite, the ORM's form is the one)."""
    now = clock.now()
    times = {"past": now - timedelta(seconds=5), "now": now, "future": now + timedelta(seconds=5), "none": None}
    grid = list(itertools.product(TaskStatus.values, ("past", "now", "future", "none"), ("", "w:1"),
                                  ("past", "now", "future", "none")))
    Task.objects.bulk_create(
        Task(tenant=acme, owner=alice, kind="sleep", name=f"{status} due {due} held by {owner!r} until {until}",
             status=status, next_run_at=times[due], lease_owner=owner, lease_expires_at=times[until],
             created_at=now, updated_at=now)
        for status, due, owner, until in grid)

    by_the_orm = set(leases.due(now).values_list("name", flat=True))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT name FROM {Task._meta.db_table} WHERE {leases.DUE_WHERE}", [now, now])
        by_the_sql = {name for (name,) in cursor.fetchall()}

    assert by_the_sql == by_the_orm
    # The grid holds every case of the condition: due and free, due and held, held by a lapsed lease, not due.
    assert "running due past held by '' until none" in by_the_sql
    assert "retry_wait due now held by 'w:1' until past" in by_the_sql
    assert "running due past held by 'w:1' until future" not in by_the_sql
    assert "running due future held by '' until none" not in by_the_sql
    assert "queued due past held by '' until none" not in by_the_sql


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the statement that commits alone is PostgreSQL's")
def test_the_calls_the_fenced_statement_stores_are_the_rows_the_locked_commit_stores(acme, alice, settings):
    """The same step, asking for a search and a model call, committed alone and by the locked commit (a task
    of its own each): the same calls, the same task row, and the kick for a gateway job after either."""
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    asks = Continue({"done": 1, "of": 3}, requests=[
        OpRequest(kind="tool", name="search", args={"query": "asyncio cancellation"}),
        OpRequest(kind="model", name="extract", args={"messages": [{"role": "user", "content": "é ✓"}]}, once=True)])
    stored = {}
    for way in ("alone", "locked"):
        task = submit_sleep(acme, alice, steps=3)
        held = leases.claim(task.pk, owner="worker:1", now=clock.now())
        assert held is not None
        OrmQ.objects.all().delete()
        ctx = StepContext(held, token=held.fencing_token)
        if way == "locked":  # as after a lost fenced statement: the commit under the row lock
            with transaction.atomic():
                fresh = leases.lock_fenced(held.pk, held.fencing_token)
                assert runner._wait_for_requests(fresh, held.fencing_token, asks, [], now=clock.now())
        else:
            with CaptureQueriesContext(connection) as queries:
                assert runner._commit(held, held.fencing_token, get_driver("sleep"), asks, ctx, keep_lease=True,
                                      state_before={}) is None
            assert "BEGIN" not in [q["sql"] for q in queries.captured_queries]
        task.refresh_from_db()
        calls = list(Operation.objects.filter(task=task).order_by("n").values(
            "step", "n", "kind", "name", "pool", "mode", "args", "args_digest", "status", "fencing_token", "attempts",
            "has_side_effects", "not_before", "usage", "version", "lease_owner", "result", "error_class"))
        assert all(call["key"] == f"{task.pk}:{call['step']}:r{call['n']}"
                   for call in Operation.objects.filter(task=task).values("key", "step", "n"))
        stored[way] = (calls, task.status, task.waiting_reason, task.current_step, task.lease_owner,
                       task.next_run_at, list(task.events.values_list("kind", flat=True))[-1])
        assert OrmQ.objects.filter(key=kicks.queue_of("operations")).count() == 1, "a gateway job is kicked"
        sealed_args = Operation.objects.filter(task=task).values_list("args", flat=True)
        with connection.cursor() as cursor:
            cursor.execute("SELECT args::text FROM tasks_operation WHERE task_id = %s", [task.pk])
            assert all("asyncio" not in raw and "messages" not in raw for (raw,) in cursor.fetchall()), "sealed"
        assert {a.get("query") for a in sealed_args} == {"asyncio cancellation", None}
    assert stored["alone"] == stored["locked"]
    assert stored["alone"][1] == TaskStatus.WAITING_TOOL and stored["alone"][-1] == "waiting_tool"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the statement that commits alone is PostgreSQL's")
def test_a_step_whose_calls_pool_is_paused_commits_under_the_lock_and_says_so(acme, alice):
    from tasks import pools

    task = submit_sleep(acme, alice, steps=3)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    key = pools.key_of("tool", "search", {"query": "asyncio cancellation"})
    until, _ = pools.pause(key, seconds=30, reason="429", now=clock.now())

    ctx = StepContext(held, token=held.fencing_token)
    with CaptureQueriesContext(connection) as queries:
        assert runner._commit(held, held.fencing_token, get_driver("sleep"), ASKS_FOR_CALLS, ctx, keep_lease=True,
                              state_before={}) is None

    statements = [q["sql"] for q in queries.captured_queries]
    assert "BEGIN" in statements, f"the statement alone lost to the pause; the locked commit wrote: {statements}"
    tried = [sql for sql in statements[:statements.index("BEGIN")] if sql.startswith("WITH moved AS (UPDATE")]
    assert len(tried) == 1 and 'INSERT INTO "tasks_operation"' in tried[0], f"tried alone first: {statements}"
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_TOOL
    assert Operation.objects.filter(task=task, status="pending").count() == 1, "its call was stored once"
    paused = task.events.filter(kind=pools.PAUSED).values_list("data", flat=True)
    assert [event["until"] for event in paused] == [until.isoformat()], "the task says its pool is paused"
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))
    assert OrmQ.objects.filter(key=kicks.queue_of("operations"), lock__gte=until).exists(), (
        "the gateway job is kicked for when the pause ends")


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="counts PostgreSQL's statements (one-statement UPDATE)")
def test_a_step_that_ends_its_task_writes_its_checkpoint_and_its_end_in_one_fenced_update(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 60_000
    task = submit_sleep(acme, alice, steps=2)
    OrmQ.objects.all().delete()  # nothing waiting: the worker keeps the lease to the end
    with CaptureQueriesContext(connection) as queries:
        jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED

    last = steps_of(queries.captured_queries)[-1]
    assert not [sql for sql in last if 'FROM "tasks_task"' in sql and "FOR UPDATE" in sql], (
        f"the end is a fenced UPDATE, with no read of the row first: {last}")
    [moved] = [sql for sql in last if sql.startswith("WITH moved AS (UPDATE")]
    assert "'succeeded'" in moved and 'INSERT INTO "tasks_checkpoint"' in moved, (
        f"the UPDATE ends the task and writes the last checkpoint: {moved}")
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == [1, 2]
    assert task.result is not None and task.current_step == 2
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))
    assert task.events.order_by("-seq").values_list("kind", flat=True)[0] == "succeeded"


def test_a_cancel_asked_for_during_a_tasks_last_step_loses_to_its_finished_result(acme, alice):
    task = submit_sleep(acme, alice, steps=1)
    held = leases.claim(task.pk, owner="worker:1", now=clock.now())
    assert held is not None
    actions.request_cancel(task=Task.objects.get(pk=task.pk), user=alice, reason="too late")

    ctx = StepContext(held, token=held.fencing_token)
    with CaptureQueriesContext(connection) as queries:
        runner._commit(held, held.fencing_token, get_driver("sleep"), runner.Finish({"done": 1, "of": 1}, {"slept": 1}),
                       ctx, keep_lease=True, state_before={})

    task.refresh_from_db()
    assert task.status == TaskStatus.SUCCEEDED, "the work is done and recorded: a late cancel loses to it"
    if connection.vendor == "postgresql":  # SQLite has no row locks: its IMMEDIATE transaction holds every row
        assert [q["sql"] for q in queries.captured_queries if "FOR UPDATE" in q["sql"]], "decided under the row lock"
    assert list(Checkpoint.objects.filter(task=task).values_list("step", flat=True)) == [1]
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))
