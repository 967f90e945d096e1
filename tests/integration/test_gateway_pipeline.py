"""The path of a call through the gateway: a gateway job records the outcomes that arrive together in one
transaction, and kicks the steps they make due together (a kick a worker, at most); it hears the calls
steps request while it runs instead of waiting for its next look; and while it holds the turn, a worker
running steps does not make way for the gateway kicks those steps wrote, which only a job without the
turn would need."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.db.models import F, Q
from django.test.utils import CaptureQueriesContext
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from chat.models import Thread
from tasks import clock, kicks, leases, operations, pools, requested, transitions
from tasks.drivers import OpRequest
from tasks.errors import InternalError
from tasks.models import Operation, Pool, Task, TaskEvent
from tasks.statuses import OperationStatus, TaskStatus
from tests.factories import make_task
from tests.fakes.openai_server import FakeOpenAI, Reply
from tests.integration.lock_waits import waiting_reach
from tests.integration.test_pools import PLAN_REPLY, call

Op = OperationStatus
OWNER = "gw:1"


def waiting(tenant, owner, calls: int = 1) -> tuple[Task, list[Operation]]:
    """A task waiting for `calls` tool calls of its step 0, claimed by OWNER."""
    task = make_task(tenant, owner, status=TaskStatus.WAITING_TOOL, next_run_at=None, current_step=1)
    ops = [call(task, n) for n in range(calls)]
    claimed = {op.pk for op in operations.claim_batch(owner=OWNER, limit=100, now=clock.now())}
    assert {op.pk for op in ops} <= claimed
    return task, ops


def outcome(op: Operation, result: Any = None, **fields: Any) -> operations.Outcome:
    return operations.Outcome(op.pk, {"results": []} if result is None else result, **fields)


def hold_row(session: psycopg.Connection, task: Task) -> None:
    """Lock the task's row in an open transaction of `session` (its ROLLBACK lets go), as a step committing would."""
    session.execute("BEGIN")
    session.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [task.pk])


def lock_waiters_reach(count: int) -> bool:
    """Whether `count` backends of this database come to wait for a lock. Asked from a session outside any
    transaction: one inside sees pg_stat_activity as of its first look."""
    with psycopg.connect(requested.conninfo(), autocommit=True) as watching:
        return waiting_reach(lambda sql, params: watching.execute(sql, params).fetchone(), count)


def advance_kicks() -> list[int]:
    return sorted(SignedPackage.loads(p)["args"][0] for p in OrmQ.objects.values_list("payload", flat=True)
                  if SignedPackage.loads(p)["func"] == "tasks.jobs.advance")


def made_due() -> list[int]:
    """The tasks whose next step is due, held by nobody."""
    return sorted(leases.due(clock.now()).values_list("pk", flat=True))


def kicks_for(steps_made_due: int) -> list[int]:
    """The kicks of a batch that made that many steps due: one for the task due longest per worker, at most."""
    return [kicks.DUE_LONGEST] * min(steps_made_due, kicks.step_workers())


@pytest.mark.smoke
@pytest.mark.django_db(transaction=True)
def test_outcomes_that_arrive_together_are_recorded_at_once_and_their_steps_kicked_together(acme, alice):
    (one, [a]), (two, [b, c]), (three, [d, e]) = waiting(acme, alice), waiting(acme, alice, 2), waiting(acme, alice, 2)
    OrmQ.objects.all().delete()

    # Both calls of `two` and one of `three`, in no particular order.
    assert operations.record_many([outcome(c), outcome(d), outcome(a), outcome(b)], owner=OWNER) == [True] * 4

    assert {op.pk: op.status for op in Operation.objects.filter(task__in=[one, two, three])} == {
        a.pk: Op.SUCCEEDED, b.pk: Op.SUCCEEDED, c.pk: Op.SUCCEEDED, d.pk: Op.SUCCEEDED, e.pk: Op.STARTED}
    assert made_due() == sorted([one.pk, two.pk]), "each task whose step is done, not three"
    assert advance_kicks() == kicks_for(2)
    due = {t.pk: (t.status, t.next_run_at is not None) for t in Task.objects.filter(pk__in=[one.pk, two.pk, three.pk])}
    assert due == {one.pk: (TaskStatus.RUNNING, True), two.pk: (TaskStatus.RUNNING, True),
                   three.pk: (TaskStatus.WAITING_TOOL, False)}


