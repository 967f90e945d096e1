"""Remote MCP tasks end to end in-process: the `mcp` driver against the test MCP server,
a real subprocess reached over stdio or over streamable HTTP on loopback."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection

from chat.models import Message, Thread
from tasks import actions, clock, jobs, leases, operations, runner
from tasks.mcp import client
from tasks.models import Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import HOLDS_SLOT, TERMINAL, OperationStatus, TaskStatus
from tests.factories import submit_sleep
from tests.fakes.mcp_task_server import SERVER_NAME, McpTaskServer, calls, write_servers_file
from tests.integration.chatting import run_queued

# Transactional: the heartbeat thread renews leases on its own connection and must see the rows.
pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Remote:
    config: client.ServerConfig
    state_dir: Path

    def calls(self) -> dict[str, int]:
        return calls(self.state_dir)


def _serve(transport: str, tmp_path: Path, settings) -> Iterator[Remote]:
    state = tmp_path / "state"
    state.mkdir()
    with McpTaskServer(transport=transport, state_dir=state) as server:
        settings.LONGHAUL_MCP_SERVERS = str(write_servers_file(tmp_path / "servers.json", server))
        yield Remote(server, state)


@pytest.fixture(params=["stdio", "http"])
def remote(request, tmp_path, settings) -> Iterator[Remote]:
    yield from _serve(request.param, tmp_path, settings)


@pytest.fixture
def http_remote(tmp_path, settings) -> Iterator[Remote]:
    yield from _serve("http", tmp_path, settings)


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    settings.LONGHAUL_MCP_POLL_FLOOR_MS = 50
    settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS = 0.4


def submit(tenant, user, tool: str, thread: Thread | None = None, **arguments) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="mcp", name=f"{tool} job", thread_id=thread.pk if thread else None,
        input={"server": SERVER_NAME, "tool": tool, "arguments": {"poll_ms": 100, **arguments}}))
    return task


def ended(task: Task) -> bool:
    return task.status in TERMINAL


def follow(task: Task, *, until: Callable[[Task], bool] = ended, timeout: float = 40) -> Task:
    """Run the task as a cluster would, until `until` holds: its steps when each is due, and gateway
    jobs for the MCP calls they request when those are due (all of them before it returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task.refresh_from_db()
        calls_due = operations.due_exists(clock.now())
        if until(task) and not calls_due:
            return task
        if calls_due:
            operations.run_due(run_for=0.1)
        elif task.status in (TaskStatus.RUNNING, TaskStatus.RETRY_WAIT) and task.next_run_at \
                and task.next_run_at <= clock.now():
            jobs.advance(task.pk)
        else:
            time.sleep(0.02)
    raise AssertionError(f"still {task.status} ({task.waiting_reason}) after {timeout} s")


def kinds(task: Task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", flat=True))


def remote_id(task: Task) -> str:
    state = Checkpoint.objects.filter(task=task).order_by("-step").first().state
    return state["remote"]


# --- the happy paths ---------------------------------------------------------------------


def test_a_slow_remote_tool_runs_to_success_with_its_progress(remote, acme, alice):
    task = follow(submit(acme, alice, "slow_report", topic="quarterly sales", seconds=3.0))
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    assert "quarterly sales" in task.result["summary"]
    assert task.result["is_error"] is False and task.result["truncated"] is False
    events = kinds(task)
    assert events.index("remote_started") < events.index("succeeded")
    messages = [e.data.get("message") for e in TaskEvent.objects.filter(task=task, kind="progress")]  # sealed
    assert len(set(messages)) >= 2, messages
    assert remote.calls().get("tools/call:slow_report") == 1, "one submission, however many polls"
    assert remote.calls().get("tasks/get", 0) >= 2


def test_a_tool_that_answers_at_once_ends_the_task_with_that_result(http_remote, acme, alice):
    task = follow(submit(acme, alice, "quick_echo", text="hello there"))
    assert task.status == TaskStatus.SUCCEEDED
    assert "hello there" in task.result["summary"]
    assert "remote_started" not in kinds(task)
    assert http_remote.calls().get("tasks/get", 0) == 0
    assert task.tool_protocol == client.TOOL_PROTOCOL, "the protocol is pinned on the task"
    assert set(Operation.objects.filter(task=task).values_list("version", flat=True)) == {client.TOOL_PROTOCOL}


def test_a_result_over_64_kib_keeps_a_preview_of_the_configured_length_and_a_flag(http_remote, acme, alice, settings):
    settings.LONGHAUL_MCP_RESULT_PREVIEW_CHARS = 100
    task = follow(submit(acme, alice, "slow_report", topic="big", seconds=0.2, size=70_000))
    assert task.status == TaskStatus.SUCCEEDED
    result = task.result
    assert result["result_truncated"] is True and result["truncated"] is True and result["chars"] > 70_000
    assert result["text"] == result["summary"] and len(result["summary"]) == 100
    assert result["structured"] is None


# --- input required -------------------------------------------------------------------------


def test_input_required_is_asked_and_answered_from_the_panel(remote, acme, alice, alice_api):
    task = follow(submit(acme, alice, "approval_job", seconds=0.3),
                  until=lambda t: t.status == TaskStatus.WAITING_INPUT or ended(t))
    assert task.status == TaskStatus.WAITING_INPUT
    assert "Which format" in task.question
    response = alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": "markdown"}, format="json")
    assert response.status_code == 202, response.content
    task = follow(task)
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    assert "report in markdown" in task.result["summary"]
    assert remote.calls().get("tasks/update") == 1
    assert remote.calls().get("tools/call:approval_job") == 1


def test_input_required_is_told_in_the_thread_and_answered_through_the_chat_agent(http_remote, acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="reports")
    task = follow(submit(acme, alice, "approval_job", thread=thread, seconds=0.3),
                  until=lambda t: t.status == TaskStatus.WAITING_INPUT or ended(t))
    run_queued()
    told = list(Message.objects.filter(thread=thread, role="assistant").values_list("content", flat=True))
    assert len(told) == 1 and "Which format" in told[0], told

    from chat import runs
    from chat.models import Run

    runs.start_run(thread, kind=Run.Kind.CHAT, user_text="answer approval_job: pdf", hidden=False, key=None)
    run_queued()
    task.refresh_from_db()
    assert task.status in (TaskStatus.QUEUED, TaskStatus.RUNNING), task.status
    task = follow(task)
    assert task.status == TaskStatus.SUCCEEDED
    assert "report in pdf" in task.result["summary"]
    run_queued()
    done = sum("is done" in m.content for m in Message.objects.filter(thread=thread, role="assistant"))
    assert done == 1


def test_a_tool_done_before_its_handle_came_back_still_delivers_its_result(http_remote, acme, alice):
    task = follow(submit(acme, alice, "slow_report", topic="instant", seconds=0))
    assert task.status == TaskStatus.SUCCEEDED
    assert "instant" in task.result["summary"], task.result


# --- failures ----------------------------------------------------------------------------------


def test_a_remote_failure_fails_the_task_with_its_message(http_remote, acme, alice):
    task = follow(submit(acme, alice, "failing_job", seconds=0.3))
    assert task.status == TaskStatus.FAILED
    assert "render farm rejected the job" in task.error_message


def test_a_tool_level_error_fails_the_task_and_keeps_the_result(http_remote, acme, alice):
    task = follow(submit(acme, alice, "tool_error_job", seconds=0.3))
    assert task.status == TaskStatus.FAILED
    assert "quota exceeded" in task.error_message
    assert task.result["is_error"] is True and "quota exceeded" in task.result["summary"]


def test_a_remote_task_past_its_time_to_live_fails_saying_so(http_remote, acme, alice):
    task = submit(acme, alice, "slow_report", topic="t", seconds=30, ttl_ms=300, poll_ms=1_000)
    task = follow(task, until=lambda t: t.current_step >= 1)  # submitted; the next poll is a second away
    time.sleep(0.5)
    task = follow(task)
    assert task.status == TaskStatus.FAILED
    assert "gone" in task.error_message


def test_a_flaky_server_marks_tracking_degraded_then_recovers(http_remote, acme, alice):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="flaky")
    task = follow(submit(acme, alice, "flaky_job", thread=thread, seconds=2.5, failures=4),
                  until=lambda t: t.tracking_degraded or ended(t))
    assert task.tracking_degraded and task.status == TaskStatus.RUNNING, "flagged while the server fails"
    run_queued()
    told = list(Message.objects.filter(thread=thread, role="assistant").values_list("content", flat=True))
    assert len(told) == 1 and "stopped answering" in told[0], told
    task = follow(task)
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    assert task.tracking_degraded is False, "cleared by the next good poll"
    events = kinds(task)
    assert events.count("tracking_degraded") == 1
    assert events.index("tracking_degraded") < events.index("tracking_restored") < events.index("succeeded")
    degraded_at = TaskEvent.objects.get(task=task, kind="tracking_degraded")
    assert degraded_at.data["errors"] == 3
    run_queued()
    told = list(Message.objects.filter(thread=thread, role="assistant").values_list("content", flat=True))
    assert len(told) == 2 and "is done" in told[1], told


def test_running_out_of_wall_time_stops_the_remote_task_and_fails(http_remote, acme, alice):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="mcp", name="too long", budget={"max_wall_seconds": 1},
        input={"server": SERVER_NAME, "tool": "slow_report",
               "arguments": {"topic": "t", "seconds": 60, "poll_ms": 100}}))
    task = follow(task)
    assert task.status == TaskStatus.FAILED and task.error_class == "budget_exhausted", task.error_message
    assert client.get_task(http_remote.config, remote_id(task)).status == "cancelled", "no work left behind"


