"""One gateway job claims at a time on PostgreSQL; the others return at once, and work left
over when the claiming job ends is kicked on to the next job."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from tasks import actions, broker, jobs, operations, pools
from tasks.models import Operation, Pool, Task
from tasks.statuses import OperationStatus
from tests.integration.lock_waits import another_waits

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
            assert operations.take_gateway_turn()
            turn_taken.set()
            assert gate_held.wait(10)
            operations.end_gateway_turn()
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
        cursor.execute(f"SELECT {broker.TURN_FREE_BEHIND_GATE}", [broker.GATEWAY_GATE_KEY, broker.GATEWAY_GATE_KEY])
        assert cursor.fetchone() == (False,)