@pytest.mark.django_db(transaction=True)
def test_an_outcome_that_cannot_be_stored_leaves_the_others_recorded(acme, alice):
    (_, [a]), (two, [b]) = waiting(acme, alice), waiting(acme, alice)

    recorded = operations.record_many([outcome(a, result={"not json": object()}), outcome(b)], owner=OWNER)

    assert isinstance(recorded[0], Exception) and recorded[1] is True
    assert Operation.objects.get(pk=a.pk).status == Op.STARTED, "left to its lease, as a call whose job died"
    assert Operation.objects.get(pk=b.pk).status == Op.SUCCEEDED
    assert (made_due(), advance_kicks()) == ([two.pk], kicks_for(1))


@pytest.mark.django_db(transaction=True)
def test_an_outcome_whose_call_another_job_took_over_is_not_recorded(acme, alice):
    (_, [a]), (two, [b]) = waiting(acme, alice), waiting(acme, alice)
    Operation.objects.filter(pk=a.pk).update(lease_owner="gw:2")  # its lease ran out and gw:2 claimed it

    assert operations.record_many([outcome(a), outcome(b)], owner=OWNER) == [False, True]
    assert Operation.objects.get(pk=a.pk).status == Op.STARTED
    assert (made_due(), advance_kicks()) == ([two.pk], kicks_for(1))


@pytest.mark.django_db(transaction=True)
def test_a_batch_costs_fewer_statements_than_its_outcomes_recorded_one_by_one(acme, alice):
    batch = [waiting(acme, alice)[1][0] for _ in range(10)]
    alone = [waiting(acme, alice)[1][0] for _ in range(10)]

    with CaptureQueriesContext(connection) as together:
        assert operations.record_many([outcome(op) for op in batch], owner=OWNER) == [True] * 10
    with CaptureQueriesContext(connection) as one_by_one:
        for op in alone:
            assert operations.record(op.pk, owner=OWNER, result={"results": []})
    assert len(together) < len(one_by_one), (len(together), len(one_by_one))
    assert made_due() == sorted(op.task_id for op in batch + alone)
    assert advance_kicks() == kicks_for(10) + kicks_for(1) * 10, "the batch's together, each alone's its own"


# SQLite (the embedded mode) writes a batch's calls one statement each.
one_update_a_batch = pytest.mark.skipif("connection.vendor != 'postgresql'", reason="UPDATE ... FROM VALUES")


@one_update_a_batch
@pytest.mark.django_db(transaction=True)
def test_a_batch_sends_as_many_statements_for_twenty_outcomes_as_for_one(acme, alice, settings):
    settings.LONGHAUL_TASK_CALLS_IN_FLIGHT = 50
    _, ops = waiting(acme, alice, calls=22)  # one call stays out: no step is done, no task moves
    one, twenty = ops[:1], ops[1:21]

    with CaptureQueriesContext(connection) as for_one:
        assert operations.record_many([outcome(op) for op in one], owner=OWNER) == [True]
    with CaptureQueriesContext(connection) as for_twenty:
        assert operations.record_many([outcome(op, {"results": [n]}) for n, op in enumerate(twenty)],
                                      owner=OWNER) == [True] * 20

    assert len(for_twenty) == len(for_one), [q["sql"][:80] for q in for_twenty]
    stored = dict(Operation.objects.filter(pk__in=[op.pk for op in twenty]).values_list("pk", "result"))
    assert stored == {op.pk: {"results": [n]} for n, op in enumerate(twenty)}, "each its own outcome"
    assert Operation.objects.get(pk=ops[21].pk).status == Op.STARTED


@pytest.mark.django_db(transaction=True)
def test_a_batch_reads_none_of_the_threads_of_the_tasks_it_moves(acme, alice):
    """The events of a task started in a chat thread wake that thread's stream too (chat.streams.thread_group_of):
    the group is named after the thread's row, which the task holds, not after anything read from the thread."""
    tasks = [make_task(acme, alice, status=TaskStatus.WAITING_TOOL, next_run_at=None, current_step=1,
                       thread=Thread.objects.create(tenant=acme, owner=alice, title=f"thread {n}")) for n in range(3)]
    ops = [call(task, 0) for task in tasks]
    assert len(operations.claim_batch(owner=OWNER, limit=100, now=clock.now())) == 3
    tasks = list(Task.objects.filter(pk__in=[task.pk for task in tasks]))  # as a recorder finds them: fresh rows

    with CaptureQueriesContext(connection) as sent:
        assert operations.record_many([outcome(op) for op in ops], owner=OWNER) == [True] * 3
    threads = Thread._meta.db_table
    assert not [q["sql"] for q in sent.captured_queries if f'FROM "{threads}"' in q["sql"]]
    assert made_due() == sorted(task.pk for task in tasks), "each moved on, its event written"


