"""One gateway job claims at a time per turn on PostgreSQL (one turn by default, LONGHAUL_GATEWAY_TURNS); the
others return at once, and work left over when the claiming job ends is kicked on to the next job."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import pytest
from django.db import connection, transaction
from django.db.backends.signals import connection_created
from django.utils import timezone
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from tasks import actions, broker, clock, jobs, kicks, operations, pools
from tasks.models import Operation, Pool, Task
from tasks.statuses import OperationStatus
from tests.fakes.openai_server import FakeOpenAI, Reply
from tests.integration.lock_waits import another_waits
from tests.integration.test_gateway_pipeline import wait_for
from tests.integration.test_pools import PLAN_REPLY, call, waiting_for_tools

T = TypeVar("T")

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="advisory locks are PostgreSQL's")]


@pytest.fixture(autouse=True)
def _settings(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


def waiting_for_its_plan(tenant, user) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="research", input={"question": "How does asyncio task cancellation work?"}))
    jobs.advance(task.pk)  # the first step asks for the plan call
    assert Operation.objects.filter(task=task, status=OperationStatus.PENDING).count() == 1
    return task


def gateway_kicks() -> int:
    return sum(SignedPackage.loads(p)["func"] == "tasks.jobs.run_operations"
               for p in OrmQ.objects.values_list("payload", flat=True))


def test_it_runs_nothing_while_another_job_has_the_turn(acme, alice, other_session):
    task = waiting_for_its_plan(acme, alice)
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
    assert operations.run_due(run_for=2) is None
    assert Operation.objects.get(task=task).status == OperationStatus.PENDING
    other_session.execute("SELECT pg_advisory_unlock(%s)", [operations.GATEWAY_TURN_KEY])
    assert operations.run_due(run_for=2) == 1
    assert Operation.objects.get(task=task).status == OperationStatus.SUCCEEDED


def test_it_gives_the_turn_back_when_it_ends(acme, alice, other_session):
    waiting_for_its_plan(acme, alice)
    assert operations.run_due(run_for=2) == 1
    taken = other_session.execute("SELECT pg_try_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY]).fetchone()[0]
    assert taken, "the job released the gateway turn"


def test_a_job_whose_slice_ends_with_calls_due_kicks_the_next_job(acme, alice):
    task = waiting_for_its_plan(acme, alice)
    OrmQ.objects.all().delete()
    assert operations.run_due(run_for=0) == 0  # its slice is over before it claims anything
    assert Operation.objects.get(task=task).status == OperationStatus.PENDING
    assert gateway_kicks() == 1, "the work left over was handed to the next gateway job"


def test_a_job_that_finished_everything_kicks_nobody(acme, alice):
    waiting_for_its_plan(acme, alice)
    OrmQ.objects.all().delete()
    assert operations.run_due(run_for=2) == 1
    assert gateway_kicks() == 0


def sessions_opened_by(job: Callable[[], T]) -> tuple[T, list[str]]:
    """What `job` returned, and the threads on which it opened a database session of Django's, by their names'
    prefixes (gateway-claims, gateway-recorder-0, ...)."""
    opened: list[str] = []

    def count(**kwargs) -> None:
        opened.append(threading.current_thread().name.rsplit("_", 1)[0])

    connection_created.connect(count)
    try:
        return job(), opened
    finally:
        connection_created.disconnect(count)


def test_a_jobs_database_work_after_its_claims_opens_no_session_of_its_own(acme, alice):
    """Its watchdog withdrawn and its last look (kick_if_claimable) on its claims' connection, open and warm: on
    asgiref's thread, whose connection each job closes as it ends, every job paid for a new session there."""
    ran, opened = sessions_opened_by(lambda: operations.run_due(run_for=2))
    assert (ran, opened) == (0, ["gateway-claims"])
    waiting_for_its_plan(acme, alice)
    OrmQ.objects.all().delete()
    ran, opened = sessions_opened_by(lambda: operations.run_due(run_for=2))
    assert (ran, sorted(opened)) == (1, ["gateway-claims", "gateway-recorder-0"])
    assert gateway_kicks() == 0  # nothing left over, nothing kicked


