"""The MCP Tasks client against a real fake server: real processes over stdio pipes and loopback HTTP.

Calls share one session per server and process (for stdio, one server process), opened on first
use; `McpTaskServer` closes this process's sessions when it exits, so every test starts afresh.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from tasks.mcp import config, forms, sessions
from tasks.mcp.client import (
    Completed,
    Created,
    InputNeeded,
    MalformedAnswer,
    NotSent,
    RemoteProtocolError,
    RemoteTask,
    RemoteTaskNotFound,
    RemoteUnavailable,
    ServerConfig,
    ToolNotFound,
    call_tool,
    call_tool_async,
    cancel_task,
    get_task,
    get_task_async,
    list_tools,
    update_task,
)
from tests.fakes import LoopbackServer, QuietHandler
from tests.fakes.mcp_task_server import DETAILS_SCHEMA, SERVER_INTERNAL, McpTaskServer, calls
from tests.fakes.mcp_task_server import started as processes_started

TERMINAL = {"completed", "failed", "cancelled"}


@dataclass(frozen=True)
class Remote:
    config: ServerConfig
    state_dir: Path
    # How long a task must run to be seen working by the next call.
    slow: float
    calls_before: dict[str, int]

    def submit(self, tool: str, arguments: dict[str, Any]) -> RemoteTask:
        answer = call_tool(self.config, tool, arguments)
        assert isinstance(answer, Created), answer
        return answer.task

    def poll(self, task_id: str, *, until: set[str], timeout: float = 20.0) -> list[RemoteTask]:
        """Every status seen, polling at the server's interval until one of `until` (or failing)."""
        deadline = time.monotonic() + timeout
        seen: list[RemoteTask] = []
        while not seen or seen[-1].status not in until:
            assert time.monotonic() < deadline, f"still {seen[-1].status} after {timeout} s"
            if seen:
                time.sleep((seen[-1].poll_interval_ms or 200) / 1000)
            seen.append(get_task(self.config, task_id))
        return seen

    def calls(self) -> dict[str, int]:
        """The requests the server counted during this test."""
        now = calls(self.state_dir)
        return {key: count - self.calls_before.get(key, 0) for key, count in now.items()
                if count > self.calls_before.get(key, 0)}


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerConfig, Path]]:
    # One server process for the module: starting one costs about a second.
    state_dir = tmp_path_factory.mktemp("mcp-http")
    with McpTaskServer("http", state_dir=state_dir) as config:
        yield config, state_dir