@pytest.mark.django_db(transaction=True)
def test_a_batch_reads_its_calls_once_as_it_locks_them(acme, alice):
    ops = [waiting(acme, alice)[1][0] for _ in range(3)]
    Operation.objects.filter(pk=ops[0].pk).update(lease_owner="gw:2")  # taken over: not this job's to close

    with CaptureQueriesContext(connection) as sent:
        assert operations.record_many([outcome(op) for op in ops], owner=OWNER) == [False, True, True]
    table = Operation._meta.db_table
    by_id = ('"id" = ANY(', f'"{table}"."id" IN (')  # as written out (PostgreSQL), as the ORM writes it (SQLite)
    reads = [q["sql"] for q in sent.captured_queries if q["sql"].startswith("SELECT")
             and q["sql"].split(" FROM ", 1)[1].startswith(f'"{table}"') and any(s in q["sql"] for s in by_id)]
    locked = " FOR UPDATE" if connection.vendor == "postgresql" else ""  # SQLite locks no rows
    assert len(reads) == 1 and reads[0].endswith(locked), reads
    assert made_due() == sorted(op.task_id for op in ops[1:])


@pytest.mark.django_db(transaction=True)
def test_the_tasks_a_batch_locks_read_as_the_orm_reads_them(acme, alice, globex, charlie):
    (mine, [a]), (theirs, [b]) = waiting(acme, alice), waiting(globex, charlie)
    Task.objects.filter(pk=mine.pk).update(question="Which sources?")  # sealed, with acme's key

    with transaction.atomic():
        locked = list(operations._lock_tasks_of([b.pk, a.pk]))

    assert [task.pk for task in locked] == sorted([mine.pk, theirs.pk]), "in id order"
    for task in locked:
        as_read = Task.objects.get(pk=task.pk)
        assert not task.get_deferred_fields()
        assert {f.attname: getattr(task, f.attname) for f in Task._meta.concrete_fields} == {
            f.attname: getattr(as_read, f.attname) for f in Task._meta.concrete_fields}
    assert locked[[t.pk for t in locked].index(mine.pk)].question == "Which sources?"


def record_one_then_ten(one: Operation, ten: list[Operation]) -> tuple[list[str], list[str]]:
    """The statements (their start) sent to record the outcome of `one` alone, then those of `ten` together,
    each the last call of its task's step: every task is made due, and kicked together."""
    OrmQ.objects.all().delete()
    with CaptureQueriesContext(connection) as for_one:
        assert operations.record_many([outcome(one)], owner=OWNER) == [True]
    with CaptureQueriesContext(connection) as for_ten:
        assert operations.record_many([outcome(op) for op in ten], owner=OWNER) == [True] * 10
    assert made_due() == sorted(op.task_id for op in [one, *ten])
    assert advance_kicks() == kicks_for(1) + kicks_for(10)
    return [q["sql"][:80] for q in for_one], [q["sql"][:80] for q in for_ten]


@one_update_a_batch
@pytest.mark.django_db(transaction=True)
def test_a_batch_that_ends_ten_steps_sends_as_many_statements_as_one_that_ends_one(acme, alice):
    def research_waiting_for_the_model() -> Operation:
        task, [op] = waiting(acme, alice)
        Task.objects.filter(pk=task.pk).update(status=TaskStatus.RUNNING, waiting_reason="model")
        return op

    one = research_waiting_for_the_model()
    ten = [research_waiting_for_the_model() for _ in range(10)]
    before = dict(Task.objects.values_list("pk", "version"))

    for_one, for_ten = record_one_then_ten(one, ten)

    assert len(for_ten) == len(for_one), for_ten
    moved = Task.objects.filter(pk__in=[op.task_id for op in [one, *ten]])
    assert {(t.status, t.waiting_reason, t.next_run_at is not None, t.version - before[t.pk]) for t in moved} == {
        (TaskStatus.RUNNING, "", True, 1)}, "each made due as operations_done makes it, its version bumped once"