def test_a_jobs_work_after_its_claims_keeps_their_session_however_old_while_it_holds_the_turn():
    """The turn is a lock of the claims' session: replaced for its age (past CONN_MAX_AGE, as close_old_connections
    does), the session would give the turn back before the job does."""
    def session() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    before = session()
    close_at = connection.close_at
    connection.close_at = time.monotonic() - 1  # older than CONN_MAX_AGE
    try:
        assert operations._usable_then(session) == before
    finally:
        connection.close_at = close_at


def test_a_step_asking_for_calls_while_a_job_has_the_turn_kicks_no_other_job(acme, alice, other_session):
    """The job holding the turn hears the calls a commit requests; another job would only be refused the turn."""
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
    waiting_for_its_plan(acme, alice)
    assert gateway_kicks() == 0


def test_a_step_asking_for_calls_while_no_job_has_the_turn_kicks_one(acme, alice):
    waiting_for_its_plan(acme, alice)
    assert gateway_kicks() == 1


def test_a_step_asking_for_calls_for_later_kicks_a_job_for_then_even_while_one_has_the_turn(
        acme, alice, other_session):
    """The job holding the turn may have ended by then: a call put off (its pool paused) keeps its delayed kick."""
    Pool.objects.create(key=pools.key_of("model", "plan", None), paused_until=timezone.now() + timedelta(minutes=5))
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
    waiting_for_its_plan(acme, alice)
    [lock] = [row.lock for row in OrmQ.objects.all()
              if SignedPackage.loads(row.payload)["func"] == "tasks.jobs.run_operations"]
    assert lock > timezone.now() + timedelta(minutes=4)


def test_a_job_giving_the_turn_back_waits_for_a_step_that_saw_it_held_and_then_sees_its_calls(
        acme, alice, other_session):
    """A step's statement that stores calls looks at the turn before it commits, and kicks no job while one holds
    it (kicks.calls_kick_in_move). The job giving the turn back waits for such a statement to commit before its
    last look, so that look sees the calls. Here the other session is that statement: it holds the gate, shared,
    as the statement does from its look to its commit, and the call it stores is due only once it commits."""
    task = waiting_for_its_plan(acme, alice)
    call = Operation.objects.get(task=task)
    Operation.objects.filter(pk=call.pk).update(not_before=timezone.now() + timedelta(hours=1))
    OrmQ.objects.all().delete()
    turn_taken, gate_held, look_done = threading.Event(), threading.Event(), threading.Event()

    def the_job_holding_the_turn() -> None:
        try:
            turn = operations.take_gateway_turn()
            assert turn is not None
            turn_taken.set()
            assert gate_held.wait(10)
            operations.end_gateway_turn(turn)
            operations.kick_if_claimable()  # its last look
            look_done.set()
        finally:
            connection.close()

    job = threading.Thread(target=the_job_holding_the_turn)
    job.start()
    assert turn_taken.wait(10)
    with other_session.transaction():
        # The step's statement, while the job holds the turn: it takes the gate, sees the turn held (so kicks no
        # job), stores its call, and has not committed yet when the job gives the turn back.
        other_session.execute("SELECT pg_advisory_xact_lock_shared(%s)", [broker.GATEWAY_GATE_KEY])
        other_session.execute("UPDATE tasks_operation SET not_before = NULL WHERE id = %s", [call.pk])
        gate_held.set()
        waits = another_waits(lambda sql, params: other_session.execute(sql, params).fetchone(),
                              other_session.info.backend_pid)
        assert waits and not look_done.is_set(), "the job looked before the step's statement committed"
    job.join(10)

    assert look_done.is_set()
    assert gateway_kicks() == 1, "its last look saw the call the step stored, and kicked a job for it"


def test_a_steps_statement_takes_the_gate_before_it_looks_at_the_turn():
    # Looking for the very lock it takes: the look sees it only if the lock came first.
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {broker.TURN_FREE_BEHIND_GATE}", [broker.GATEWAY_GATE_KEY, [broker.GATEWAY_GATE_KEY]])
        assert cursor.fetchone() == (False,)


# --- more than one turn (LONGHAUL_GATEWAY_TURNS) ----------------------------------------


def in_another_job(work: Callable[[], T]) -> T:
    """`work` on a thread and a database connection of its own, as another process's gateway job; the
    connection is closed after it (a turn it took is given back with its session)."""
    done: list[T] = []

    def run() -> None:
        try:
            done.append(work())
        finally:
            connection.close()

    job = threading.Thread(target=run)
    job.start()
    job.join(10)
    assert done, "the other job did not finish"
    return done[0]


