"""Remote MCP tasks at their edges (issue #16): questions, redaction, poll timing, malformed answers, sizes,
handles and cancel attempts, each against the test MCP server over stdio and over streamable HTTP."""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import time_machine

from tasks import actions, clock
from tasks.budgets import Budget
from tasks.drivers.mcp import ALREADY_TRACKED, POLL_CEILING
from tasks.errors import InvalidInput
from tasks.mcp import calls as mcp_calls
from tasks.mcp import client, forms
from tasks.models import Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import ErrorClass, OperationStatus, TaskStatus
from tests.fakes.mcp_task_server import DETAILS_SCHEMA, MALFORMED_KINDS, SERVER_INTERNAL, SERVER_NAME
from tests.integration import test_mcp_tasks as base
from tests.integration.test_mcp_tasks import ended, follow, kinds, remote_id, submit

# The fixtures of the tasks' tests (a server over stdio and over http; fast polls), by name.
remote, http_remote, _fast = base.remote, base.http_remote, base._fast

pytestmark = pytest.mark.django_db(transaction=True)


def asking(task: Task) -> bool:
    return task.status == TaskStatus.WAITING_INPUT or ended(task)


def tracked(task: Task) -> bool:
    """The remote task's handle is stored, and its first poll requested."""
    return task.remote_handle is not None or ended(task)


def watches(task: Task) -> list[Operation]:
    """The task's watch calls (tasks/get while its owner is asked), in the order they were requested."""
    return list(Operation.objects.filter(task=task, key__contains=":w").order_by("id"))


def follow_polls(task: Task, traveller, *, until) -> Task:
    """Follow a task whose server asks for slow polls, moving the clock to each poll when the task waits for it."""
    def later_call(t: Task) -> Operation | None:
        if t.status != TaskStatus.RUNNING or t.next_run_at is not None:
            return None
        return Operation.objects.filter(task=t, status=OperationStatus.PENDING, not_before__gt=clock.now()).first()

    task = follow(task, until=lambda t: until(t) or later_call(t) is not None)
    while not until(task):
        traveller.shift(later_call(task).not_before - clock.now() + timedelta(seconds=1))
        task = follow(task, until=lambda t: until(t) or later_call(t) is not None)
    return task


def polls(task: Task) -> list[Operation]:
    """The task's tasks/get calls that ran, in the order they finished."""
    return list(Operation.objects.filter(task=task, name="tasks/get", finished_at__isnull=False)
                .exclude(key__contains=":w").order_by("finished_at"))


def shown_texts(task: Task) -> list[str]:
    """Every text of the task its owner may see: events, error, question, poll and cancel errors, result."""
    task.refresh_from_db()
    texts = [json.dumps(data) for data in TaskEvent.objects.filter(task=task).values_list("data", flat=True)]
    texts += [task.error_message, task.question, task.remote_poll_error, task.remote_cancel_error,
              json.dumps(task.result)]
    return texts


def internals(server) -> list[str]:
    """What says which server this is: its configured name, URL or command, and the server's own internal
    names, which the servers file lists under `redact`."""
    config = server.config
    words = [SERVER_NAME, config.name, SERVER_INTERNAL]
    words += [config.url] if config.url else [" ".join(config.command), config.command[-1]]
    return words


# --- questions ----------------------------------------------------------------------------------


def test_an_answered_question_is_neither_asked_nor_answered_twice(remote, acme, alice):
    """The server's acknowledgement is eventually consistent: one more poll still lists the answered request."""
    task = follow(submit(acme, alice, "approval_job", seconds=0.3), until=asking)
    assert task.status == TaskStatus.WAITING_INPUT, (task.status, task.error_message)
    actions.answer(task, user=alice, text="markdown")
    task = follow(task, until=asking)
    assert task.status == TaskStatus.SUCCEEDED, (task.status, task.question, task.error_message)
    assert "report in markdown" in task.result["summary"]
    assert kinds(task).count("input_required") == 1
    assert remote.calls().get("tasks/update") == 1
    assert "tasks/update:duplicate" not in remote.calls()


