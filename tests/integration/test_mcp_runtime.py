"""The runtime under remote MCP tasks (issue #16): what a step learns about its remote task is stored
in its commit, one owner cannot track a remote task twice, a question can carry a form and be
answered with data, a question is watched while it waits and withdrawn when the remote moved on,
a remote task whose handle could not be recorded is cancelled once, and a draining gateway job
hands back a call that hangs.

A scripted driver (`probe16`, below) returns exactly the outcomes each test needs, so these tests
pin the runtime's side of the contract whatever the `mcp` driver does; the calls it requests are
real (the offline search tool, or the test MCP server in a subprocess).
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
import time_machine
from django.db import OperationalError, connection, connections, transaction

from tasks import actions, clock, drain, drivers, jobs, liveness, operations, transitions
from tasks.drivers import Ask, Continue, Finish, OpRequest, Pins, RemoteFacts
from tasks.errors import PermanentError
from tasks.mcp import calls as mcp_calls
from tasks.mcp import client
from tasks.models import Checkpoint, Operation, Task, TaskEvent
from tasks.runner import ALREADY_TRACKED
from tasks.statuses import TERMINAL, OperationStatus, TaskStatus
from tests.fakes.mcp_task_server import SERVER_NAME, McpTaskServer, calls, write_servers_file

# Transactional: the heartbeat thread and the gateway's executor thread use their own connections.
pytestmark = pytest.mark.django_db(transaction=True)

SEARCH = {"kind": "tool", "name": "search", "args": {"query": "cancellation", "limit": 1}}
FORM = {"type": "object", "properties": {"copies": {"type": "integer", "minimum": 1}}, "required": ["copies"]}


def _request(spec: dict[str, Any]) -> OpRequest:
    later = spec.get("after_s")
    return OpRequest(spec["kind"], spec["name"], spec["args"], once=spec.get("once", False),
                     not_before=clock.now() + timedelta(seconds=later) if later is not None else None)


class Probe:
    """A scripted driver: step i does input["plan"][i], and the state records what each step saw."""

    kind: ClassVar[str] = "probe16"
    schema_version: ClassVar[int] = 1
    debug_only: ClassVar[bool] = True
    stands: ClassVar[bool] = True  # what question_stands answers; set by the tests
    watched: ClassVar[list[Any]] = []  # the results question_stands was shown

    def pins(self) -> Pins:
        return Pins()

    def validate_input(self, raw: Any, *, tenant=None, internal: bool = False) -> dict[str, Any]:
        return raw

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]:
        return {"i": 0, "seen": []}

    def step(self, state: dict[str, Any], ctx) -> Any:
        plan = ctx.input["plan"]
        seen = [{"name": o.name, "finished": o.finished, "ok": o.ok} for o in ctx.requested_outcomes()]
        i = state["i"]
        state = {"i": i + 1, "seen": [*state["seen"], seen], "answer": ctx.answer, "answer_data": ctx.answer_data}
        if i >= len(plan):
            return Finish(state, {"summary": "done"})
        does = plan[i]
        remote = RemoteFacts(**does["remote"]) if "remote" in does else None
        if does["do"] == "ask":
            watch = _request(does["watch"]) if "watch" in does else None
            return Ask(state, does.get("question", "How many copies?"), form=does.get("form"), watch=watch,
                       remote=remote)
        if does["do"] == "fail":
            raise PermanentError("the script says so")
        requests = [_request(r) for r in does.get("requests", [])]
        return Continue(state, requests=requests, remote=remote)

    def partial_result(self, state: dict[str, Any]) -> None:
        return None

    def question_stands(self, state: dict[str, Any], result: Any) -> bool:
        Probe.watched.append(result)
        return Probe.stands


class RemoteProbe(Probe):
    """The scripted driver as one whose work lives on a remote server (it would cancel it when abandoned)."""

    kind: ClassVar[str] = "probe16r"
    cancel_facts: ClassVar[RemoteFacts | None] = None  # what a cancel round learns; None: nothing to cancel

    def remote_to_cancel(self, task_id: int, state: dict[str, Any] | None) -> bool:
        return RemoteProbe.cancel_facts is not None

    def cancel_step(self, state: dict[str, Any], ctx) -> Continue | None:
        return Continue(state, remote=RemoteProbe.cancel_facts)

    def abandon(self, task: Task, state: dict[str, Any] | None) -> list[OpRequest]:
        return [OpRequest("mcp", "tasks/cancel", {"server": SERVER_NAME, "remote": "whatever", "abandon": True})]


@pytest.fixture(autouse=True)
def probe(monkeypatch, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    drivers.get_driver("sleep")  # builds the registry
    monkeypatch.setitem(drivers._DRIVERS, Probe.kind, Probe())
    monkeypatch.setitem(drivers._DRIVERS, RemoteProbe.kind, RemoteProbe())
    Probe.stands = True
    Probe.watched = []
    RemoteProbe.cancel_facts = None


def submit(tenant, user, plan: list[dict[str, Any]], *, kind: str = Probe.kind, name: str = "probe") -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind=kind, name=name, input={"plan": plan}))
    return task


def follow(task: Task, *, until: Callable[[Task], bool] = lambda t: t.status in TERMINAL,
           timeout: float = 30, settle: bool = True) -> Task:
    """Run the task as a cluster would: its steps when due, and gateway jobs for the calls due
    (`settle`: all of them before it returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task.refresh_from_db()
        calls_due = operations.due_exists(clock.now())
        if until(task) and not (settle and calls_due):
            return task
        if calls_due:
            operations.run_due(run_for=0.1)
        elif task.status in (TaskStatus.RUNNING, TaskStatus.RETRY_WAIT) and task.next_run_at \
                and task.next_run_at <= clock.now():
            jobs.advance(task.pk)
        else:
            time.sleep(0.02)
    raise AssertionError(f"still {task.status} ({task.waiting_reason}) after {timeout} s")


def waiting_input(task: Task) -> bool:
    return task.status == TaskStatus.WAITING_INPUT


def kinds(task: Task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", flat=True))


def last_state(task: Task) -> dict[str, Any]:
    return Checkpoint.objects.filter(task=task).order_by("-step").first().state


def watches(task: Task):
    return Operation.objects.filter(task=task, key__contains=":w").order_by("id")


def violations_of(task: Task, *, at=None) -> list[liveness.Violation]:
    return [v for v in liveness.find_violations(at or clock.now())
            if (v.table == "task" and v.row_id == task.pk)
            or (v.table == "operation" and Operation.objects.filter(pk=v.row_id, task=task).exists())]


# --- what a step learned about its remote task -----------------------------------------------


def test_it_stores_what_a_step_learned_about_its_remote_task_with_the_step(acme, alice):
    task = follow(submit(acme, alice, [
        {"do": "continue", "remote": {"handle": "remote-1", "server": "reports", "poll_error": "timed out"}},
        {"do": "continue", "remote": {"cancel_attempts": 2, "cancel_error": "the server did not answer"}},
        {"do": "continue", "remote": {"poll_error": ""}},
    ]))
    assert task.status == TaskStatus.SUCCEEDED
    assert (task.remote_handle, task.remote_server) == ("remote-1", "reports")
    assert task.remote_poll_error == "", "an empty text clears the column"
    assert (task.remote_cancel_attempts, task.remote_cancel_error) == (2, "the server did not answer")


def test_a_cancel_round_stores_its_attempts_and_error_with_the_cancel(acme, alice):
    RemoteProbe.cancel_facts = RemoteFacts(cancel_attempts=2, cancel_error="the server did not answer")
    task = follow(submit(acme, alice, [{"do": "ask"}], kind=RemoteProbe.kind), until=waiting_input)
    task = follow(actions.request_cancel(task, user=alice))
    assert task.status == TaskStatus.CANCELLED
    assert (task.remote_cancel_attempts, task.remote_cancel_error) == (2, "the server did not answer")


def test_it_bounds_the_remote_errors_it_stores(acme, alice):
    task = follow(submit(acme, alice, [{"do": "continue", "remote": {"poll_error": "x" * 10_000,
                                                                      "cancel_error": "y" * 10_000}}]))
    assert len(task.remote_poll_error) == 4000 and len(task.remote_cancel_error) == 4000


def test_it_refuses_a_remote_task_the_same_owner_already_tracks_on_that_server(acme, alice, bob):
    facts = {"handle": "remote-dup", "server": "reports"}
    first = follow(submit(acme, alice, [{"do": "continue", "remote": facts},
                                        {"do": "ask"}], kind=RemoteProbe.kind), until=waiting_input)
    second = follow(submit(acme, alice, [{"do": "continue", "remote": facts}], kind=RemoteProbe.kind))

    assert second.status == TaskStatus.FAILED
    assert (second.error_class, second.error_message) == ("permanent", ALREADY_TRACKED)
    assert second.remote_handle is None
    assert not Operation.objects.filter(task=second, name="tasks/cancel").exists(), \
        "the remote task is the first task's work: nothing asks it to stop"
    first.refresh_from_db()
    assert first.status == TaskStatus.WAITING_INPUT and first.remote_handle == "remote-dup"

    # Another owner, or the same owner on another server, may track that handle.
    other_owner = follow(submit(acme, bob, [{"do": "continue", "remote": facts}], kind=RemoteProbe.kind))
    other_server = follow(submit(acme, alice, [{"do": "continue", "remote": {**facts, "server": "archive"}}],
                                 kind=RemoteProbe.kind))
    assert other_owner.status == other_server.status == TaskStatus.SUCCEEDED
    assert other_owner.remote_handle == other_server.remote_handle == "remote-dup"


def test_a_remote_task_tracked_by_a_task_that_ended_may_be_tracked_again(acme, alice):
    """Servers reuse ids: a task that ended no longer holds its handle; an active one does."""
    facts = {"handle": "remote-reused", "server": "reports"}
    first = follow(submit(acme, alice, [{"do": "continue", "remote": facts}], kind=RemoteProbe.kind))
    assert first.status == TaskStatus.SUCCEEDED and first.remote_handle == "remote-reused"
    second = follow(submit(acme, alice, [{"do": "continue", "remote": facts}, {"do": "ask"}], kind=RemoteProbe.kind),
                    until=lambda t: waiting_input(t) or t.status in TERMINAL)
    assert second.status == TaskStatus.WAITING_INPUT and second.remote_handle == "remote-reused"
    third = follow(submit(acme, alice, [{"do": "continue", "remote": facts}], kind=RemoteProbe.kind))
    assert (third.status, third.error_message) == (TaskStatus.FAILED, ALREADY_TRACKED), "the second one is active"


# --- questions with forms ----------------------------------------------------------------------


def test_a_question_keeps_its_form_and_the_next_step_reads_a_structured_answer(acme, alice):
    task = follow(submit(acme, alice, [{"do": "ask", "form": FORM}]), until=waiting_input)
    assert task.question == "How many copies?" and task.question_form == FORM

    answer = {"action": "accept", "content": {"copies": 3}}
    with transaction.atomic():
        assert transitions.answer(Task.objects.select_for_update().get(pk=task.pk), now=clock.now(),
                                  text="copies: 3", data=answer)
    task.refresh_from_db()
    assert task.answer_data == answer and task.answer == "copies: 3"

    task = follow(task)
    assert task.status == TaskStatus.SUCCEEDED
    assert last_state(task)["answer_data"] == answer and last_state(task)["answer"] == "copies: 3"


def test_a_new_question_forgets_the_last_structured_answer(acme, alice):
    task = follow(submit(acme, alice, [{"do": "ask", "form": FORM}, {"do": "ask"}]), until=waiting_input)
    with transaction.atomic():
        transitions.answer(Task.objects.select_for_update().get(pk=task.pk), now=clock.now(), text="3",
                           data={"action": "decline"})
    task = follow(task, until=lambda t: waiting_input(t) and t.current_step > 1)
    assert task.question_form is None and task.answer_data is None and task.answer == ""


# --- watching a remote task while its owner is asked -------------------------------------------


def test_a_question_that_still_stands_is_watched_again_no_sooner_than_a_minute_later(acme, alice):
    task = follow(submit(acme, alice, [{"do": "ask", "watch": SEARCH}]), until=waiting_input, settle=False)
    first, = watches(task)
    assert first.status == OperationStatus.PENDING

    task = follow(task, until=lambda t: watches(t).filter(status=OperationStatus.SUCCEEDED).exists())
    assert task.status == TaskStatus.WAITING_INPUT and task.question == "How many copies?"
    assert len(Probe.watched) == 1 and "results" in Probe.watched[0], "the driver judged the watch's result"
    done, again = watches(task)
    assert again.status == OperationStatus.PENDING and (again.name, again.args) == (done.name, done.args)
    assert again.not_before >= done.finished_at + operations.WATCH_AGAIN_AFTER
    assert not operations.due_exists(clock.now()), "not due before its minute is up"
    assert violations_of(task) == [], "a task asking its owner while it watches breaks no liveness rule"
    later = again.not_before + timedelta(seconds=1)
    assert violations_of(task, at=later) == []
    with time_machine.travel(later, tick=True):
        assert operations.due_exists(clock.now())
        follow(task, until=lambda t: watches(t).count() == 3)
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT and len(Probe.watched) == 2


def test_a_question_that_no_longer_stands_is_withdrawn_and_the_next_step_reads_the_watch(acme, alice):
    Probe.stands = False
    task = follow(submit(acme, alice, [{"do": "ask", "form": FORM, "watch": SEARCH}]))
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    events = kinds(task)
    assert events.index("input_required") < events.index("question_withdrawn") < events.index("succeeded")
    assert "input_received" not in events
    assert task.question == "" and task.question_form is None
    assert last_state(task)["seen"][-1] == [{"name": "search", "finished": True, "ok": True}], \
        "the step after the withdrawal reads the watch's outcome"
    assert watches(task).count() == 1, "a withdrawn question is not watched again"


def test_an_answer_stops_the_watch_and_the_next_step_does_not_wait_for_it(acme, alice):
    task = follow(submit(acme, alice, [{"do": "ask", "watch": {**SEARCH, "after_s": 3600}}]),
                  until=waiting_input)
    with transaction.atomic():
        transitions.answer(Task.objects.select_for_update().get(pk=task.pk), now=clock.now(), text="3")
    task = follow(task)
    assert task.status == TaskStatus.SUCCEEDED
    watch, = watches(task)
    assert watch.status == OperationStatus.FAILED and watch.error_class == "cancelled"
    assert Probe.watched == []


def test_a_watch_that_could_not_reach_its_server_leaves_the_question_standing(acme, alice, settings):
    settings.LONGHAUL_SEARCH_URL = "http://127.0.0.1:9/search"  # nothing listens there
    task = follow(submit(acme, alice, [{"do": "ask", "watch": SEARCH}]), until=lambda t: watches(t).filter(
        status=OperationStatus.FAILED).exists())
    assert task.status == TaskStatus.WAITING_INPUT
    failed, again = watches(task)
    assert failed.error_class == "transient" and again.status == OperationStatus.PENDING
    assert Probe.watched == [], "a failed call is not the driver's to judge"


def test_a_watch_that_failed_otherwise_leaves_the_question_standing(acme, alice, settings):
    """A watch that died with its gateway jobs (poison), like a 401 or an internal error, says nothing about
    the question: it stands and is watched again later."""
    task = follow(submit(acme, alice, [{"do": "ask", "watch": SEARCH}]), until=waiting_input, settle=False)
    watch, = watches(task)
    Operation.objects.filter(pk=watch.pk).update(status=OperationStatus.STARTED, lease_owner="dead-worker",
                                                 attempts=settings.LONGHAUL_MAX_ATTEMPTS,
                                                 lease_expires_at=clock.now() - timedelta(seconds=1))
    assert operations.settle_lost_calls(now=clock.now()) == 1
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT and task.question == "How many copies?"
    failed, again = watches(task)
    assert failed.error_class == "poison" and again.status == OperationStatus.PENDING
    assert again.not_before >= failed.finished_at + operations.WATCH_AGAIN_AFTER
    assert "question_withdrawn" not in kinds(task) and Probe.watched == []


def test_a_watch_left_behind_by_a_task_that_moved_on_is_closed_by_the_sweep(acme, alice, settings):
    task = follow(submit(acme, alice, [{"do": "ask", "watch": SEARCH}]), until=waiting_input, settle=False)
    watch, = watches(task)
    # A gateway job took the watch and died; meanwhile the owner answered.
    Operation.objects.filter(pk=watch.pk).update(status=OperationStatus.STARTED, lease_owner="dead-worker",
                                                 lease_expires_at=clock.now() - timedelta(seconds=1))
    with transaction.atomic():
        transitions.answer(Task.objects.select_for_update().get(pk=task.pk), now=clock.now(), text="3")
    task = follow(task, until=lambda t: t.status == TaskStatus.SUCCEEDED)
    assert [v.rule for v in violations_of(task)] == ["operation_orphaned"]
    liveness.repair(clock.now())
    watch.refresh_from_db()
    assert watch.status == OperationStatus.FAILED
    assert violations_of(task) == []


# --- a remote task whose handle could not be recorded ------------------------------------------


@pytest.fixture
def remote(tmp_path, settings) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir()
    with McpTaskServer(transport="http", state_dir=state) as server:
        settings.LONGHAUL_MCP_SERVERS = str(write_servers_file(tmp_path / "servers.json", server))
        yield state


@pytest.fixture
def unrecordable_tool_calls() -> Iterator[None]:
    """The database refuses to record a tools/call's success (as a full disk or a lost primary would)."""
    yield from _refusing_tool_call_results(after_s=0)


@pytest.fixture
def slowly_unrecordable_tool_calls() -> Iterator[None]:
    """The same refusal, after 3 s of the recording's statement (pg_sleep, waiting as PgSleep)."""
    yield from _refusing_tool_call_results(after_s=3)


def _refusing_tool_call_results(*, after_s: float) -> Iterator[None]:
    if connection.vendor != "postgresql":
        pytest.skip("the refusal is a PostgreSQL trigger")
    with connection.cursor() as cursor:
        cursor.execute(f"""
            CREATE FUNCTION refuse_tool_call_result() RETURNS trigger AS $$
            BEGIN
                IF NEW.name = 'tools/call' AND NEW.status = 'succeeded' THEN
                    PERFORM pg_sleep({float(after_s)});
                    RAISE EXCEPTION 'could not extend file (test)';
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse_tool_call_result BEFORE UPDATE ON tasks_operation
                FOR EACH ROW EXECUTE FUNCTION refuse_tool_call_result();
        """)
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER refuse_tool_call_result ON tasks_operation; "
                       "DROP FUNCTION refuse_tool_call_result();")


def _tool_call(tool: str, **arguments) -> dict[str, Any]:
    request = mcp_calls.call_tool(SERVER_NAME, tool, {"poll_ms": 100, **arguments})
    return {"kind": request.kind, "name": request.name, "args": request.args, "once": request.once}


def _run_the_call(task: Task) -> Operation:
    follow(task, until=lambda t: Operation.objects.filter(task=t, name="tools/call").exclude(
        status=OperationStatus.PENDING).exists())
    return Operation.objects.get(task=task, name="tools/call")


def test_a_remote_task_whose_handle_could_not_be_recorded_is_cancelled_once(remote, acme, alice,
                                                                           unrecordable_tool_calls, caplog):
    task = submit(acme, alice, [{"do": "continue", "requests": [_tool_call("slow_report", topic="t", seconds=30)]}])
    with caplog.at_level(logging.ERROR, logger="tasks.operations"):
        op = _run_the_call(task)
    assert op.status == OperationStatus.STARTED, "the outcome was never recorded"
    counts = calls(remote)
    assert counts.get("tools/call:slow_report") == 1 and counts.get("tasks/cancel") == 1
    assert "could not extend file (test)" in caplog.text, "the original error is raised, and reported"
    assert "cancelling it" in caplog.text


def test_a_failed_compensation_is_logged_beside_the_original_error(remote, acme, alice, unrecordable_tool_calls,
                                                                   caplog):
    task = submit(acme, alice, [{"do": "continue", "requests": [
        _tool_call("stubborn_job", seconds=30, cancel_failures=5)]}])
    with caplog.at_level(logging.ERROR, logger="tasks.operations"):
        _run_the_call(task)
    assert calls(remote).get("tasks/cancel") == 1, "one attempt, not a retry loop"
    assert "cancelling the unrecorded remote task failed too" in caplog.text
    assert "could not extend file (test)" in caplog.text


def _database_gone_while_compensating(monkeypatch, *, for_everyone: bool) -> None:
    """While a gateway job compensates for an unrecorded tools/call, the database answers nothing: to the
    compensation only (its context: its own code, and what it runs through sync_to_async), or to everything in
    the process (the job's own loop too; its slice ends as the compensation begins, so that the loop needs the
    database meanwhile, to give its turn back)."""
    compensate = operations._compensate
    cursor = type(connections["default"])._cursor
    gone = contextvars.ContextVar("database_gone", default=False)
    gone_everywhere = threading.Event()

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        if gone.get() or gone_everywhere.is_set():
            raise OperationalError("the database is gone (test)")
        return cursor(self, *args, **kwargs)

    async def without_database(*args: Any, **kwargs: Any) -> None:
        token = gone.set(True)
        if for_everyone:
            gone_everywhere.set()
            drain.ending.set()  # the job claims no more: at its next look it gives its turn back
        try:
            await compensate(*args, **kwargs)
        finally:
            gone_everywhere.clear()
            gone.reset(token)

    monkeypatch.setattr(type(connections["default"]), "_cursor", refuse)
    monkeypatch.setattr(operations, "_compensate", without_database)


@pytest.fixture
def database_gone_while_compensating(monkeypatch) -> None:
    _database_gone_while_compensating(monkeypatch, for_everyone=False)


@pytest.fixture
def database_gone_everywhere_while_compensating(monkeypatch) -> Iterator[None]:
    _database_gone_while_compensating(monkeypatch, for_everyone=True)
    yield
    drain.ending.clear()


def test_a_remote_task_is_cancelled_once_even_when_the_database_answers_nothing_any_more(
        remote, acme, alice, unrecordable_tool_calls, database_gone_while_compensating, caplog):
    task = submit(acme, alice, [{"do": "continue", "requests": [_tool_call("slow_report", topic="t", seconds=30)]}])
    with caplog.at_level(logging.ERROR, logger="tasks.operations"):
        op = _run_the_call(task)
    assert op.status == OperationStatus.STARTED, "the outcome was never recorded"
    assert calls(remote).get("tasks/cancel") == 1
    assert "could not extend file (test)" in caplog.text
    assert "failed too" not in caplog.text


def test_a_job_stopped_by_the_database_while_it_cancels_an_unrecorded_remote_task_sees_the_cancel_through(
        remote, acme, alice, unrecordable_tool_calls, database_gone_everywhere_while_compensating, caplog):
    # The server takes 1.5 s over the cancel; the job's slice ends as the compensation begins, and giving its turn
    # back needs the database, which is gone: the job stops with that error, but only once the cancel is through
    # (nothing else would ever stop the remote task: the call, which must not run twice, is failed once its lease
    # runs out). The slice is the fixture's to end: one timed to end meanwhile ended first on a busy machine, while
    # the call was out (call_delay_ms makes it so here), and the job then needed no database during the cancel.
    task = submit(acme, alice, [{"do": "continue", "requests": [
        _tool_call("slow_report", topic="t", seconds=30, cancel_delay_ms=1500, call_delay_ms=300)]}])
    follow(task, until=lambda t: Operation.objects.filter(task=t, name="tools/call").exists(), settle=False)
    with caplog.at_level(logging.ERROR, logger="tasks.operations"), \
            pytest.raises(OperationalError, match="the database is gone"):
        operations.run_due(run_for=60)
    assert [r.get("cancel_requested_at") is not None for r in _remote_tasks(remote)] == [True]
    assert "failed too" not in caplog.text


def test_a_job_drained_while_it_records_a_remote_task_still_cancels_it_when_the_record_fails(
        remote, acme, alice, slowly_unrecordable_tool_calls, draining, monkeypatch, caplog):
    # The call's record takes 3 s, then fails; the worker drains meanwhile and stops its calls. The record is seen
    # through all the same, and when it fails the remote task is cancelled.
    task = submit(acme, alice, [{"do": "continue", "requests": [_tool_call("slow_report", topic="t", seconds=30)]}])
    follow(task, until=lambda t: Operation.objects.filter(task=t, name="tools/call").exists(), settle=False)
    stopping = threading.Event()
    stop = operations._stop

    async def noting_the_stop(calls: Any) -> None:
        stopping.set()
        await stop(calls)

    monkeypatch.setattr(operations, "_stop", noting_the_stop)
    job = threading.Thread(target=operations.run_due, kwargs={"run_for": 60})
    with caplog.at_level(logging.ERROR, logger="tasks.operations"):
        job.start()
        try:
            _wait_for(_a_record_is_being_written)
            drain.start()
            assert stopping.wait(20), "the draining job stopped its calls"
            assert _a_record_is_being_written(), "the job stopped while the record was being written"
        finally:
            job.join(30)
    assert not job.is_alive()
    assert [r.get("cancel_requested_at") is not None for r in _remote_tasks(remote)] == [True]
    assert "could not extend file (test)" in caplog.text, "the record's error is reported"


def _a_record_is_being_written() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
                       "AND datname = current_database())")
        return cursor.fetchone()[0]