def rewrite_servers_file(settings, server: client.ServerConfig | None) -> None:
    """Point the server name elsewhere (or drop it), as an operator editing the file would."""
    path = Path(settings.LONGHAUL_MCP_SERVERS)
    bump = path.stat().st_mtime + 1  # a new version however coarse the file system's clock
    if server is None:
        path.write_text(json.dumps({"servers": {}}))
    else:
        write_servers_file(path, server)
    os.utime(path, (bump, bump))


def test_a_question_asked_during_an_outage_is_told_as_a_question(http_remote, acme, alice, settings):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="outage")
    task = follow(submit(acme, alice, "approval_job", thread=thread, seconds=0.3),
                  until=lambda t: t.current_step >= 1)
    closed_port = client.ServerConfig(name=SERVER_NAME, transport="http", url="http://127.0.0.1:9/mcp")
    rewrite_servers_file(settings, closed_port)
    task = follow(task, until=lambda t: t.tracking_degraded)
    run_queued()
    rewrite_servers_file(settings, http_remote.config)  # back; meanwhile the remote task asked its question
    task = follow(task, until=lambda t: t.status == TaskStatus.WAITING_INPUT)
    assert task.tracking_degraded is False, "a good poll clears the flag, whatever it brings"
    run_queued()
    told = list(Message.objects.filter(thread=thread, role="assistant").order_by("id").values_list("content",
                                                                                                   flat=True))
    assert "stopped answering" in told[0] and "Which format" in told[-1], told