def test_a_question_with_several_fields_is_answered_with_content_that_fits_its_schema(remote, acme, alice):
    task = follow(submit(acme, alice, "ask_many"), until=asking)
    assert task.status == TaskStatus.WAITING_INPUT, (task.status, task.error_message)
    assert task.question_form == forms.keeping_order(DETAILS_SCHEMA), "stored with the order its fields were asked in"
    actions.answer(task, user=alice, data={"action": "accept", "content": {
        "title": "Q3 figures", "copies": "3", "urgent": "yes", "format": "pdf"}})
    task = follow(task, until=asking)
    assert task.status == TaskStatus.SUCCEEDED, (task.status, task.error_message)
    sent = {"copies": 3, "format": "pdf", "title": "Q3 figures", "urgent": True}
    assert task.result["summary"] == "accepted " + json.dumps(sent, sort_keys=True)


def test_declining_a_question_is_an_answer(remote, acme, alice):
    task = follow(submit(acme, alice, "ask_many"), until=asking)
    actions.answer(task, user=alice, data={"action": "decline"})
    task = follow(task, until=asking)
    assert task.status == TaskStatus.SUCCEEDED, (task.status, task.error_message)
    assert task.result["summary"] == "declined"


def test_cancelling_a_question_ends_the_task_cancelled(remote, acme, alice):
    task = follow(submit(acme, alice, "ask_many"), until=asking)
    actions.answer(task, user=alice, data={"action": "cancel"})
    task = follow(task, until=asking)
    assert task.status == TaskStatus.CANCELLED, (task.status, task.error_message)
    assert remote.calls().get("tasks/cancel", 0) == 0, "the server cancelled it itself"


def test_a_server_that_asks_before_it_creates_the_task_is_answered_and_called_again(remote, acme, alice):
    task = follow(submit(acme, alice, "ask_first"), until=asking)
    assert task.status == TaskStatus.WAITING_INPUT, (task.status, task.error_message)
    assert "Really start the job?" in task.question
    actions.answer(task, user=alice, data={"action": "accept", "content": {"confirm": True}})
    task = follow(task, until=asking)
    assert task.status == TaskStatus.SUCCEEDED, (task.status, task.error_message)
    assert task.result["summary"] == "confirmed"
    assert remote.calls().get("tools/call:ask_first") == 2
    assert task.remote_handle, "the task the second call created is tracked"


def test_declining_a_question_asked_before_the_task_exists_ends_with_the_tools_answer(remote, acme, alice):
    task = follow(submit(acme, alice, "ask_first"), until=asking)
    actions.answer(task, user=alice, data={"action": "decline"})
    task = follow(task, until=asking)
    assert task.status == TaskStatus.FAILED, task.status
    assert "not confirmed" in task.error_message
    assert remote.calls().get("tasks/cancel", 0) == 0, "no remote task was ever created"


def test_cancelling_while_a_question_asked_before_the_task_exists_waits_sends_no_remote_cancel(remote, acme, alice):
    task = follow(submit(acme, alice, "ask_first"), until=asking)
    assert task.status == TaskStatus.WAITING_INPUT
    actions.request_cancel(task, user=alice)
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert remote.calls().get("tools/call:ask_first") == 1 and remote.calls().get("tasks/cancel", 0) == 0


def test_a_remote_task_that_moves_on_while_its_question_waits_withdraws_the_question(remote, acme, alice):
    task = follow(submit(acme, alice, "approval_job", seconds=0.3), until=asking)
    assert task.status == TaskStatus.WAITING_INPUT
    client.cancel_task(remote.config, remote_id(task))  # someone cancels it on the server's side
    watch = Operation.objects.get(task=task, key__contains=":w")
    assert watch.not_before >= clock.now() + timedelta(seconds=50), "a slow poll while the owner thinks"
    with time_machine.travel(watch.not_before + timedelta(seconds=1), tick=True):
        task = follow(task)
    assert task.status == TaskStatus.CANCELLED, (task.status, task.error_message)
    assert task.question == ""
    events = kinds(task)
    assert events.index("input_required") < events.index("question_withdrawn") < events.index("cancelled")


