"""A worker's gateway job runs on a thread beside the worker's jobs (tasks/gateway_thread.py): the job returns
while its calls are out, the worker runs steps meanwhile, one thread claims at a time per process, and each
thread's turn is a database session of its own."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from tasks import actions, drain, gateway_thread, jobs, operations
from tasks.models import Operation, Task
from tasks.statuses import OperationStatus, TaskStatus
from tests.factories import submit_sleep
from tests.fakes.openai_server import (
    FakeOpenAI,
    Reply,
    prompt_of,
    purpose_of,
    research_reply,
    serving_as_the_model,
)
from tests.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)  # the gateway's threads read what the test commits


@pytest.fixture
def plans_held(settings) -> Iterator[tuple[FakeOpenAI, threading.Event]]:
    """The model server, holding every plan call until the gate opens; the test's gateway threads end with it."""
    settings.LONGHAUL_STEP_SLICE_MS = 0
    with serving_as_the_model(settings, default=Reply(content=research_reply)) as server:
        gate = server.hold(lambda body: purpose_of(body) == "plan")
        try:
            yield server, gate
        finally:
            gate.set()
            gateway_thread.join()


def waiting_for_its_plan(tenant, user, question: str = "How does asyncio task cancellation work?") -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="research", input={"question": question}))
    jobs.advance(task.pk)  # the first step asks for the plan call
    assert Operation.objects.filter(task=task, status=OperationStatus.PENDING).count() == 1
    return task


def plan_of(question: str, body: dict) -> bool:
    purpose, prompt = prompt_of(body)
    return purpose == "plan" and question in prompt


def kick_gateway(task_id: int) -> None:
    """Run the gateway job as a worker would, and see it return while its calls are out (before the change it
    ran them to the end: a bounded wait makes that a failure, not a hang)."""
    job = threading.Thread(target=jobs.run_operations, args=(task_id,))
    job.start()
    job.join(20)
    assert not job.is_alive(), "the gateway job returned while its calls were out"


def first_thread_ended() -> None:
    """Of the two gateway threads, the first (its call answered) has ended."""
    wait_until(lambda: sum(t.name == "longhaul-gateway" for t in threading.enumerate()) == 1, timeout=20,
               interval=0.02, message="the first thread's end")


def held(server: FakeOpenAI, count: int) -> None:
    wait_until(lambda: server.held == count, timeout=20, interval=0.02, message=f"{count} plan calls held")


def test_a_gateway_job_returns_while_its_calls_are_out_and_the_worker_runs_steps_meanwhile(acme, alice, plans_held):
    server, gate = plans_held
    researching = waiting_for_its_plan(acme, alice)
    kick_gateway(researching.pk)
    held(server, 1)  # the job has returned; its call is out on the gateway thread
    assert Operation.objects.get(task=researching).status == OperationStatus.STARTED

    sleeping = submit_sleep(acme, alice, steps=1)
    jobs.advance(sleeping.pk)
    assert Task.objects.get(pk=sleeping.pk).status == TaskStatus.SUCCEEDED, "the worker ran a step meanwhile"
    assert server.held == 1 and Operation.objects.get(task=researching).status == OperationStatus.STARTED

    gate.set()
    gateway_thread.join()
    assert Operation.objects.get(task=researching).status == OperationStatus.SUCCEEDED


def test_a_kick_while_the_processs_gateway_thread_claims_starts_no_other(acme, alice, plans_held):
    server, _ = plans_held
    kick_gateway(waiting_for_its_plan(acme, alice).pk)
    held(server, 1)
    assert gateway_thread.holds_turn()
    assert not gateway_thread.start()
    second = waiting_for_its_plan(acme, alice)
    held(server, 2)  # the thread claiming heard the second step's commit: no job was needed for it
    assert Operation.objects.get(task=second).status == OperationStatus.STARTED


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the turn is PostgreSQL's advisory lock")
def test_a_second_job_in_the_same_process_is_refused_the_turn_while_the_first_holds_it(acme, alice, plans_held):
    """The turn is a session lock, which its own session may take again: it is held on the claiming job's own
    connection, not on the one the process's jobs share, so a second job here is refused as one elsewhere is."""
    server, _ = plans_held
    waiting_for_its_plan(acme, alice)
    first = threading.Thread(target=operations.run_due)
    first.start()
    try:
        held(server, 1)
        assert operations.run_due(run_for=1) is None
    finally:
        plans_held[1].set()
        first.join()


@pytest.fixture
def a_thread_waiting_for_its_last_call(acme, alice, settings) -> Iterator[tuple[FakeOpenAI, dict[str, Any]]]:
    """A gateway thread whose slice is over, waiting for its one call (the first question's plan) without the
    turn; the second question's plan is held too, once asked. Yields the server and each question's gate."""
    settings.LONGHAUL_STEP_SLICE_MS = 0
    settings.LONGHAUL_GATEWAY_SLICE_SECONDS = 1.0
    with serving_as_the_model(settings, default=Reply(content=research_reply)) as server:
        gates = {question: server.hold(functools.partial(plan_of, question))
                 for question in ("first question", "second question")}
        try:
            kick_gateway(waiting_for_its_plan(acme, alice, "first question").pk)
            held(server, 1)
            wait_until(lambda: not gateway_thread.holds_turn(), timeout=20, interval=0.02, message="the slice's end")
            settings.LONGHAUL_GATEWAY_SLICE_SECONDS = 60.0  # the next thread claims for the rest of the test
            yield server, gates
        finally:
            for gate in gates.values():
                gate.set()
            gateway_thread.join()