def test_with_two_turns_a_job_takes_the_one_left_and_a_third_is_refused(settings, other_session):
    settings.LONGHAUL_GATEWAY_TURNS = 2
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
    turn = operations.take_gateway_turn()
    try:
        assert turn == operations.GATEWAY_TURN_KEY + 1
        assert in_another_job(operations.take_gateway_turn) is None, "both turns are held"
    finally:
        operations.end_gateway_turn(turn)
    assert in_another_job(operations.take_gateway_turn) == turn, "given back, it is free again"


def test_with_two_turns_a_step_asking_for_calls_kicks_a_job_until_both_are_held(acme, alice, settings,
                                                                                 other_session):
    settings.LONGHAUL_GATEWAY_TURNS = 2
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
    waiting_for_its_plan(acme, alice)
    assert gateway_kicks() == 1, "a turn is free: the kick starts a job that takes it"
    assert kicks.waiting(now=clock.now(), besides=0).jobs, "a worker running steps makes way for that kick"

    OrmQ.objects.all().delete()
    with transaction.atomic():  # a commit that requests calls outside a step's own statement kicks after it
        kicks.kick_calls(0, at=clock.now())
    assert gateway_kicks() == 1

    OrmQ.objects.all().delete()
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY + 1])
    waiting_for_its_plan(acme, alice)
    with transaction.atomic():
        kicks.kick_calls(0, at=clock.now())
    assert gateway_kicks() == 0, "the jobs holding both turns hear the calls"
    kicks.kick("operations", 0)
    assert not kicks.waiting(now=clock.now(), besides=0).jobs, "a gateway kick would start a job refused a turn"


def test_with_two_turns_the_job_that_takes_the_last_one_free_withdraws_the_gateway_kicks(settings):
    settings.LONGHAUL_GATEWAY_TURNS = 2
    for n in range(2):
        kicks.kick("operations", n)
    first = operations.take_gateway_turn()
    try:
        assert gateway_kicks() == 2, "the other turn is free: the kicks start a job that takes it"
        assert in_another_job(operations.take_gateway_turn) == operations.GATEWAY_TURN_KEY + 1
        assert gateway_kicks() == 0, "the job that took the last turn free withdrew them"
    finally:
        operations.end_gateway_turn(first)


def test_with_two_turns_a_second_job_claims_beside_the_first_within_the_pools_limit(acme, alice, settings):
    """One job's calls fill their pool and wait at the model server; a second job takes the other turn meanwhile,
    finds the pool full for its whole (short) slice and ends. Every call runs once, never more than the pool's two
    at a time."""
    settings.LONGHAUL_GATEWAY_TURNS = 2
    settings.LONGHAUL_MODEL_PROVIDER, settings.LONGHAUL_MODEL, settings.LONGHAUL_MODEL_API_KEY = \
        "openai", "fake-model", "sk-test"
    settings.LONGHAUL_POOLS = {"model:openai:fake-model": {"concurrency": 2}}
    with FakeOpenAI(default=Reply(content=PLAN_REPLY)) as server:
        settings.LONGHAUL_MODEL_BASE_URL = server.base_url
        tasks = [waiting_for_its_plan(acme, alice) for _ in range(4)]
        gate = server.hold(lambda body: True)
        first = threading.Thread(target=operations.run_due, kwargs={"run_for": 30})
        first.start()
        try:
            wait_for(lambda: Operation.objects.filter(status=OperationStatus.STARTED).count() == 2)
            assert operations.run_due(run_for=1) == 0, "the second job held a turn, and claimed nothing more"
        finally:
            gate.set()
            first.join(60)
    assert not first.is_alive()
    assert set(Operation.objects.filter(task__in=tasks).values_list("status", flat=True)) == {
        OperationStatus.SUCCEEDED}
    assert len(server.requests) == 4 and server.max_in_flight == 2