def test_a_question_survives_a_pause_and_is_asked_again_without_a_poll_error(remote, acme, alice):
    """A pause closes the pending watch ("cancelled"): that says nothing of the remote task, so the question
    is asked again as it was, no poll error stored and none counted."""
    task = follow(submit(acme, alice, "approval_job", seconds=0.3), until=asking)
    assert task.status == TaskStatus.WAITING_INPUT
    polled = len(polls(task))
    task = follow(actions.request_pause(task, user=alice), until=lambda t: t.status == TaskStatus.PAUSED)
    watch, = watches(task)
    assert (watch.status, watch.error_class) == (OperationStatus.FAILED, "cancelled")
    task = follow(actions.resume(task, user=alice), until=lambda t: asking(t) and t.current_step > task.current_step)
    assert task.status == TaskStatus.WAITING_INPUT, (task.status, task.error_message)
    assert task.remote_poll_error == "" and not task.tracking_degraded
    assert len(polls(task)) == polled, "asked again at once: no poll in between"
    state = Checkpoint.objects.filter(task=task).order_by("-step").first().state
    assert state["errors"] == 0 and state["asking"] is not None
    actions.answer(task, user=alice, text="markdown")
    assert follow(task).status == TaskStatus.SUCCEEDED


def test_a_watch_follows_a_server_interval_longer_than_a_minute(remote, acme, alice):
    task = submit(acme, alice, "approval_job", seconds=0.3, poll_ms=120_000)
    with time_machine.travel(clock.now(), tick=True) as traveller:
        task = follow_polls(task, traveller, until=asking)
        assert task.status == TaskStatus.WAITING_INPUT, (task.status, task.error_message)
        first, = watches(task)
        assert first.not_before - first.created_at > timedelta(seconds=110), "the first watch already waits so long"
        traveller.shift(first.not_before - clock.now() + timedelta(seconds=1))
        task = follow(task, until=lambda t: len(watches(t)) == 2 or ended(t))
        done, again = watches(task)
        assert task.status == TaskStatus.WAITING_INPUT and again.status == OperationStatus.PENDING
        assert again.not_before >= done.finished_at + timedelta(seconds=120), "not sooner than the server asks"
        actions.request_cancel(task, user=alice)
        assert follow(task).status == TaskStatus.CANCELLED


# --- redaction ------------------------------------------------------------------------------------


def test_the_remote_id_and_the_servers_internals_are_redacted_from_every_text_shown(remote, acme, alice):
    task = follow(submit(acme, alice, "chatty_job", seconds=0.6))
    assert task.status == TaskStatus.FAILED
    handle = remote_id(task)
    assert "crashed on" in task.error_message, task.error_message
    progress = [e.data.get("message") for e in TaskEvent.objects.filter(task=task, kind="progress")]  # sealed
    assert progress and all("step" in message for message in progress), progress
    for text in shown_texts(task):
        assert handle not in text
        for word in internals(remote):
            assert word not in text, (word, text)


def test_a_poll_error_is_kept_redacted_while_tracking_is_degraded_and_cleared_by_a_good_poll(remote, acme, alice):
    task = follow(submit(acme, alice, "flaky_job", seconds=2.5, failures=4),
                  until=lambda t: t.tracking_degraded or ended(t))
    assert task.tracking_degraded
    assert "temporarily unavailable" in task.remote_poll_error, task.remote_poll_error
    assert len(task.remote_poll_error) <= 4_000
    for word in [remote_id(task), *internals(remote)]:
        assert word not in task.remote_poll_error
    task = follow(task)
    assert task.status == TaskStatus.SUCCEEDED, (task.status, task.error_message)
    assert task.remote_poll_error == "" and task.tracking_degraded is False


# --- poll timing ------------------------------------------------------------------------------------


def test_the_next_poll_is_due_at_the_servers_interval_from_the_last_calls_completion(remote, acme, alice):
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=120, poll_ms=60_000), until=tracked)
    submitted = Operation.objects.get(task=task, name="tools/call")
    poll = Operation.objects.get(task=task, name="tasks/get")
    assert poll.not_before == submitted.finished_at + timedelta(seconds=60), "not capped at 30 s"
    actions.request_cancel(task, user=alice)
    assert follow(task).status == TaskStatus.CANCELLED


def test_polls_follow_a_short_interval_from_each_polls_completion(remote, acme, alice):
    # 2 s of remote work: at least 3 polls even when a poll, its step and the next claim take 600 ms on a busy
    # machine (1 s left room for 2 there).
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=2.0, poll_ms=150))
    assert task.status == TaskStatus.SUCCEEDED
    done = polls(task)
    assert len(done) >= 3
    for before, after in itertools.pairwise(done):
        assert after.not_before == before.finished_at + timedelta(milliseconds=150), (before.key, after.key)