@one_update_a_batch
@pytest.mark.django_db(transaction=True)
def test_a_batch_that_ends_ten_steps_waiting_for_tools_sends_as_many_statements_as_one_and_tells_each(
        acme, alice, globex, charlie):
    one = waiting(acme, alice)[1][0]
    ten = [waiting(*((acme, alice) if n % 2 else (globex, charlie)))[1][0] for n in range(10)]
    seqs = dict(Task.objects.values_list("pk", "last_event_seq"))

    for_one, for_ten = record_one_then_ten(one, ten)

    assert len(for_ten) == len(for_one), for_ten
    for task in Task.objects.filter(pk__in=[op.task_id for op in [one, *ten]]):
        assert (task.status, task.waiting_reason, task.next_run_at is not None, task.last_event_seq) == (
            TaskStatus.RUNNING, "", True, seqs[task.pk] + 1), "made due, its seq reserved"
        told = [(e.seq, e.kind, e.status, e.tenant_id, e.data) for e in TaskEvent.objects.filter(
            task_id=task.pk, seq__gt=seqs[task.pk])]
        assert told == [(seqs[task.pk] + 1, "tool_results_ready", TaskStatus.RUNNING, task.tenant_id, {})], (
            "its event, of its own tenant, on the seq its row reserved")


@pytest.mark.django_db(transaction=True)
def test_the_steps_a_batch_makes_due_move_as_operations_done_moves_each(acme, alice):
    def running(reason: str = "model", **fields: Any) -> Task:
        task = make_task(acme, alice, status=TaskStatus.RUNNING, next_run_at=None, current_step=1)
        Task.objects.filter(pk=task.pk).update(waiting_reason=reason, **fields)
        return Task.objects.get(pk=task.pk)

    quiet, other_quiet, tools = running(), running("tool"), waiting(acme, alice)[0]
    moved_meanwhile, held, tools_meanwhile = running(), running(lease_owner="worker:9"), waiting(acme, alice)[0]
    for task in (moved_meanwhile, tools_meanwhile):
        Task.objects.filter(pk=task.pk).update(version=F("version") + 1)  # read before another change
    seq_before = tools_meanwhile.last_event_seq
    alone = running()
    running_version = alone.version
    assert {quiet.version, other_quiet.version} == {running_version}
    now = clock.now()

    with transaction.atomic():
        moved = transitions.operations_done_many([quiet, other_quiet, tools, moved_meanwhile, held, tools_meanwhile],
                                                 now=now)
        assert transitions.operations_done(alone, now=now)

    assert sorted(t.pk for t in moved) == sorted([quiet.pk, other_quiet.pk, tools.pk])
    columns = ("status", "waiting_reason", "next_run_at", "last_progress_at", "updated_at", "version", "last_event_seq")
    rows = {row[0]: row[1:] for row in Task.objects.values_list("pk", *columns)}
    for task in moved:
        assert rows[task.pk] == tuple(getattr(task, name) for name in columns), "the task as its row"
    assert rows[alone.pk][:5] == (TaskStatus.RUNNING, "", now, now, now), "the one-task transition"
    for task, read in ((quiet, running_version), (other_quiet, running_version), (alone, running_version)):
        assert rows[task.pk][:6] == (*rows[alone.pk][:5], read + 1), "moved alike, its version bumped once"
    assert list(TaskEvent.objects.filter(task_id=tools.pk).values_list("kind", flat=True)) == ["tool_results_ready"]
    assert not TaskEvent.objects.filter(task_id__in=[quiet.pk, other_quiet.pk]).exists()
    assert rows[moved_meanwhile.pk][0:3] == (TaskStatus.RUNNING, "model", None), "changed since read: not moved"
    assert rows[held.pk][0:3] == (TaskStatus.RUNNING, "model", None), "held by a worker: not moved"
    assert (rows[tools_meanwhile.pk][0], rows[tools_meanwhile.pk][6]) == (TaskStatus.WAITING_TOOL, seq_before), (
        "changed since read: not moved, no seq taken")
    assert not TaskEvent.objects.filter(task_id=tools_meanwhile.pk, seq__gt=seq_before).exists()