def _remote_tasks(state: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in (state / "tasks").glob("*.json")]


def test_a_recorded_tool_call_is_not_cancelled(remote, acme, alice):
    task = submit(acme, alice, [{"do": "continue", "requests": [_tool_call("slow_report", topic="t", seconds=30)]}])
    assert _run_the_call(task).status == OperationStatus.SUCCEEDED
    assert calls(remote).get("tasks/cancel", 0) == 0


# --- drain -------------------------------------------------------------------------------------


@pytest.fixture
def draining(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(drain, "GATEWAY_GRACE_SECONDS", 0.5)
    yield
    drain.draining.clear()


def test_a_draining_gateway_job_hands_back_a_call_that_hangs(remote, acme, alice, draining):
    handle = client.call_tool(client_config(), "slow_report", {"topic": "t", "seconds": 600, "hang_get_s": 600})
    get = {"kind": "mcp", "name": "tasks/get", "args": {"server": SERVER_NAME, "remote": handle.task.task_id}}
    task = follow(submit(acme, alice, [{"do": "continue", "requests": [get]}]),
                  until=lambda t: Operation.objects.filter(task=t, name="tasks/get").exists(), settle=False)
    op = Operation.objects.get(task=task, name="tasks/get")

    job = threading.Thread(target=operations.run_due, kwargs={"run_for": 60})
    job.start()
    _wait_for(lambda: Operation.objects.get(pk=op.pk).status == OperationStatus.STARTED)
    drain.start()
    job.join(timeout=30)
    assert not job.is_alive(), "the job ended well before the call's 600 s"

    op.refresh_from_db()
    assert (op.status, op.lease_owner, op.lease_expires_at) == (OperationStatus.PENDING, "", None)
    assert calls(remote).get("tasks/get", 0) >= 1
    drain.draining.clear()
    taken = operations.claim_batch(owner="another-worker", limit=10, now=clock.now())
    assert [o.key for o in taken] == [op.key], "another worker runs the same operation again"


def test_a_draining_gateway_job_never_hands_back_a_call_that_must_not_run_twice(acme, alice, draining):
    task = submit(acme, alice, [{"do": "continue", "requests": [SEARCH, {**SEARCH, "once": True}]}])
    follow(task, until=lambda t: Operation.objects.filter(task=t).count() == 2)
    now = clock.now()
    lease = now + timedelta(seconds=60)
    Operation.objects.filter(task=task).update(status=OperationStatus.STARTED, lease_owner="me", attempts=1,
                                               lease_expires_at=lease)
    assert operations.release(owner="me", ids=Operation.objects.filter(task=task).values_list("pk", flat=True)) == 1
    assert dict(Operation.objects.filter(task=task).values_list("has_side_effects", "status")) == {
        False: OperationStatus.PENDING, True: OperationStatus.STARTED}


def test_a_draining_gateway_job_hands_back_only_its_own_calls(acme, alice, draining):
    """The process's other gateway job (tasks/gateway_thread.py) claims under the same owner: its calls are its
    own to record or hand back."""
    another = {**SEARCH, "args": {"query": "another", "limit": 1}}
    task = submit(acme, alice, [{"do": "continue", "requests": [SEARCH, another]}])
    follow(task, until=lambda t: Operation.objects.filter(task=t).count() == 2)
    mine, theirs = Operation.objects.filter(task=task).order_by("pk")
    Operation.objects.filter(task=task).update(status=OperationStatus.STARTED, lease_owner="me", attempts=1,
                                               lease_expires_at=clock.now() + timedelta(seconds=60))
    assert operations.release(owner="me", ids=[mine.pk]) == 1
    assert dict(Operation.objects.filter(task=task).values_list("pk", "status")) == {
        mine.pk: OperationStatus.PENDING, theirs.pk: OperationStatus.STARTED}


def client_config() -> client.ServerConfig:
    from tasks.mcp import config

    return config.servers()[SERVER_NAME].config


def _wait_for(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)