def test_no_poll_is_due_after_the_tasks_deadline(remote, acme, alice):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="mcp", name="long intervals", budget={"max_wall_seconds": 5},
        input={"server": SERVER_NAME, "tool": "slow_report",
               "arguments": {"topic": "t", "seconds": 600, "poll_ms": 86_400_000}}))
    task = follow(task, until=tracked)
    deadline = task.started_at + timedelta(seconds=5)
    assert Operation.objects.get(task=task, name="tasks/get").not_before == deadline
    task = follow(task, timeout=20)
    assert task.status == TaskStatus.FAILED and task.error_class == ErrorClass.BUDGET_EXHAUSTED
    assert remote.calls().get("tasks/cancel") == 1


def test_a_huge_finite_poll_interval_is_clamped_to_a_day(remote, acme, alice):
    task = follow(submit(acme, alice, "slow_report", topic="t", seconds=600, poll_ms=10**17), until=tracked)
    assert task.status == TaskStatus.RUNNING, (task.status, task.error_message)
    submitted = Operation.objects.get(task=task, name="tools/call")
    deadline = task.started_at + timedelta(seconds=Budget.of(task.budget).max_wall_seconds)
    poll = Operation.objects.get(task=task, name="tasks/get")
    assert poll.not_before == min(submitted.finished_at + POLL_CEILING, deadline)
    actions.request_cancel(task, user=alice)
    assert follow(task).status == TaskStatus.CANCELLED


def test_poll_errors_back_off_from_each_failures_completion(remote, acme, alice, settings):
    task = follow(submit(acme, alice, "flaky_job", seconds=2.0, failures=4, poll_ms=100))
    assert task.status == TaskStatus.SUCCEEDED, (task.status, task.error_message)
    done = polls(task)
    failed = 0
    for before, after in itertools.pairwise(done):
        if before.status == OperationStatus.FAILED:
            failed += 1
            delay = min(0.1 * 2 ** (failed - 1), settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS)
            assert after.not_before == before.finished_at + timedelta(seconds=delay), (failed, before.key)
        else:
            failed = 0
    assert sum(op.status == OperationStatus.FAILED for op in done) == 4


# --- malformed answers and sizes --------------------------------------------------------------------


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_a_malformed_answer_fails_the_task_at_once_with_a_protocol_error(remote, acme, alice, kind):
    task = follow(submit(acme, alice, "malformed_job", kind=kind, after_s=0.3), timeout=20)
    assert task.status == TaskStatus.FAILED, task.status
    assert task.error_class == ErrorClass.PERMANENT
    assert "protocol error" in task.error_message, task.error_message
    answered = [op for op in polls(task) if op.status == OperationStatus.SUCCEEDED]
    assert sum("protocol_error" in op.result for op in answered) == 1, "no retry loop"
    assert not any(op.status == OperationStatus.FAILED for op in polls(task))


def test_a_result_over_64_kib_keeps_only_a_preview(remote, acme, alice):
    task = follow(submit(acme, alice, "slow_report", topic="big", seconds=0.2, size=70_000))
    assert task.status == TaskStatus.SUCCEEDED
    assert task.result["result_truncated"] is True
    assert task.result["summary"].startswith("Report on big")
    assert len(task.result["summary"]) == 2_000 and len(task.result["text"]) == 2_000
    stored = [json.dumps(r) for r in Operation.objects.filter(task=task).values_list("result", flat=True)]
    assert all(len(s) < 64 * 1024 for s in stored), "the whole result is stored nowhere"


def test_a_result_under_64_kib_is_kept_whole(http_remote, acme, alice):
    task = follow(submit(acme, alice, "slow_report", topic="big", seconds=0.2, size=60_000))
    assert task.status == TaskStatus.SUCCEEDED
    assert task.result["result_truncated"] is False
    assert len(task.result["text"]) > 60_000


def test_a_question_over_64_kib_fails_the_task_without_storing_it(remote, acme, alice):
    task = follow(submit(acme, alice, "big_question", size=70_000), until=asking)
    assert task.status == TaskStatus.FAILED, task.status
    assert "protocol error" in task.error_message and "64 KiB" in task.error_message
    assert task.question == ""
    assert "Tell me everything" not in json.dumps(list(Operation.objects.filter(task=task).values_list("result",
                                                                                                     flat=True)))


# --- handles ----------------------------------------------------------------------------------------