@pytest.mark.django_db(transaction=True)
def test_a_batch_whose_outcomes_carry_different_fields_records_each_as_given(acme, alice):
    (_, [a]), (_, [b]) = waiting(acme, alice), waiting(acme, alice)
    now = clock.now()
    guard = Q(status=Op.STARTED, lease_owner=OWNER)
    lost = {"status": Op.FAILED, "result": None, "error_class": "timeout", "error_message": "lost",
            "finished_at": now, "lease_owner": "", "lease_expires_at": None}

    assert operations._finish_many([
        operations._Closing(a.pk, guard, lost),
        operations._Closing(b.pk, guard, outcome(b, usage={"tokens": 3}, version="v9").fields(now)),
    ]) == [True, True]

    rows = {op.pk: op for op in Operation.objects.filter(pk__in=[a.pk, b.pk])}
    assert (rows[a.pk].status, rows[a.pk].error_message, rows[a.pk].usage, rows[a.pk].version) == (
        Op.FAILED, "lost", {}, "")
    assert (rows[b.pk].status, rows[b.pk].result, rows[b.pk].usage, rows[b.pk].version) == (
        Op.SUCCEEDED, {"results": []}, {"tokens": 3}, "v9")


@pytest.mark.django_db(transaction=True)
def test_the_recorder_writes_outcomes_handed_in_together_as_one_batch_and_spends_their_tokens_once(
        acme, alice, settings):
    key = pools.key_of("model", "plan", None)
    settings.LONGHAUL_POOLS = {key: {"tokens_per_minute": 100_000}}
    tasks = [make_task(acme, alice, status=TaskStatus.WAITING_TOOL, next_run_at=None, current_step=1)
             for _ in range(20)]
    ops = [call(task, 0, kind="model", name="plan") for task in tasks]
    assert len(operations.claim_batch(owner=OWNER, limit=100, now=clock.now())) == 20
    allowance = Pool.objects.get(key=key).tokens_allowance

    async def hand_in() -> tuple[list[bool], int]:
        recorder = operations.Recorder(OWNER)
        done = await asyncio.gather(*(recorder.record(outcome(op, {"subquestions": []}), pool=key, tokens=7)
                                      for op in ops))
        await recorder.closed()
        return list(done), recorder.batches

    done, batches = asyncio.run(hand_in())

    assert done == [True] * 20
    assert batches == 1, "all twenty were handed in before the first batch was written"
    assert not Operation.objects.filter(pk__in=[op.pk for op in ops]).exclude(status=Op.SUCCEEDED).exists()
    assert Pool.objects.get(key=key).tokens_allowance <= allowance - 20 * 7


def test_an_outcome_says_how_long_it_waited_for_the_recorder():
    now = clock.now()
    answered = operations.Outcome(1, usage={"duration_ms": 40}, answered_at=now - timedelta(milliseconds=1500))
    assert answered.fields(now)["usage"] == {"duration_ms": 40, "recorded_after_ms": 1500}
    assert operations.Outcome(1, usage={"duration_ms": 40}).fields(now)["usage"] == {"duration_ms": 40}, \
        "not a gateway job's answer: nothing to say"
    early = operations.Outcome(1, answered_at=now + timedelta(milliseconds=5))  # a clock read a hair later
    assert early.fields(now)["usage"] == {"recorded_after_ms": 0}


