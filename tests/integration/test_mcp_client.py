"""The MCP Tasks client against a real fake server: real processes over stdio pipes and loopback HTTP.

Every stdio call starts a fresh server process (about a second), so stdio runs get longer task
durations than http ones: a task must still be working when the next process answers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tasks.mcp.client import (
    Completed,
    Created,
    InputRequest,
    RemoteProtocolError,
    RemoteTask,
    RemoteTaskNotFound,
    RemoteUnavailable,
    ServerConfig,
    ToolNotFound,
    answer_for,
    call_tool,
    cancel_task,
    get_task,
    list_tools,
    update_task,
)
from tests.fakes import LoopbackServer, QuietHandler
from tests.fakes.mcp_task_server import McpTaskServer, calls

TERMINAL = {"completed", "failed", "cancelled"}


@dataclass(frozen=True)
class Remote:
    config: ServerConfig
    state_dir: Path
    # How long a task must run to be seen working by the next call on this transport.
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
        return
    # Every stdio call starts its own server process, which reads and writes the tasks in tmp_path.
    with McpTaskServer("stdio", state_dir=tmp_path) as config:
        yield Remote(config=config, state_dir=tmp_path, slow=3.0, calls_before={})


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

    update_task(remote.config, task.task_id, {question.key: answer_for(question, "pdf")})
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
    def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
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


def question(schema: dict[str, Any] | None, *, method: str = "elicitation/create") -> InputRequest:
    return InputRequest(key="q", method=method, message="?", schema=schema, raw={})


def test_it_answers_the_single_string_property_of_an_elicitation() -> None:
    schema = {"type": "object", "properties": {"format": {"type": "string"}}}

    assert answer_for(question(schema), "pdf") == {"action": "accept", "content": {"format": "pdf"}}


def test_it_answers_the_first_required_string_property_when_there_are_several() -> None:
    schema = {"type": "object", "required": ["count", "title"],
              "properties": {"note": {"type": "string"}, "count": {"type": "integer"}, "title": {"type": "string"}}}

    assert answer_for(question(schema), "Q3") == {"action": "accept", "content": {"title": "Q3"}}


def test_it_refuses_to_answer_a_question_without_a_string_to_fill() -> None:
    with pytest.raises(RemoteProtocolError):
        answer_for(question({"type": "object", "properties": {"n": {"type": "integer"}}}), "3")
    with pytest.raises(RemoteProtocolError):
        answer_for(question(None, method="sampling/createMessage"), "3")