def test_jobs_claiming_two_pools_at_once_keep_a_task_within_its_cap_over_all_pools(acme, alice, settings,
                                                                                   other_session):
    """Jobs holding different turns claim at once. Another job's claim, not yet committed, has started the task's
    model call; this job's claim of the task's searches must count that call among the task's calls out."""
    settings.LONGHAUL_GATEWAY_TURNS = 2
    settings.LONGHAUL_TASK_CALLS_IN_FLIGHT = 2
    task = waiting_for_tools(acme, alice)
    model = call(task, 0, kind="model", name="plan")
    searches = [call(task, n) for n in (1, 2)]
    claimed: list[Operation] = []

    def this_jobs_claim() -> None:
        try:
            claimed.extend(operations.claim_batch(owner="gw:this", limit=10, now=clock.now()))
        finally:
            connection.close()

    with other_session.transaction():
        other_session.execute("SELECT pg_advisory_xact_lock(%s)", [operations.CLAIMS_KEY])
        other_session.execute(
            "UPDATE tasks_operation SET status = %s, lease_owner = 'gw:other', started_at = now(), "
            "lease_expires_at = now() + interval '3 minutes', attempts = 1 WHERE id = %s",
            [OperationStatus.STARTED, model.pk])
        this_job = threading.Thread(target=this_jobs_claim)
        this_job.start()
        another_waits(lambda sql, params: other_session.execute(sql, params).fetchone(),
                      other_session.info.backend_pid)
    this_job.join(20)
    assert [op.pk for op in claimed] == [searches[0].pk], "room for one more call of the task's two"
    assert Operation.objects.filter(task=task, status=OperationStatus.STARTED).count() == 2


def test_a_claim_that_fails_in_one_pool_starts_no_call_of_another(acme, alice, other_session):
    """A claim of calls from two pools is one transaction: when its second pool's part fails (here that pool's row
    stays locked past the claim's lock_timeout, as an operator's timeout may stop any statement), the first pool's
    calls stay pending. Committed on their own, they were started under a job that never ran them, found again only
    once their lease ran out, and then one that must not run twice was failed as lost, though it never ran."""
    search = call(waiting_for_tools(acme, alice), 0)
    visit = call(waiting_for_tools(acme, alice), 0, name="visit", args={"url": "https://example.org/"})
    Pool.objects.create(key=visit.pool)
    assert operations._pools_with_due_work(clock.now()) == [search.pool, visit.pool], "the search's pool first"
    with other_session.transaction():
        other_session.execute("SELECT 1 FROM tasks_pool WHERE key = %s FOR UPDATE", [visit.pool])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        try:
            with pytest.raises(Exception, match="lock timeout"):
                operations.claim_batch(owner="gw:1", limit=10, now=clock.now())
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    assert Operation.objects.get(pk=search.pk).status == OperationStatus.PENDING
    assert [op.pk for op in operations.claim_batch(owner="gw:2", limit=10, now=clock.now())] == [search.pk, visit.pk]


def test_with_two_turns_a_job_with_nothing_to_do_keeps_its_turn_and_claims_what_is_asked_for_next(
        acme, alice, settings):
    """Given back, its turn would be free, and each step asking for calls would kick a job to take it."""
    settings.LONGHAUL_GATEWAY_TURNS = 2
    took_turn = threading.Event()
    job = threading.Thread(target=operations.run_due, kwargs={"run_for": 5, "took_turn": took_turn.set})
    job.start()
    try:
        assert took_turn.wait(10)
        task = waiting_for_its_plan(acme, alice)
        wait_for(lambda: Operation.objects.get(task=task).status == OperationStatus.SUCCEEDED)
    finally:
        job.join(30)


def test_with_two_turns_a_job_claims_a_wave_in_shares_so_that_the_others_claims_come_between(
        acme, alice, settings, monkeypatch):
    """Every job holding a turn hears the same commits: a job taking all it could would leave the others nothing,
    and the calls' CPU would stay in its process. Each claim of one is a transaction of its own (one started_at)."""
    settings.LONGHAUL_GATEWAY_TURNS = 2
    monkeypatch.setattr(operations, "SHARE_AT_MOST", 2)
    acme.max_running = 5
    acme.save()
    tasks = [waiting_for_its_plan(acme, alice) for _ in range(5)]
    assert operations.run_due(run_for=0.5) == 5
    claims = Counter(Operation.objects.filter(task__in=tasks).values_list("started_at", flat=True))
    assert sorted(claims.values()) == [1, 2, 2]