@pytest.mark.django_db(transaction=True)
def test_a_calls_usage_says_how_long_it_waited_in_its_gateway_job_beside_its_remote_answer(
        acme, alice, settings, monkeypatch):
    """Beside the remote answer (duration_ms), the two waits a busy gateway job adds to a call: from its claim
    to its start (the job's event loop) and from its answer to its record (the job's recorder). With the remote
    answer they fit in the call's time in the job, claimed -> recorded."""
    with heard_or_not_at_all(settings, monkeypatch, Reply(content=PLAN_REPLY)):
        op = plan_call(acme, alice, "How does asyncio task cancellation work?")
        assert operations.run_due(run_for=0.5) == 1
    done = Operation.objects.get(pk=op.pk)
    parts = [done.usage.get(key) for key in ("started_after_ms", "duration_ms", "recorded_after_ms")]
    assert done.status == Op.SUCCEEDED and all(isinstance(ms, int) and ms >= 0 for ms in parts), done.usage
    in_the_job_ms = (done.finished_at - done.started_at).total_seconds() * 1000
    assert sum(parts) <= in_the_job_ms + 2, "each rounded down; the remote answer on the monotonic clock"


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite runs one writer at a time")
@pytest.mark.django_db(transaction=True)
def test_a_batch_held_up_by_a_locked_task_holds_up_no_other_batch_of_the_job(acme, alice, other_session):
    """While one batch of outcomes waits for its task's row, which another session holds (a step committing, an
    admin's change), the outcomes that arrive next are written beside it, not behind it."""
    (held_task, [held]), (_, [free]) = waiting(acme, alice), waiting(acme, alice)
    hold_row(other_session, held_task)

    async def hand_in() -> tuple[bool, bool, bool]:
        recorder = operations.Recorder(OWNER)
        first = asyncio.create_task(recorder.record(outcome(held), pool="tool:search"))
        try:
            blocked = await asyncio.to_thread(lock_waiters_reach, 1)
            try:
                second = await asyncio.wait_for(recorder.record(outcome(free), pool="tool:search"), timeout=20)
            except TimeoutError:
                pytest.fail("the next outcome waited for the batch held up by the locked row")
            return blocked, second, first.done()
        finally:
            other_session.execute("ROLLBACK")
            await asyncio.gather(first, return_exceptions=True)
            await recorder.closed()

    blocked, second, first_done = asyncio.run(hand_in())
    assert blocked, "the first batch waited for the row"
    assert second is True and not first_done, "the next outcome was recorded while the first batch still waited"
    assert set(Operation.objects.filter(pk__in=[held.pk, free.pk]).values_list("status", flat=True)) == {Op.SUCCEEDED}


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite runs one writer at a time")
@pytest.mark.django_db(transaction=True)
def test_two_batches_that_close_a_steps_last_two_calls_at_once_make_it_due_once(acme, alice, other_session):
    """The recorder's two writers each take one of a step's last two outcomes and meet at the task's row:
    the second to lock it sees the first's call closed, so the step is made due, and told, exactly once."""
    task, [a, b] = waiting(acme, alice, calls=2)
    OrmQ.objects.all().delete()
    hold_row(other_session, task)

    async def hand_in() -> list[bool]:
        recorder = operations.Recorder(OWNER)
        try:
            first = asyncio.create_task(recorder.record(outcome(a), pool="tool:search"))
            assert await asyncio.to_thread(lock_waiters_reach, 1)
            second = asyncio.create_task(recorder.record(outcome(b), pool="tool:search"))
            assert await asyncio.to_thread(lock_waiters_reach, 2), "both batches wait for the row, each on its thread"
        finally:
            other_session.execute("ROLLBACK")
        try:
            return list(await asyncio.gather(first, second))
        finally:
            await recorder.closed()

    assert asyncio.run(hand_in()) == [True, True]
    assert made_due() == [task.pk]
    assert advance_kicks() == kicks_for(1)
    assert TaskEvent.objects.filter(task=task, kind="tool_results_ready").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_closed_recorder_gives_back_its_database_threads_and_takes_no_more_outcomes(acme, alice):
    (_, [first]), (_, [late]) = waiting(acme, alice), waiting(acme, alice)

    async def record_close_record() -> None:
        recorder = operations.Recorder(OWNER)
        assert await recorder.record(outcome(first), pool="tool:search") is True
        await recorder.closed()
        with pytest.raises(InternalError, match="recorder was closed"):
            await recorder.record(outcome(late), pool="tool:search")

    asyncio.run(record_close_record())
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("gateway-recorder")])
    assert (status(first), status(late)) == (Op.SUCCEEDED, Op.STARTED), "the late one is left to its lease"


# --- calls requested while a job runs ------------------------------------------------------

on_postgresql = pytest.mark.skipif("connection.vendor != 'postgresql'", reason="LISTEN/NOTIFY is PostgreSQL's")


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_commit_that_requests_calls_notifies_the_gateway_channel(acme, alice):
    task = make_task(acme, alice, status=TaskStatus.RUNNING, current_step=1)
    with psycopg.connect(requested.conninfo(), autocommit=True) as listening:
        listening.execute(f"LISTEN {requested.CHANNEL}")
        with transaction.atomic():  # a call for later: the gateway kick at its time starts it, nothing to hear
            operations.request(task, token=0, now=clock.now(), requests=[
                OpRequest("tool", "search", {"query": "later"}, not_before=clock.now() + timedelta(minutes=5))])
        with transaction.atomic():
            operations.request(task, token=0, requests=[OpRequest("tool", "search", {"query": "q"})],
                               now=clock.now())
        heard = list(listening.notifies(timeout=3, stop_after=2))
    assert [n.channel for n in heard] == [requested.CHANNEL], "one commit to hear of, not two"