def test_a_cancel_ends_even_when_the_server_was_removed_from_the_configuration(http_remote, acme, alice, settings):
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=60), until=lambda t: t.current_step >= 1)
    rewrite_servers_file(settings, None)
    actions.request_cancel(task, user=alice)
    task = follow(task, timeout=10)
    assert task.status == TaskStatus.CANCELLED
    assert "remote_cancel_unconfirmed" in kinds(task)


def test_a_submission_whose_worker_died_mid_call_is_not_sent_again(http_remote, acme, alice):
    """The ledger says the call started and never finished: MCP cannot tell whether the tool
    started, so the task fails saying so instead of calling it a second time."""
    task = submit(acme, alice, "slow_report", topic="t", seconds=1)
    jobs.advance(task.pk)  # the first step requests the tools/call
    # A gateway job took it and died during the call: its lease ran out.
    Operation.objects.filter(task=task, name="tools/call").update(
        status=OperationStatus.STARTED, lease_owner="gateway-that-died:1", attempts=1, started_at=clock.now(),
        lease_expires_at=clock.now() - timedelta(seconds=1))
    task = follow(task)
    assert task.status == TaskStatus.FAILED
    assert "may or may not have started" in task.error_message
    assert http_remote.calls().get("tools/call:slow_report", 0) == 0


# --- cancel -----------------------------------------------------------------------------------------


def test_cancel_while_polling_cancels_the_remote_task(remote, acme, alice, alice_api):
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=20),
                  until=lambda t: t.current_step >= 2)
    response = alice_api.post(f"/api/tasks/{task.public_id}/cancel", {}, format="json")
    assert response.status_code == 202, response.content
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert remote.calls().get("tasks/cancel") == 1
    assert client.get_task(remote.config, remote_id(task)).status == "cancelled"
    assert "cancelling_remote" in kinds(task)


def test_cancel_while_waiting_for_input_cancels_the_remote_task(http_remote, acme, alice):
    task = follow(submit(acme, alice, "approval_job", seconds=0.3),
                  until=lambda t: t.status == TaskStatus.WAITING_INPUT)
    actions.request_cancel(task, user=alice)
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert client.get_task(http_remote.config, remote_id(task)).status == "cancelled"


def _holding_slots(tenant) -> int:
    return Task.objects.filter(tenant=tenant, status__in=sorted(HOLDS_SLOT)).count()