def test_a_handle_longer_than_255_characters_fails_the_task_and_is_cancelled_once(remote, acme, alice):
    task = follow(submit(acme, alice, "handle_job", task_id="h" * 300, seconds=5))
    assert task.status == TaskStatus.FAILED
    assert "protocol error" in task.error_message and "255" in task.error_message
    assert "h" * 300 not in task.error_message
    assert remote.calls().get("tasks/cancel") == 1
    assert task.remote_handle is None


def test_a_handle_the_owner_already_tracks_is_refused_and_the_first_task_goes_on(remote, acme, alice, bob):
    first = follow(submit(acme, alice, "handle_job", task_id="shared-job-1", seconds=1.5), until=tracked)
    second = follow(submit(acme, alice, "handle_job", task_id="shared-job-1", seconds=1.5))
    assert second.status == TaskStatus.FAILED
    assert ALREADY_TRACKED in second.error_message
    assert remote.calls().get("tasks/cancel", 0) == 0, "the first task's remote work is not cancelled"
    first = follow(first)
    assert first.status == TaskStatus.SUCCEEDED, (first.status, first.error_message)
    other = follow(submit(acme, bob, "handle_job", task_id="shared-job-1", seconds=1.5))
    assert other.status == TaskStatus.SUCCEEDED, "another owner may track the same handle"
    assert remote.calls().get("tasks/cancel", 0) == 0


def test_a_handle_tracked_by_a_task_that_ended_may_be_tracked_again(remote, acme, alice):
    """Servers that reuse ids: only a task still active holds its handle."""
    first = follow(submit(acme, alice, "handle_job", task_id="reused-job-1", seconds=0.3))
    assert first.status == TaskStatus.SUCCEEDED, (first.status, first.error_message)
    second = follow(submit(acme, alice, "handle_job", task_id="reused-job-1", seconds=0.3))
    assert second.status == TaskStatus.SUCCEEDED, (second.status, second.error_message)
    assert first.remote_handle == second.remote_handle == "reused-job-1"


# --- cancelling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["failing_job", "tool_error_job"])
def test_no_cancel_is_sent_to_a_remote_task_that_already_stopped(remote, acme, alice, tool):
    task = follow(submit(acme, alice, tool, seconds=0.3))
    assert task.status == TaskStatus.FAILED
    assert remote.calls().get("tasks/cancel", 0) == 0


def test_failed_cancel_attempts_are_counted_and_retried(remote, acme, alice, settings):
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 1.5
    task = follow(submit(acme, alice, "stubborn_job", seconds=30, cancel_failures=2), until=tracked)
    actions.request_cancel(task, user=alice)
    task = follow(task, until=lambda t: t.remote_cancel_attempts >= 2 or ended(t))
    assert task.remote_cancel_attempts == 2 and "did not answer" in task.remote_cancel_error, \
        (task.remote_cancel_attempts, task.remote_cancel_error)
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert remote.calls().get("tasks/cancel") == 3
    assert task.remote_cancel_attempts == 3 and task.remote_cancel_error == ""
    sent = TaskEvent.objects.get(task=task, kind="remote_cancel_sent")
    assert sent.data["attempts"] == 3
    unconfirmed = TaskEvent.objects.get(task=task, kind="remote_cancel_unconfirmed")
    assert unconfirmed.data["attempts"] == 3 and "3 attempts" in unconfirmed.data["message"]


def test_a_cancel_the_server_never_accepts_ends_unconfirmed_saying_how_often_it_was_tried(remote, acme, alice,
                                                                                            settings):
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 0.8
    task = follow(submit(acme, alice, "stubborn_job", seconds=30, cancel_failures=1_000), until=tracked)
    actions.request_cancel(task, user=alice)
    task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    tried = remote.calls().get("tasks/cancel")
    assert tried >= 2 and task.remote_cancel_attempts == tried
    unconfirmed = TaskEvent.objects.get(task=task, kind="remote_cancel_unconfirmed")
    assert unconfirmed.data["attempts"] == tried
    for word in [remote_id(task), *internals(remote)]:
        assert word not in task.remote_cancel_error
    started = Checkpoint.objects.filter(task=task).order_by("-step").first().state["cancel_started"]
    window_ends = datetime.fromisoformat(started) + timedelta(seconds=0.8)
    cancels = list(Operation.objects.filter(task=task, name="tasks/cancel").order_by("finished_at"))
    for failed, (before, after) in enumerate(itertools.pairwise(cancels), start=1):
        delay = min(0.1 * 2 ** (failed - 1), settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS)
        assert after.not_before == min(before.finished_at + timedelta(seconds=delay), window_ends), \
            "backs off from the failure, within the window"