@contextlib.contextmanager
def heard_or_not_at_all(settings, monkeypatch, reply: Reply) -> Iterator[FakeOpenAI]:
    """A fake model server for the calls, and gateway jobs that would look for calls only in a minute: a call
    they claim sooner, they heard of."""
    monkeypatch.setattr(requested, "LOOK_EVERY", 60.0)
    settings.LONGHAUL_MODEL_PROVIDER, settings.LONGHAUL_MODEL, settings.LONGHAUL_MODEL_API_KEY = \
        "openai", "fake-model", "sk-test"
    with FakeOpenAI(default=reply) as server:
        settings.LONGHAUL_MODEL_BASE_URL = server.base_url
        yield server


@contextlib.contextmanager
def gateway_job() -> Iterator[None]:
    job = threading.Thread(target=operations.run_due, kwargs={"run_for": 30})
    job.start()
    try:
        yield
    finally:
        job.join(timeout=60)


def plan_call(tenant, owner, question: str) -> Operation:
    """A plan call of a task waiting for it."""
    task = make_task(tenant, owner, status=TaskStatus.WAITING_TOOL, next_run_at=None, current_step=1)
    return call(task, 0, kind="model", name="plan", args=plan_args(question))


def status(op: Operation) -> str:
    return Operation.objects.get(pk=op.pk).status


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_running_gateway_job_claims_a_call_requested_meanwhile_without_waiting_to_look(
        acme, alice, settings, monkeypatch):
    with heard_or_not_at_all(settings, monkeypatch, Reply(content=PLAN_REPLY, delay=5)):
        slow = plan_call(acme, alice, "slow")
        with gateway_job():
            wait_for(lambda: status(slow) == Op.STARTED)
            later = plan_call(acme, alice, "later")
            wait_for(lambda: status(later) != Op.PENDING)
            assert status(slow) == Op.STARTED, "claimed while the first was still out"
    assert set(Operation.objects.filter(pk__in=[slow.pk, later.pk]).values_list("status", flat=True)) == {Op.SUCCEEDED}


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_job_whose_last_look_found_nothing_due_still_hears_the_calls_requested_next(
        acme, alice, settings, monkeypatch):
    # Its last look (after the fast call ended) found nothing due: a call requested then must not wait for the
    # held call to end, nor for the next look.
    with heard_or_not_at_all(settings, monkeypatch, Reply(content=PLAN_REPLY)) as server:
        gate = server.hold(lambda body: "held" in str(body))
        held, fast = plan_call(acme, alice, "held"), plan_call(acme, alice, "fast")
        with gateway_job():
            try:
                wait_for(lambda: status(fast) == Op.SUCCEEDED)
                later = plan_call(acme, alice, "later")
                wait_for(lambda: status(later) == Op.SUCCEEDED)
                assert status(held) == Op.STARTED, "claimed while the held call was out"
            finally:
                gate.set()
    assert status(held) == Op.SUCCEEDED


def plan_args(question: str) -> dict[str, Any]:
    return {"question": question, "constraints": "", "max_subquestions": 3}


def wait_for(condition, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_worker_running_steps_makes_way_for_a_gateway_kick_only_while_no_job_holds_the_turn(acme, alice):
    kicks.kick("operations", 0)
    assert kicks.waiting(now=clock.now(), besides=0).jobs, "nobody runs the gateway: the kick must be run"
    with psycopg.connect(requested.conninfo().replace(f"dbname={connection.settings_dict['NAME']}",
                                                      "dbname=postgres"), autocommit=True) as elsewhere:
        elsewhere.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
        assert kicks.waiting(now=clock.now(), besides=0).jobs, "another database's gateway job holds another turn"
    with psycopg.connect(requested.conninfo(), autocommit=True) as gateway_job:
        gateway_job.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
        assert not kicks.waiting(now=clock.now(), besides=0).jobs, "the job holding the turn hears the calls"
        kicks.kick("deliver", 0)
        assert kicks.waiting(now=clock.now(), besides=0).jobs, "other jobs still count"