@pytest.mark.parametrize("stopped", ["waiting_input", "paused"])
def test_a_cancel_that_must_reach_the_remote_waits_for_a_slot_of_its_tenant(http_remote, acme, alice, stopped):
    """Cancelling a task that holds no slot but has remote work running needs a slot to tell the server:
    it queues for one, first in its tenant, and never runs beside a full tenant's tasks."""
    acme.max_running = 1
    acme.save(update_fields=["max_running"])
    task = follow(submit(acme, alice, "approval_job", seconds=0.3),
                  until=lambda t: t.status == TaskStatus.WAITING_INPUT)
    if stopped == "paused":
        task = follow(actions.request_pause(task, user=alice), until=lambda t: t.status == TaskStatus.PAUSED)
    older = submit_sleep(acme, alice, steps=1)  # takes the tenant's one slot
    waiting = submit_sleep(acme, alice, steps=1)  # queued before the cancel
    assert [older.status, waiting.status] == [TaskStatus.RUNNING, TaskStatus.QUEUED]

    task = actions.request_cancel(task, user=alice)
    assert task.status == TaskStatus.QUEUED
    assert _holding_slots(acme) == 1

    actions.request_cancel(older, user=alice)  # frees the slot: the cancel goes before the queued task
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert client.get_task(http_remote.config, remote_id(task)).status == "cancelled"
    waiting.refresh_from_db()
    assert waiting.status == TaskStatus.RUNNING
    assert TaskEvent.objects.filter(task=task, kind="admitted").latest("seq").at \
        < TaskEvent.objects.get(task=waiting, kind="admitted").at


def test_a_server_that_ignores_cancel_still_ends_the_task_cancelled(http_remote, acme, alice, settings):
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 0.6
    task = follow(submit(acme, alice, "stubborn_job", seconds=30), until=lambda t: t.current_step >= 1)
    actions.request_cancel(task, user=alice)
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert "remote_cancel_unconfirmed" in kinds(task)
    assert http_remote.calls().get("tasks/cancel") == 1


@pytest.mark.django_db(transaction=True)
def test_a_poll_answered_after_the_cancel_request_is_discarded(http_remote, acme, alice):
    """The poll is slow and sees the remote task completed; a cancel arrives meanwhile: cancelled wins."""
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=0.4, get_delay_ms=1_500),
                  until=lambda t: t.current_step >= 2)  # submitted, and the first poll requested
    time.sleep(0.5)  # the remote task completes; the next poll will say so, slowly
    poll_due = Operation.objects.get(task=task, name="tasks/get").not_before
    while poll_due > clock.now():
        time.sleep(0.02)

    def poll() -> None:
        try:
            operations.run_due(run_for=0.1)  # the gateway job that runs the poll
        finally:
            connection.close()

    worker = threading.Thread(target=poll)
    worker.start()
    time.sleep(0.5)  # the poll is in flight
    actions.request_cancel(Task.objects.get(pk=task.pk), user=alice)
    worker.join(timeout=30)
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED, task.status
    assert task.result is None, "the completed result seen after the cancel request was not kept"
    assert "succeeded" not in kinds(task)


# --- input and isolation --------------------------------------------------------------------------


def test_bad_input_is_a_400_naming_the_field(http_remote, alice_api):
    cases = [
        ({"server": "nope", "tool": "slow_report"}, "input.server"),
        ({"server": SERVER_NAME}, "input.tool"),
        ({"server": SERVER_NAME, "tool": "slow_report", "arguments": [1]}, "input.arguments"),
        ({"server": SERVER_NAME, "tool": "slow_report", "extra": 1}, "input.extra"),
        ({"server": SERVER_NAME, "tool": "slow_report", "arguments": {"x": "y" * 70_000}}, "input.arguments"),
    ]
    for body, field in cases:
        response = alice_api.post("/api/tasks", {"kind": "mcp", "input": body}, format="json")
        assert response.status_code == 400, (body, response.content)
        assert response.json()["field"] == field, response.json()
    assert not Task.objects.exists()


def test_a_server_configured_for_one_tenant_is_unknown_to_another(http_remote, tmp_path, settings, alice_api,
                                                                   charlie_api):
    settings.LONGHAUL_MCP_SERVERS = str(write_servers_file(tmp_path / "acme-only.json", http_remote.config,
                                                     tenants=["acme"]))
    body = {"kind": "mcp", "input": {"server": SERVER_NAME, "tool": "quick_echo", "arguments": {"text": "x"}}}
    refused = charlie_api.post("/api/tasks", body, format="json")
    assert refused.status_code == 400 and refused.json()["field"] == "input.server"
    assert alice_api.post("/api/tasks", body, format="json").status_code == 201