def test_once_its_thread_stops_claiming_a_kick_starts_another_which_claims_beside_it(
        acme, alice, a_thread_waiting_for_its_last_call):
    """A job whose slice is over waits for its last calls without the turn; the next kick's thread takes it,
    and the first thread's end leaves the second's claim standing (a third kick starts nothing)."""
    server, gates = a_thread_waiting_for_its_last_call
    second = waiting_for_its_plan(acme, alice, "second question")  # after the first thread's turn
    kick_gateway(second.pk)
    held(server, 2)
    assert Operation.objects.get(task=second).status == OperationStatus.STARTED

    gates["first question"].set()
    first_thread_ended()
    assert gateway_thread.holds_turn(), "the second thread still holds the turn"
    assert not gateway_thread.start()
    gates["second question"].set()
    gateway_thread.join()
    assert set(Operation.objects.values_list("status", flat=True)) == {OperationStatus.SUCCEEDED}


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the turn is PostgreSQL's advisory lock")
def test_the_first_threads_end_leaves_the_turn_of_the_thread_beside_it_held(
        acme, alice, a_thread_waiting_for_its_last_call, other_session):
    """Each thread's turn is a session of its own: the first thread, ending, closes its connections (and those of
    the thread the process's jobs share) without ending the second's turn."""
    server, gates = a_thread_waiting_for_its_last_call
    kick_gateway(waiting_for_its_plan(acme, alice, "second question").pk)
    held(server, 2)
    gates["first question"].set()
    first_thread_ended()
    taken = other_session.execute("SELECT pg_try_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY]).fetchone()[0]
    assert not taken, "the second thread's turn ended with the first thread"
    gates["second question"].set()
    gateway_thread.join()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the turn is PostgreSQL's advisory lock")
def test_a_thread_refused_the_turn_stands_in_the_way_of_no_kick(acme, alice, plans_held, other_session):
    """Only a thread holding the turn makes a kick start nothing: a kick that comes while another thread is
    still being refused (the turn held elsewhere, and given back meanwhile) must start one that tries again."""
    other_session.execute("SELECT pg_advisory_lock(%s)", [operations.GATEWAY_TURN_KEY])
    assert gateway_thread.start()
    assert not gateway_thread.holds_turn()
    assert gateway_thread.start(), "a kick while a thread was still trying for the turn started nothing"
    gateway_thread.join(20)


def test_the_calls_out_of_every_gateway_thread_of_a_process_count_against_its_one_cap(
        acme, alice, settings, a_thread_waiting_for_its_last_call):
    """A thread waiting for its last calls runs beside the next: together they keep no more calls out than
    LONGHAUL_GATEWAY_INFLIGHT (the open files the process raised its limit for)."""
    server, gates = a_thread_waiting_for_its_last_call
    settings.LONGHAUL_GATEWAY_INFLIGHT = 1  # read by each job as it starts: the next one's cap
    second = waiting_for_its_plan(acme, alice, "second question")
    kick_gateway(second.pk)
    wait_until(gateway_thread.holds_turn, timeout=20, interval=0.02, message="the second thread's turn")
    time.sleep(0.5)  # room for a claim beyond the cap to show
    assert Operation.objects.get(task=second).status == OperationStatus.PENDING, "the cap was the job's"
    assert operations.calls_out() == 1
    gates["first question"].set()
    wait_until(lambda: Operation.objects.get(task=second).status == OperationStatus.STARTED, timeout=20,
               interval=0.02, message="the second call claimed once the first answered")
    held(server, 1)
    gates["second question"].set()
    gateway_thread.join()
    assert set(Operation.objects.values_list("status", flat=True)) == {OperationStatus.SUCCEEDED}


def test_a_job_on_one_thread_holds_up_no_job_on_another():
    ended = threading.Event()

    def another_job() -> None:
        with drain.job():
            pass
        ended.set()

    with drain.job():
        other = threading.Thread(target=another_job)
        other.start()
        assert ended.wait(10), "a job on another thread waited for this one"
    other.join()


def test_a_draining_worker_exits_only_between_the_jobs_of_all_its_threads():
    order: list[str] = []
    in_job, release = threading.Event(), threading.Event()

    def the_gateway_thread() -> None:
        with drain.job():
            in_job.set()
            release.wait(10)
            order.append("the job ended")

    def exit_between_jobs() -> None:
        with drain.between_jobs():
            order.append("the process exits")

    job = threading.Thread(target=the_gateway_thread)
    job.start()
    assert in_job.wait(10)
    leaving = threading.Thread(target=exit_between_jobs)
    leaving.start()
    time.sleep(0.2)  # room for an exit that does not wait to come first
    release.set()
    job.join(10)
    leaving.join(10)
    assert order == ["the job ended", "the process exits"]