def test_confirming_polls_never_outlast_the_cancel_window(remote, acme, alice, settings):
    """A server asking to be polled hourly: the polls that wait for the cancel to show still end in time."""
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 60
    task = follow(submit(acme, alice, "stubborn_job", seconds=7200, poll_ms=3_600_000), until=tracked)
    actions.request_cancel(task, user=alice)
    confirming = Operation.objects.filter(task=task, name="tasks/get", created_at__gte=task.created_at)
    task = follow(task, until=lambda t: ended(t) or confirming.filter(
        status=OperationStatus.PENDING, not_before__isnull=False, created_at__gte=t.cancel_requested_at).exists())
    assert task.remote_cancel_attempts == 1 and remote.calls().get("tasks/cancel") == 1
    started = Checkpoint.objects.filter(task=task).order_by("-step").first().state["cancel_started"]
    window_ends = datetime.fromisoformat(started) + timedelta(seconds=60)
    last = confirming.filter(status=OperationStatus.PENDING, created_at__gte=task.cancel_requested_at).latest("id")
    assert last.not_before <= window_ends, (last.not_before, window_ends)
    with time_machine.travel(last.not_before + timedelta(seconds=1), tick=True):
        task = follow(task)
    assert task.status == TaskStatus.CANCELLED
    assert TaskEvent.objects.filter(task=task, kind="remote_cancel_unconfirmed").exists()


def test_failed_cancel_attempts_do_not_flag_tracking_degraded(remote, acme, alice, settings):
    settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS = 60
    task = follow(submit(acme, alice, "stubborn_job", seconds=30, cancel_failures=1_000), until=tracked)
    actions.request_cancel(task, user=alice)
    task = follow(task, until=lambda t: t.remote_cancel_attempts >= 4 or ended(t))
    assert task.remote_cancel_attempts >= 4 and "did not answer" in task.remote_cancel_error
    assert not task.tracking_degraded
    assert "tracking_degraded" not in kinds(task)
    with time_machine.travel(clock.now() + timedelta(seconds=61), tick=True):
        task = follow(task)
    assert task.status == TaskStatus.CANCELLED and not task.tracking_degraded
    assert "tracking_degraded" not in kinds(task)


# --- input ------------------------------------------------------------------------------------------


@pytest.fixture
def titled(http_remote, settings):
    """The test server, shown to users as "Tool Works"."""
    path = Path(settings.LONGHAUL_MCP_SERVERS)
    servers = json.loads(path.read_text())
    servers["servers"][SERVER_NAME]["title"] = "Tool Works"
    path.write_text(json.dumps(servers))
    return http_remote


@pytest.mark.parametrize("typed", ["Tool Works", "tool works", SERVER_NAME])
def test_a_server_is_named_by_its_title_or_its_configured_name_and_stored_by_its_name(titled, acme, alice, typed):
    task, _ = actions.submit(tenant=acme, user=alice, submission=actions.Submission(
        kind="mcp", name="by title", input={"server": typed, "tool": "quick_echo", "arguments": {"text": "hi"}}))
    assert task.input["server"] == SERVER_NAME
    assert follow(task).status == TaskStatus.SUCCEEDED


def test_an_unknown_server_is_refused_naming_only_titles(titled, acme, alice):
    with pytest.raises(InvalidInput) as refused:
        actions.submit(tenant=acme, user=alice, submission=actions.Submission(
            kind="mcp", name="nope", input={"server": "nope", "tool": "quick_echo", "arguments": {}}))
    assert "Tool Works" in str(refused.value)
    assert SERVER_NAME not in str(refused.value).replace("Tool Works", "")


def test_redaction_leaves_other_words_alone():
    """Only whole tokens go: a server named "tools" leaves "toolset" and "my-tools-2" as they are."""
    text = mcp_calls.redact("tools: toolset, my-tools-2, abc12345 and xabc12345", handle="abc12345", server="tools")
    assert text == "[server]: toolset, my-tools-2, [remote task] and xabc12345"