def test_the_remote_task_id_never_leaves_the_server(http_remote, acme, alice, alice_api):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="leaks")
    task = follow(submit(acme, alice, "approval_job", thread=thread, seconds=0.2),
                  until=lambda t: t.status == TaskStatus.WAITING_INPUT)
    secret = remote_id(task)
    assert len(secret) >= 8
    alice_api.post(f"/api/tasks/{task.public_id}/answer", {"answer": "html"}, format="json")
    task = follow(task)
    run_queued()
    assert task.status == TaskStatus.SUCCEEDED
    bodies = [alice_api.get(path).content.decode() for path in (
        "/api/tasks", f"/api/tasks/{task.public_id}", f"/api/tasks/{task.public_id}/events",
        f"/api/tasks/{task.public_id}/result", f"/api/threads/{thread.public_id}/tasks",
        f"/api/threads/{thread.public_id}/messages")]
    bodies += [json.dumps(e) for e in TaskEvent.objects.filter(task=task).values_list("data", flat=True)]
    bodies += list(Message.objects.filter(thread=thread).values_list("content", flat=True))
    bodies.append(json.dumps(task.result))
    for body in bodies:
        assert secret not in body


def test_a_cancel_in_a_tenant_that_may_run_nothing_reaches_the_remote_at_once(http_remote, acme, alice):
    """A tenant frozen by its admin (max_running 0) would never give the cancel a slot."""
    task = follow(submit(acme, alice, "approval_job", seconds=0.3),
                  until=lambda t: t.status == TaskStatus.WAITING_INPUT)
    acme.max_running = 0
    acme.save(update_fields=["max_running"])
    assert actions.request_cancel(task, user=alice).status == TaskStatus.RUNNING
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert client.get_task(http_remote.config, remote_id(task)).status == "cancelled"


def test_a_cancel_while_the_tools_call_is_still_out_ends_the_task_at_once_and_stops_the_remote_task_once(
        http_remote, acme, alice):
    """Nothing is known of the remote task before the server answers the tools/call: the task ends cancelled at
    once (told in its thread once), and the remote task the call created is stopped once its answer arrives."""
    thread = Thread.objects.create(tenant=acme, owner=alice, title="reports")
    task = submit(acme, alice, "slow_report", thread=thread, topic="t", seconds=60, call_delay_ms=1_500)
    jobs.advance(task.pk)  # asks for the tools/call
    gateway = threading.Thread(target=lambda: (operations.run_due(run_for=1), connection.close()))
    gateway.start()
    deadline = time.monotonic() + 10
    while not Operation.objects.filter(task=task, name="tools/call", status=OperationStatus.STARTED).exists():
        assert time.monotonic() < deadline, "the tools/call never went out"
        time.sleep(0.01)
    cancelled = actions.request_cancel(task, user=alice)
    assert cancelled.status == TaskStatus.CANCELLED, "nothing to tell the server yet: it ends at once"
    gateway.join(20)
    task = follow(cancelled)
    assert http_remote.calls().get("tools/call:slow_report") == 1
    assert http_remote.calls().get("tasks/cancel") == 1, "the remote task its call created is stopped, once"
    assert http_remote.calls().get("tasks/get", 0) == 0, "a cancelled task follows nothing"
    run_queued()
    told = list(Message.objects.filter(thread=thread, role="assistant").values_list("content", flat=True))
    assert sum("was cancelled" in m for m in told) == 1, told


def test_a_cancel_asked_between_the_claim_and_the_wait_for_calls_still_out_is_acted_on_at_once(
        http_remote, acme, alice):
    """Resumed while its poll (an hour away) is still out, the task is claimed only to wait for it again. A cancel
    asked in between finds the lease held and leaves the stop to the holder, which must act on it then: else the
    task would wait for that poll, or the liveness sweep, before its remote task is told to stop."""
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=600, poll_ms=3_600_000),
                  until=lambda t: t.current_step >= 2 and t.waiting_reason == "tool")
    assert Operation.objects.filter(task=task, name="tasks/get", status=OperationStatus.PENDING).exists()
    actions.request_pause(task, user=alice)
    actions.resume(task, user=alice)
    claimed = leases.claim(task.pk, owner="w1", now=clock.now())
    assert claimed is not None
    actions.request_cancel(claimed, user=alice)  # the lease is held: only recorded
    runner.run_step(claimed, turn=runner.Turn("w1", ends=time.monotonic()))
    task.refresh_from_db()
    assert (task.status, task.waiting_reason) == (TaskStatus.RUNNING, "cancel"), "its cancel round is due now"
    task = follow(task, timeout=20)
    assert task.status == TaskStatus.CANCELLED
    assert http_remote.calls().get("tasks/cancel") == 1