@pytest.fixture(params=["stdio", "http"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    if request.param == "http":
        config, state_dir = request.getfixturevalue("http_server")
        yield Remote(config=config, state_dir=state_dir, slow=1.0, calls_before=calls(state_dir))
        sessions.close_all()
        return
    # The first call starts the server process, which reads and writes the tasks in tmp_path.
    with McpTaskServer("stdio", state_dir=tmp_path) as config:
        yield Remote(config=config, state_dir=tmp_path, slow=1.0, calls_before={})


@pytest.fixture
def stdio_remote(tmp_path: Path) -> Iterator[Remote]:
    with McpTaskServer("stdio", state_dir=tmp_path) as config:
        yield Remote(config=config, state_dir=tmp_path, slow=1.0, calls_before={})


def test_it_returns_a_plain_result_without_a_task(remote: Remote) -> None:
    answer = call_tool(remote.config, "quick_echo", {"text": "hello"})

    assert isinstance(answer, Completed)
    assert answer.result.text == "echo: hello"
    assert answer.result.content == [{"type": "text", "text": "echo: hello"}]
    assert answer.result.is_error is False
    assert remote.calls()["tools/call:quick_echo"] == 1
    assert "tasks/get" not in remote.calls()


def test_it_polls_a_created_task_to_completed_with_changing_progress(remote: Remote) -> None:
    task = remote.submit("slow_report", {"topic": "tides", "seconds": remote.slow, "size": 300_000, "poll_ms": 100,
                                         "ttl_ms": 60_000})
    assert (task.status, task.status_message) == ("working", "step 1 of 4")
    assert (task.poll_interval_ms, task.ttl_ms) == (100, 60_000)

    seen = remote.poll(task.task_id, until=TERMINAL)

    final = seen[-1]
    assert final.status == "completed"
    assert final.result is not None and final.result.text.startswith("Report on tides")
    assert final.result.text.endswith("\n" + "x" * 300_000)  # a large result comes back whole
    assert final.result.is_error is False and final.error is None
    progress = [task.status_message] + [t.status_message for t in seen if t.status == "working"]
    assert len(set(progress)) >= 2, progress
    # One submission is one tools/call, however often it is polled.
    assert remote.calls() == {"tools/call:slow_report": 1, "tasks/get": len(seen)}


def test_it_reports_a_failed_task_with_its_error(remote: Remote) -> None:
    task = remote.submit("failing_job", {"seconds": 0.2})

    final = remote.poll(task.task_id, until=TERMINAL)[-1]

    assert final.status == "failed"
    assert final.error == "the render farm rejected the job"
    assert final.result is None
    assert remote.calls()["tools/call:failing_job"] == 1


def test_it_reports_a_tool_error_as_a_completed_task(remote: Remote) -> None:
    task = remote.submit("tool_error_job", {"seconds": 0.2})

    final = remote.poll(task.task_id, until=TERMINAL)[-1]

    assert final.status == "completed"
    assert final.result is not None and final.result.is_error is True
    assert final.result.text == "quota exceeded for this month"
    assert final.error is None


def test_it_forwards_an_answer_when_the_task_needs_input(remote: Remote) -> None:
    task = remote.submit("approval_job", {"seconds": 0.2})

    waiting = remote.poll(task.task_id, until={"input_required", *TERMINAL})[-1]
    assert waiting.status == "input_required"
    (question,) = waiting.input_requests
    assert (question.method, question.message) == ("elicitation/create", "Which format should the report use?")
    assert question.schema is not None and question.schema["required"] == ["format"]

    update_task(remote.config, task.task_id, {question.key: forms.response(question.schema, "pdf")})
    final = remote.poll(task.task_id, until=TERMINAL)[-1]

    assert final.status == "completed"
    assert final.result is not None and final.result.text == "report in pdf"
    assert remote.calls()["tasks/update"] == 1
    assert remote.calls()["tools/call:approval_job"] == 1


def test_it_cancels_a_task(remote: Remote) -> None:
    task = remote.submit("slow_report", {"topic": "tides", "seconds": 30})

    cancel_task(remote.config, task.task_id)
    final = remote.poll(task.task_id, until=TERMINAL)[-1]

    assert final.status == "cancelled"
    assert final.result is None
    assert remote.calls()["tasks/cancel"] == 1


def test_it_sees_a_stubborn_task_complete_despite_the_cancel(remote: Remote) -> None:
    task = remote.submit("stubborn_job", {"seconds": remote.slow})

    cancel_task(remote.config, task.task_id)
    seen = remote.poll(task.task_id, until=TERMINAL)

    assert [t.status for t in seen if t.status != "working"] == ["completed"]
    # The server says so only when the cancel reached it before the work finished.
    assert seen[-1].status_message == "done (a cancel request was ignored)"
    assert remote.calls()["tasks/cancel"] == 1


def test_it_raises_unavailable_while_the_server_flakes_then_recovers(remote: Remote) -> None:
    task = remote.submit("flaky_job", {"seconds": 0.3, "failures": 2})
    assert get_task(remote.config, task.task_id).task_id == task.task_id

    for _ in range(2):  # the server fails exactly this many reads after the first
        with pytest.raises(RemoteUnavailable, match="fake-"):
            get_task(remote.config, task.task_id)
    time.sleep(0.3)
    recovered = get_task(remote.config, task.task_id)

    assert recovered.status == "completed"
    assert remote.calls()["tasks/get"] == 4


def test_it_raises_not_found_for_an_unknown_task_id(remote: Remote) -> None:
    with pytest.raises(RemoteTaskNotFound, match="not found"):
        get_task(remote.config, "0" * 32)


def test_it_raises_not_found_once_the_ttl_has_passed(remote: Remote) -> None:
    ttl_s = remote.slow
    task = remote.submit("slow_report", {"topic": "tides", "seconds": 60, "ttl_ms": int(ttl_s * 1000)})
    submitted = time.monotonic()
    assert get_task(remote.config, task.task_id).status == "working"

    time.sleep(max(0.0, submitted + ttl_s + 0.2 - time.monotonic()))

    with pytest.raises(RemoteTaskNotFound, match="expired"):
        get_task(remote.config, task.task_id)


def test_it_raises_tool_not_found_for_an_unknown_tool(remote: Remote) -> None:
    with pytest.raises(ToolNotFound, match="no_such_tool"):
        call_tool(remote.config, "no_such_tool", {})
    assert remote.calls() == {"tools/call:no_such_tool": 1}


def test_it_lists_the_tools_with_their_schemas(remote: Remote) -> None:
    tools = {tool["name"]: tool for tool in list_tools(remote.config)}

    assert {"slow_report", "approval_job", "quick_echo"} <= set(tools)
    assert tools["slow_report"]["description"] == "Write a report on a topic, slowly (a task)."
    assert tools["slow_report"]["inputSchema"]["required"] == ["topic"]


def test_it_raises_unavailable_when_nothing_listens_on_the_port() -> None:
    server = ServerConfig(name="reports", transport="http", url="http://127.0.0.1:9/mcp",
                          headers={"Authorization": "Bearer s3cret-value"}, timeout_s=5)

    with pytest.raises(RemoteUnavailable) as raised:
        get_task(server, "0" * 32)

    assert "reports" in str(raised.value)
    assert "s3cret" not in str(raised.value)


class _StatusHandler(QuietHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.owner.status)
        self.send_header("Content-Length", "0")
        self.end_headers()


class StatusEndpoint(LoopbackServer):
    """An HTTP endpoint that answers every POST with one status and no body."""

    handler_class = _StatusHandler

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status


@pytest.mark.parametrize(("status", "error"), [(503, RemoteUnavailable), (429, RemoteUnavailable),
                                               (401, RemoteProtocolError)])
def test_it_classifies_http_error_statuses(status: int, error: type[Exception]) -> None:
    with StatusEndpoint(status) as endpoint:
        server = ServerConfig(name="reports", transport="http", url=f"{endpoint.url}/mcp", timeout_s=5)

        with pytest.raises(error, match=f"HTTP {status}"):
            get_task(server, "0" * 32)


def test_it_raises_unavailable_when_the_stdio_server_exits_at_once() -> None:
    server = ServerConfig(name="render", transport="stdio", command=(sys.executable, "-c", "raise SystemExit(3)"))

    with pytest.raises(RemoteUnavailable, match="render"):
        call_tool(server, "slow_report", {"topic": "tides"})


def test_it_raises_unavailable_when_the_server_does_not_answer_in_time() -> None:
    # Reads its stdin to the end and never writes: alive, silent, and gone once the client hangs up.
    silent = ServerConfig(name="mute", transport="stdio", timeout_s=0.5,
                          command=(sys.executable, "-c", "import sys; sys.stdin.read()"))
    started = time.monotonic()

    with pytest.raises(RemoteUnavailable, match="mute"):
        get_task(silent, "0" * 32)

    assert time.monotonic() - started < 5



# --- questions ---------------------------------------------------------------------------------


def test_it_declares_elicitation_so_a_strict_server_lets_a_tool_ask(remote: Remote) -> None:
    # The fake refuses (-32021) a tool that will ask unless the request declares elicitation.
    for tool in ("approval_job", "ask_many"):
        assert remote.submit(tool, {}).status == "working"

    assert remote.calls() == {"tools/call:approval_job": 1, "tools/call:ask_many": 1}


def test_it_answers_a_form_with_several_typed_fields(remote: Remote) -> None:
    task = remote.submit("ask_many", {"seconds": 0.2})
    waiting = remote.poll(task.task_id, until={"input_required", *TERMINAL})[-1]
    (question,) = waiting.input_requests
    assert (question.key, question.schema) == ("details", DETAILS_SCHEMA)
    answer = {"action": "accept", "content": {"title": "Q3", "copies": "2", "urgent": "true", "format": "pdf"}}

    update_task(remote.config, task.task_id, {question.key: forms.response(question.schema, answer)})
    final = remote.poll(task.task_id, until=TERMINAL)[-1]

    assert final.status == "completed"
    assert final.result is not None
    assert final.result.text == "accepted " + json.dumps({"copies": 2, "format": "pdf", "title": "Q3", "urgent": True},
                                                         sort_keys=True)


def test_the_first_poll_after_an_answer_may_still_show_the_question(remote: Remote) -> None:
    task = remote.submit("ask_many", {"seconds": 30})
    (question,) = remote.poll(task.task_id, until={"input_required", *TERMINAL})[-1].input_requests
    response = forms.response(question.schema, {"action": "decline"})

    update_task(remote.config, task.task_id, {question.key: response})
    stale, fresh = get_task(remote.config, task.task_id), get_task(remote.config, task.task_id)
    update_task(remote.config, task.task_id, {question.key: response})  # what a client that does not dedupe does

    assert [q.key for q in stale.input_requests] == ["details"]
    assert (fresh.status, fresh.input_requests) == ("working", ())
    assert remote.calls()["tasks/update"] == 2
    assert remote.calls()["tasks/update:duplicate"] == 1


@pytest.mark.parametrize(("action", "status", "text"), [("decline", "completed", "declined"),
                                                        ("cancel", "cancelled", None)])
def test_decline_and_cancel_are_answers_too(remote: Remote, action: str, status: str, text: str | None) -> None:
    task = remote.submit("ask_many", {"seconds": 0.2})
    (question,) = remote.poll(task.task_id, until={"input_required", *TERMINAL})[-1].input_requests

    update_task(remote.config, task.task_id, {question.key: forms.response(question.schema, {"action": action})})
    final = remote.poll(task.task_id, until=TERMINAL)[-1]

    assert final.status == status
    assert (final.result.text if final.result else None) == text


def test_it_returns_the_questions_a_tool_asks_before_it_starts(remote: Remote) -> None:
    asked = call_tool(remote.config, "ask_first", {})
    assert isinstance(asked, InputNeeded)
    (question,) = asked.requests
    assert (question.key, question.method) == ("confirm", "elicitation/create")
    assert forms.fields(question.schema)[0].type == "boolean"
    assert asked.request_state

    answer = forms.response(question.schema, {"action": "accept", "content": {"confirm": True}})
    created = call_tool(remote.config, "ask_first", {}, input_responses={question.key: answer},
                        request_state=asked.request_state)

    assert isinstance(created, Created)
    final = remote.poll(created.task.task_id, until=TERMINAL)[-1]
    assert final.status == "completed" and final.result is not None and final.result.text == "confirmed"
    assert remote.calls() == {"tools/call:ask_first": 2, "tasks/get": remote.calls()["tasks/get"]}


def test_a_tool_that_asked_first_answers_a_declined_question_with_a_tool_error(remote: Remote) -> None:
    asked = call_tool(remote.config, "ask_first", {})
    assert isinstance(asked, InputNeeded)

    answer = call_tool(remote.config, "ask_first", {}, input_responses={"confirm": {"action": "decline"}},
                       request_state=asked.request_state)

    assert isinstance(answer, Completed) and answer.result.is_error is True
    assert "not confirmed" in answer.result.text


def test_a_question_can_be_huge(remote: Remote) -> None:
    task = remote.submit("big_question", {"size": 70_000})

    (question,) = remote.poll(task.task_id, until={"input_required", *TERMINAL})[-1].input_requests

    assert len(question.message) == 70_000


# --- malformed answers ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unknown_status", "nan", "huge", "wrong_type", "invalid_json"])
def test_it_raises_malformed_answer_for_a_status_that_breaks_the_protocol(remote: Remote, kind: str) -> None:
    task = remote.submit("malformed_job", {"kind": kind, "after_s": 0.05})
    time.sleep(0.1)  # the fake answers malformed once after_s has passed on its clock

    with pytest.raises(MalformedAnswer, match="malformed answer"):
        get_task(remote.config, task.task_id)

    # The session is still usable (or was replaced): the next request is answered.
    assert get_task(remote.config, remote.submit("slow_report", {"topic": "x"}).task_id).status == "working"


def test_malformed_answers_are_protocol_errors() -> None:
    assert issubclass(MalformedAnswer, RemoteProtocolError)


def until(condition: Any, *, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.01)


def test_an_unreadable_answer_cuts_the_other_calls_off_as_unavailable_and_the_session_is_replaced(
        stdio_remote: Remote) -> None:
    slow = stdio_remote.submit("slow_report", {"topic": "t", "seconds": 60, "get_delay_ms": 8_000})
    garbled = stdio_remote.submit("malformed_job", {"kind": "invalid_json", "after_s": 0})
    other = stdio_remote.submit("slow_report", {"topic": "u", "seconds": 60})
    (first,) = processes_started(stdio_remote.state_dir)

    async def both() -> list[Any]:
        polling = asyncio.ensure_future(get_task_async(stdio_remote.config, slow.task_id))
        # The slow poll is with the server before the other call is sent, so two calls are in flight.
        await asyncio.to_thread(until, lambda: stdio_remote.calls().get("tasks/get", 0) == 1)
        return await asyncio.gather(polling, get_task_async(stdio_remote.config, garbled.task_id),
                                    return_exceptions=True)

    slow_outcome, garbled_outcome = asyncio.run(both())

    # A line that is not JSON names no request: neither call is told its answer broke the protocol.
    assert type(slow_outcome) is RemoteUnavailable, slow_outcome
    assert type(garbled_outcome) is RemoteUnavailable, garbled_outcome
    assert get_task(stdio_remote.config, other.task_id).status == "working"
    assert processes_started(stdio_remote.state_dir)[0] == first
    assert len(processes_started(stdio_remote.state_dir)) == 2, "the broken session is replaced"
    # Cut off mid-call, neither poll is repeated in place: their callers retry later.
    assert stdio_remote.calls()["tasks/get"] == 3


# A stdio MCP server that holds the tasks/get of "bad" and "good" until both have arrived, then answers
# "bad" with a JSON-RPC response of the wrong shape (a result that is not an object) and, a moment
# later, "good" properly. Everything else is answered at once. Each start is logged in starts.log.
TWO_ANSWERS_SERVER = """
import json, sys, time
from pathlib import Path

Path(sys.argv[1], "starts.log").open("a").write("started\\n")
held = {}

def answer(request, result):
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}) + "\\n")
    sys.stdout.flush()

while line := sys.stdin.readline():
    request = json.loads(line)
    if "id" not in request or "method" not in request:
        continue
    if request["method"] == "initialize":
        answer(request, {"protocolVersion": request["params"]["protocolVersion"], "capabilities": {},
                         "serverInfo": {"name": "two-answers", "version": "1"}})
        continue
    task_id = (request.get("params") or {}).get("taskId")
    if request["method"] == "tasks/get" and task_id in ("bad", "good"):
        held[task_id] = request
        if len(held) == 2:
            answer(held.pop("bad"), 5)
            time.sleep(0.3)
            answer(held.pop("good"), {"resultType": "complete", "taskId": "good", "status": "working"})
        continue
    answer(request, {"resultType": "complete", "taskId": task_id or "x", "status": "working"})
"""


def test_a_malformed_answer_that_names_its_request_fails_that_call_alone(tmp_path: Path) -> None:
    script = tmp_path / "two_answers.py"
    script.write_text(TWO_ANSWERS_SERVER)
    server = ServerConfig(name="two-answers", transport="stdio", command=(sys.executable, str(script), str(tmp_path)),
                          timeout_s=10)

    async def both() -> list[Any]:
        return await asyncio.gather(get_task_async(server, "bad"), get_task_async(server, "good"),
                                    return_exceptions=True)

    try:
        bad, good = asyncio.run(both())

        assert isinstance(bad, MalformedAnswer), bad
        assert isinstance(good, RemoteTask) and (good.task_id, good.status) == ("good", "working"), good
        assert get_task(server, "later").status == "working"
        assert (tmp_path / "starts.log").read_text().count("started") == 1, "the session is kept"
    finally:
        sessions.close_all()


# --- the fake's other edges, which the driver's tests rely on ------------------------------------


def test_it_keeps_a_handle_of_any_length_the_server_chooses(remote: Remote) -> None:
    long_id = "h" * 300

    first, again = remote.submit("handle_job", {"task_id": long_id}), remote.submit("handle_job", {"task_id": long_id})

    assert first.task_id == again.task_id == long_id
    assert get_task(remote.config, long_id).task_id == long_id


def test_a_chatty_server_names_its_task_and_itself(remote: Remote) -> None:
    task = remote.submit("chatty_job", {"seconds": 0.3})

    seen = remote.poll(task.task_id, until=TERMINAL)

    assert task.task_id in task.status_message and SERVER_INTERNAL in task.status_message
    assert seen[-1].status == "failed"
    assert seen[-1].error == f"{task.task_id} crashed on {SERVER_INTERNAL}"


def test_it_keeps_a_poll_interval_of_a_day(remote: Remote) -> None:
    task = remote.submit("slow_report", {"topic": "tides", "poll_ms": 86_400_000})

    assert task.poll_interval_ms == get_task(remote.config, task.task_id).poll_interval_ms == 86_400_000


def test_it_raises_unavailable_while_the_server_fails_cancel_requests(remote: Remote) -> None:
    task = remote.submit("stubborn_job", {"seconds": 30, "cancel_failures": 2})

    for _ in range(2):
        with pytest.raises(RemoteUnavailable):
            cancel_task(remote.config, task.task_id)
    cancel_task(remote.config, task.task_id)

    assert remote.calls()["tasks/cancel"] == 3


def test_a_hanging_status_read_times_out_and_the_next_request_is_answered(remote: Remote) -> None:
    # Long enough to start a stdio server on a busy machine, shorter than the hang.
    config = ServerConfig(**{**remote.config.__dict__, "timeout_s": 5.0})
    hanging = call_tool(config, "slow_report", {"topic": "x", "seconds": 30, "hang_get_s": 8})
    other = call_tool(config, "slow_report", {"topic": "y", "seconds": 30})
    assert isinstance(hanging, Created) and isinstance(other, Created)

    with pytest.raises(RemoteUnavailable, match="no answer within 5 s"):
        get_task(config, hanging.task.task_id)

    # The session that hung is replaced (for stdio, by a new server process).
    assert get_task(config, other.task.task_id).status == "working"


def test_it_reports_a_refused_tool_call_as_not_sent() -> None:
    server = ServerConfig(name="reports", transport="http", url="http://127.0.0.1:9/mcp", timeout_s=5)

    with pytest.raises(NotSent):
        call_tool(server, "slow_report", {"topic": "tides"})


# --- sessions ------------------------------------------------------------------------------------


def test_it_starts_a_stdio_server_once_for_every_call_from_any_thread_or_loop(stdio_remote: Remote) -> None:
    task = stdio_remote.submit("slow_report", {"topic": "tides", "seconds": 30})

    async def from_a_gateway_job() -> list[RemoteTask]:
        # A gateway job runs its own event loop and may await several calls at once.
        return list(await asyncio.gather(*[get_task_async(stdio_remote.config, task.task_id) for _ in range(3)]))

    seen = asyncio.run(from_a_gateway_job()) + asyncio.run(from_a_gateway_job()) + [get_task(stdio_remote.config,
                                                                                             task.task_id)]
    created = asyncio.run(call_tool_async(stdio_remote.config, "quick_echo", {"text": "hi"}))

    assert {t.status for t in seen} == {"working"} and isinstance(created, Completed)
    assert len(processes_started(stdio_remote.state_dir)) == 1
    assert stdio_remote.calls() == {"tools/call:slow_report": 1, "tasks/get": 7, "tools/call:quick_echo": 1}


def test_it_reconnects_once_when_the_stdio_server_died(stdio_remote: Remote) -> None:
    task = stdio_remote.submit("slow_report", {"topic": "tides", "seconds": 30})
    (first,) = processes_started(stdio_remote.state_dir)

    os.kill(first, signal.SIGKILL)
    seen = get_task(stdio_remote.config, task.task_id)

    assert seen.status == "working"
    assert len(processes_started(stdio_remote.state_dir)) == 2


def test_a_new_session_is_opened_after_the_sessions_are_closed(remote: Remote) -> None:
    task = remote.submit("slow_report", {"topic": "tides", "seconds": 30})
    assert sessions.open_count() == 1

    sessions.close_all()

    assert sessions.open_count() == 0
    assert get_task(remote.config, task.task_id).status == "working"
    assert sessions.open_count() == 1


def test_a_forked_worker_opens_its_own_session(stdio_remote: Remote) -> None:
    task = stdio_remote.submit("slow_report", {"topic": "tides", "seconds": 30})
    read_end, write_end = os.pipe()

    pid = os.fork()
    if pid == 0:  # the child: what a django-q2 worker forked from a process that talked MCP does
        status = 1
        try:
            os.write(write_end, get_task(stdio_remote.config, task.task_id).status.encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    child_saw = os.read(read_end, 100).decode()
    _, child_status = os.waitpid(pid, 0)
    os.close(read_end)

    assert (child_saw, child_status) == ("working", 0)
    assert get_task(stdio_remote.config, task.task_id).status == "working"  # the parent's session still works
    assert len(processes_started(stdio_remote.state_dir)) == 2


# --- the servers file's display names (tasks/mcp/config.py) --------------------------------------


def test_a_server_has_a_title_for_users_defaulting_to_its_name(tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {
        "reports": {"transport": "http", "url": "http://127.0.0.1:9/mcp", "title": " Quarterly reports "},
        "render": {"transport": "stdio", "command": [sys.executable, "-m", "render"]},
    }}))

    servers = config.load(path)

    assert servers["reports"].title == "Quarterly reports"
    assert servers["render"].title == "render"  # the name, never the command or URL


@pytest.mark.parametrize("title", ["", "   ", 7, "x" * 101])
def test_a_title_must_be_short_text(tmp_path: Path, title: Any) -> None:
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"reports": {"transport": "http", "url": "http://h/mcp", "title": title}}}))

    with pytest.raises(ImproperlyConfigured, match="server 'reports': title must be text"):
        config.load(path)
