"""A fake remote MCP server speaking the Tasks extension (io.modelcontextprotocol/tasks, 2026-07-28).

    python -m tests.fakes.mcp_task_server stdio --state-dir DIR
    python -m tests.fakes.mcp_task_server http --port 0 --state-dir DIR   # prints "LISTENING <url>" first

Tasks live in JSON files under the state dir, so every server process for the dir (one per client
process over stdio) sees the tasks the others created, as a server with durable storage would. A
task's status is derived from the wall-clock time elapsed since it was created (or answered, or
cancelled), never from a background coroutine. Every request is counted in `calls.json` for the
tests to read.

It is strict where the specification lets a server be: a tool that will ask for input is refused
(-32021) unless the request declares the `elicitation` client capability, and the acknowledgement
of a `tasks/update` is eventually consistent (the next tasks/get still lists the answered request).
Some tools misbehave on purpose (malformed answers, chatty messages, huge questions, handles of
any length); see `build_server` for the list.

In tests:

    with McpTaskServer("http", state_dir=tmp_path) as server:   # a tasks.mcp.client.ServerConfig
        created = call_tool(server, "slow_report", {"topic": "tides", "seconds": 0.5})
    assert calls(tmp_path)["tools/call:slow_report"] == 1
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.server import require_client_extension
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    CallToolRequestParams,
    RequestParams,
)
from pydantic import Field

if TYPE_CHECKING:
    from tasks.mcp.client import ServerConfig

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
ROOT = Path(__file__).resolve().parents[2]
TASK_TOOLS = ("slow_report", "failing_job", "tool_error_job", "approval_job", "stubborn_job", "flaky_job",
              "ask_many", "handle_job", "malformed_job", "chatty_job", "big_question")
APPROVAL_KEY = "format"
APPROVAL_QUESTION = "Which format should the report use?"
APPROVAL_SCHEMA = {"type": "object", "properties": {"format": {"type": "string"}}, "required": ["format"]}
# The question tools work this long before they ask.
APPROVAL_ASKS_AFTER_S = 0.3
DETAILS_KEY = "details"
DETAILS_QUESTION = "How should the report be printed?"
DETAILS_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "title": "Title", "maxLength": 80},
        "copies": {"type": "integer", "title": "Copies", "minimum": 1, "maximum": 10},
        "urgent": {"type": "boolean", "title": "Urgent"},
        "format": {"type": "string", "title": "Format", "enum": ["pdf", "html"]},
    },
    "required": ["title", "copies", "format"],
}
BIG_QUESTION_KEY = "question"
BIG_QUESTION_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
# tool -> (input request key, message, requested schema); big_question's message is `size` characters.
QUESTIONS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "approval_job": (APPROVAL_KEY, APPROVAL_QUESTION, APPROVAL_SCHEMA),
    "ask_many": (DETAILS_KEY, DETAILS_QUESTION, DETAILS_SCHEMA),
    "big_question": (BIG_QUESTION_KEY, "", BIG_QUESTION_SCHEMA),
}
ASK_FIRST_KEY = "confirm"
ASK_FIRST_STATE = "ask-first-1"
ASK_FIRST_SCHEMA = {"type": "object", "properties": {"confirm": {"type": "boolean"}}, "required": ["confirm"]}
# Tools whose calls need the client to have declared elicitation.
ASKING_TOOLS = ("approval_job", "ask_many", "ask_first", "big_question")
SERVER_INTERNAL = "fake-mcp-internal-node"  # the server's own words, which must not reach Longhaul's users
SLOW_REPORT_STEPS = 4
MALFORMED_KINDS = ("unknown_status", "nan", "huge", "wrong_type", "invalid_json")
# A string the transports write raw in place of its JSON string (see _raw_json).
RAW = "@@raw:"


# --- durable state ---------------------------------------------------------------------------


class StateDir:
    """Task records and call counters as JSON files; one flock serialises read-modify-write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "tasks").mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        # stdio servers for the same state dir run as separate processes, one per connection.
        with open(self.path / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    def _task_path(self, task_id: str) -> Path:
        # Ids are ours (hex) or handle_job's (any text, any length): those are named by their hash.
        if task_id.isalnum() and len(task_id) <= 64:
            return self.path / "tasks" / f"{task_id}.json"
        return self.path / "tasks" / f"h{hashlib.sha256(task_id.encode()).hexdigest()}.json"

    def count(self, key: str) -> None:
        with self.locked():
            counters = self._read(self.path / "calls.json") or {}
            counters[key] = counters.get(key, 0) + 1
            self._write(self.path / "calls.json", counters)

    def create(self, record: dict[str, Any]) -> dict[str, Any]:
        """Store a new task; the stored one when a task with that id exists already."""
        with self.locked():
            path = self._task_path(record["id"])
            existing = self._read(path)
            if existing is not None:
                return existing
            self._write(path, record)
            return record

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The stored record; None when there is no such task."""
        with self.locked():
            return self._read(self._task_path(task_id))

    def update(self, task_id: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any] | None:
        """Apply `change` to the stored record under the lock; None when there is no such task."""
        with self.locked():
            path = self._task_path(task_id)
            record = self._read(path)
            if record is None:
                return None
            record = change(record)
            self._write(path, record)
            return record


def started(state_dir: str | Path) -> list[int]:
    """The process ids of the server processes started for `state_dir`, in order."""
    try:
        return [int(line) for line in (Path(state_dir) / "starts.log").read_text().split()]
    except FileNotFoundError:
        return []


def calls(state_dir: str | Path) -> dict[str, int]:
    """The per-method / per-tool request counters the server recorded in `state_dir`."""
    try:
        return json.loads((Path(state_dir) / "calls.json").read_text())
    except FileNotFoundError:
        return {}


# --- task behaviour ----------------------------------------------------------------------------


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def _text_result(text: str, *, is_error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


def _state(record: dict[str, Any], now: float) -> tuple[str, dict[str, Any], float]:
    """(status, status-specific fields incl. statusMessage, time of the last change) of a task at `now`."""
    args: dict[str, Any] = record["args"]
    seconds = float(args.get("seconds", record["default_seconds"]))
    started = record["created_at"]
    cancelled_at = record.get("cancel_requested_at")
    tool = record["tool"]
    answer: dict[str, Any] | None = record.get("answer")

    if tool in QUESTIONS:
        asked_at = started + APPROVAL_ASKS_AFTER_S
        answered_at = record.get("answered_at")
        done_at = answered_at + seconds if answered_at is not None else math.inf
        if answer is not None and answer.get("action") == "cancel" and answered_at is not None:
            done_at = answered_at
    elif tool == "malformed_job":
        done_at = math.inf
    else:
        done_at = started + seconds
    if cancelled_at is not None and tool != "stubborn_job" and cancelled_at < done_at:
        return "cancelled", {"statusMessage": "cancelled at the client's request"}, cancelled_at
    if now >= done_at:
        status, fields = _finished(record)
        if cancelled_at is not None and cancelled_at < done_at:
            fields["statusMessage"] = "done (a cancel request was ignored)"
        return status, fields, done_at
    if tool in QUESTIONS:
        if now < asked_at:
            return "working", {"statusMessage": "preparing the report"}, started
        if answered_at is None:
            key, message, schema = QUESTIONS[tool]
            if tool == "big_question":
                message = ("Tell me everything. " * (int(args.get("size", 0)) // 20 + 1))[:int(args.get("size", 0))]
            request = {"method": "elicitation/create",
                       "params": {"mode": "form", "message": message, "requestedSchema": schema}}
            return "input_required", {"statusMessage": "waiting for an answer",
                                      "inputRequests": {key: request}}, asked_at
        if tool == "approval_job" and answer is not None and answer.get("action") == "accept":
            return "working", {"statusMessage": f"rendering the report in {answer['content'][APPROVAL_KEY]}"}, answered_at
        return "working", {"statusMessage": "finishing"}, answered_at
    if tool == "malformed_job" and now > started + float(args.get("after_s", 0.2)):  # never in the handle itself
        return "working", _malformed(str(args.get("kind"))), started
    steps = SLOW_REPORT_STEPS
    step = min(steps, int((now - started) / seconds * steps) + 1)
    if tool == "chatty_job":
        return "working", {"statusMessage": f"step {step} of {record['id']} on {SERVER_INTERNAL}"}, started
    return "working", {"statusMessage": f"step {step} of {steps}"}, started + (step - 1) * seconds / steps


def _malformed(kind: str) -> dict[str, Any]:
    """The fields that make malformed_job's answer malformed, once its after_s has passed."""
    match kind:
        case "unknown_status":
            return {"status": "paused", "statusMessage": "paused"}
        case "nan":
            return {"pollIntervalMs": f"{RAW}NaN", "statusMessage": "working"}
        case "huge":
            return {"pollIntervalMs": f"{RAW}1e999", "statusMessage": "working"}
        case "wrong_type":
            return {"status": 7, "statusMessage": "working"}
        case "invalid_json":
            return {"statusMessage": f"{RAW}not-json"}
    raise MCPError(code=INVALID_PARAMS, message=f"malformed_job: kind must be one of {', '.join(MALFORMED_KINDS)}")


def _finished(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = record["args"]
    answer: dict[str, Any] = record.get("answer") or {}
    match record["tool"]:
        case "failing_job":
            message = "the render farm rejected the job"
            return "failed", {"statusMessage": message, "error": {"code": INTERNAL_ERROR, "message": message}}
        case "chatty_job":
            message = f"{record['id']} crashed on {SERVER_INTERNAL}"
            return "failed", {"statusMessage": message, "error": {"code": INTERNAL_ERROR, "message": message}}
        case "tool_error_job":
            return "completed", {"statusMessage": "done", "result": _text_result("quota exceeded for this month",
                                                                                 is_error=True)}
        case "approval_job" | "ask_many" | "big_question" if answer.get("action") == "cancel":
            return "cancelled", {"statusMessage": "the question was cancelled"}
        case "approval_job" | "ask_many" | "big_question" if answer.get("action") != "accept":
            return "completed", {"statusMessage": "done", "result": _text_result("declined")}
        case "approval_job":
            return "completed", {"statusMessage": "done",
                                 "result": _text_result(f"report in {answer['content'][APPROVAL_KEY]}")}
        case "ask_many":
            text = "accepted " + json.dumps(answer["content"], sort_keys=True)
            return "completed", {"statusMessage": "done", "result": _text_result(text)}
        case "big_question":
            return "completed", {"statusMessage": "done", "result": _text_result("answered")}
        case "ask_first":
            return "completed", {"statusMessage": "done", "result": _text_result("confirmed")}
        case "slow_report":
            text = f"Report on {args.get('topic', '')}: all sources agree."
            if int(args.get("size", 0)) > 0:
                text += "\n" + "x" * int(args["size"])
            return "completed", {"statusMessage": "done", "result": _text_result(text)}
        case _:
            return "completed", {"statusMessage": "done", "result": _text_result(f"{record['tool']} finished")}


def _invalid_content(schema: dict[str, Any], content: Any) -> str | None:
    """Why `content` does not fit a flat requested schema, or None when it does."""
    if not isinstance(content, dict):
        return "content must be an object"
    properties: dict[str, Any] = schema["properties"]
    for name in schema.get("required", []):
        if name not in content:
            return f"{name} is required"
    for name, value in content.items():
        prop = properties.get(name)
        if prop is None:
            return f"unknown field {name}"
        kind = prop["type"]
        if kind == "string" and not isinstance(value, str):
            return f"{name} must be a string"
        if kind == "boolean" and not isinstance(value, bool):
            return f"{name} must be a boolean"
        if kind in ("integer", "number"):
            if isinstance(value, bool) or not isinstance(value, int if kind == "integer" else int | float):
                return f"{name} must be an {kind}"
            if not prop.get("minimum", -math.inf) <= value <= prop.get("maximum", math.inf):
                return f"{name} is out of range"
        if "enum" in prop and value not in prop["enum"]:
            return f"{name} must be one of {prop['enum']}"
        if "maxLength" in prop and len(value) > prop["maxLength"]:
            return f"{name} is too long"
    return None


def _task_view(record: dict[str, Any], now: float) -> dict[str, Any]:
    status, fields, changed_at = _state(record, now)
    return {
        "taskId": record["id"],
        "status": status,
        "createdAt": _iso(record["created_at"]),
        "lastUpdatedAt": _iso(min(changed_at, now)),
        "ttlMs": record["ttl_ms"],
        "pollIntervalMs": record["poll_ms"],
        **fields,
    }


def _not_found(record: dict[str, Any] | None, now: float) -> bool:
    return record is None or (record["ttl_ms"] is not None and now > record["created_at"] + record["ttl_ms"] / 1000)


def _task_not_found(task_id: str, record: dict[str, Any] | None) -> MCPError:
    # The spec prescribes -32602 (invalid params) for an unknown or expired task id.
    reason = "Task not found" if record is None else "Task has expired"
    return MCPError(code=INVALID_PARAMS, message=f"Failed to retrieve task: {reason}")


# --- the extension -----------------------------------------------------------------------------


class TaskIdParams(RequestParams):
    task_id: str = Field(alias="taskId")


class UpdateTaskParams(TaskIdParams):
    input_responses: dict[str, dict[str, Any]] = Field(alias="inputResponses")


class FakeTasksExtension(Extension):
    """The server side of the Tasks extension: task tools answer with a task handle."""

    identifier = TASKS_EXTENSION

    def __init__(self, state: StateDir) -> None:
        self.state = state

    def methods(self) -> list[MethodBinding]:
        return [
            MethodBinding(method="tasks/get", params_type=TaskIdParams, handler=self.get),
            MethodBinding(method="tasks/update", params_type=UpdateTaskParams, handler=self.update),
            MethodBinding(method="tasks/cancel", params_type=TaskIdParams, handler=self.cancel),
        ]

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        self.state.count(f"tools/call:{params.name}")
        if params.name == "quick_echo":
            return await call_next(ctx)
        if params.name not in (*TASK_TOOLS, "ask_first"):
            raise MCPError(code=INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        require_client_extension(ctx, TASKS_EXTENSION)
        if params.name in ASKING_TOOLS:
            _require_elicitation(ctx)
        args = dict(params.arguments or {})
        if params.name == "ask_first":
            return self._ask_first(params, args)
        if params.name == "malformed_job":
            _malformed(str(args.get("kind")))  # an unknown kind is refused now, not at the first poll
        if params.name == "handle_job" and not isinstance(args.get("task_id"), str):
            raise MCPError(code=INVALID_PARAMS, message="handle_job: task_id must be text")
        created = self._create(params.name, args)
        # `call_delay_ms`: the task exists, its answer is slow, so a test can act while the call is in flight.
        delay = float(args.get("call_delay_ms", 0)) / 1000
        if delay > 0:
            await anyio.sleep(delay)
        return created

    def _create(self, tool: str, args: dict[str, Any], *, seconds: float | None = None) -> HandlerResult:
        now = time.time()
        record = {
            "id": str(args["task_id"]) if tool == "handle_job" else secrets.token_hex(16),
            "tool": tool,
            "args": args,
            "default_seconds": seconds if seconds is not None else {"slow_report": 2, "stubborn_job": 3, "flaky_job": 3,
                                                                    "ask_many": 0.3}.get(tool, 1),
            "created_at": now,
            "poll_ms": int(args.get("poll_ms", 200)),
            "ttl_ms": int(args["ttl_ms"]) if args.get("ttl_ms") is not None else 60_000,
            "flaky_failures_left": int(args.get("failures", 4)) if tool == "flaky_job" else 0,
            "cancel_failures_left": int(args.get("cancel_failures", 0)),
            "successful_gets": 0,
            "answered_keys": [],
        }
        # The spec: answer only once a tasks/get for the id would resolve, i.e. after the write.
        record = self.state.create(record)
        # A CreateTaskResult is a plain Task: the inline result, error or inputRequests come from tasks/get.
        view = {k: v for k, v in _task_view(record, now).items() if k not in ("result", "error", "inputRequests")}
        return {"resultType": "task", **view}

    def _ask_first(self, params: CallToolRequestParams, args: dict[str, Any]) -> HandlerResult:
        """Asks before it creates a task: an input-required result, then a task once confirmed."""
        responses = {key: value.model_dump(by_alias=True, mode="json", exclude_none=True)
                     if hasattr(value, "model_dump") else value for key, value in (params.input_responses or {}).items()}
        if not responses and params.request_state is None:
            request = {"method": "elicitation/create",
                       "params": {"mode": "form", "message": "Really start the job?", "requestedSchema": ASK_FIRST_SCHEMA}}
            return {"resultType": "input_required", "inputRequests": {ASK_FIRST_KEY: request},
                    "requestState": ASK_FIRST_STATE}
        response = responses.get(ASK_FIRST_KEY) or {}
        content = response.get("content") or {}
        if (params.request_state == ASK_FIRST_STATE and response.get("action") == "accept"
                and content.get("confirm") is True):
            return self._create("ask_first", args, seconds=0.3)
        return {"resultType": "complete", **_text_result("not confirmed: the job was not started", is_error=True)}

    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> HandlerResult:
        self.state.count("tasks/get")
        require_client_extension(ctx, TASKS_EXTENSION)
        now = time.time()
        failing = False
        stale: dict[str, Any] | None = None

        def poll(record: dict[str, Any]) -> dict[str, Any]:
            nonlocal failing, stale
            if record["successful_gets"] > 0 and record["flaky_failures_left"] > 0:
                failing = True
                record["flaky_failures_left"] -= 1
            else:
                record["successful_gets"] += 1
                # Eventual consistency: the first read after an answer still sees the question.
                stale = record.pop("stale_view", None)
            return record

        record = self.state.update(params.task_id, poll)
        if record is None or _not_found(record, now):
            raise _task_not_found(params.task_id, record)
        # `hang_get_s`: a tasks/get that hangs, as a server stuck behind a lock would.
        hang = float(record["args"].get("hang_get_s", 0))
        if hang > 0:
            await anyio.sleep(hang)
        if failing:
            raise MCPError(code=INTERNAL_ERROR, message="task store temporarily unavailable")
        # `get_delay_ms`: a slow tasks/get, so a test can act while a poll is in flight.
        delay = float(record["args"].get("get_delay_ms", 0)) / 1000
        if delay > 0:
            await anyio.sleep(delay)
        return {"resultType": "complete", **(stale if stale is not None else _task_view(record, now))}

    async def update(self, ctx: ServerRequestContext[Any, Any], params: UpdateTaskParams) -> HandlerResult:
        self.state.count("tasks/update")
        require_client_extension(ctx, TASKS_EXTENSION)
        now = time.time()
        duplicate = False

        def answer_question(record: dict[str, Any]) -> dict[str, Any]:
            nonlocal duplicate
            duplicate = any(key in record.get("answered_keys", []) for key in params.input_responses)
            status, fields, _ = _state(record, now)
            outstanding = fields.get("inputRequests") or {} if status == "input_required" else {}
            # Responses to keys that are not outstanding are ignored, as the spec asks.
            for key, response in params.input_responses.items():
                if key not in outstanding:
                    continue
                schema = outstanding[key]["params"]["requestedSchema"]
                action = response.get("action")
                problem = (f"action must be accept, decline or cancel, not {action!r}"
                           if action not in ("accept", "decline", "cancel")
                           else _invalid_content(schema, response.get("content")) if action == "accept" else None)
                if problem is not None:
                    raise MCPError(code=INVALID_PARAMS, message=f"inputResponses[{key!r}]: {problem}")
                record["stale_view"] = _task_view(record, now)
                record["answered_at"] = now
                record["answer"] = {"action": action, "content": response.get("content")}
                record.setdefault("answered_keys", []).append(key)
            return record

        record = self.state.update(params.task_id, answer_question)
        if record is None or _not_found(record, now):
            raise _task_not_found(params.task_id, record)
        if duplicate:
            self.state.count("tasks/update:duplicate")
        return {"resultType": "complete"}

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> HandlerResult:
        self.state.count("tasks/cancel")
        require_client_extension(ctx, TASKS_EXTENSION)
        # `cancel_delay_ms` (a tool argument): the server takes its time over the cancel, as a busy one would,
        # so a test can act while the request is out.
        stored = self.state.get(params.task_id)
        delay = float((stored or {}).get("args", {}).get("cancel_delay_ms", 0)) / 1000
        if delay > 0:
            await anyio.sleep(delay)
        now = time.time()
        failing = False

        def request_cancel(record: dict[str, Any]) -> dict[str, Any]:
            nonlocal failing
            # `cancel_failures`: the first N cancel requests fail, as a server's busy task store would.
            if record.get("cancel_failures_left", 0) > 0:
                failing = True
                record["cancel_failures_left"] -= 1
            else:
                record.setdefault("cancel_requested_at", now)
            return record

        record = self.state.update(params.task_id, request_cancel)
        if record is None or _not_found(record, now):
            raise _task_not_found(params.task_id, record)
        if failing:
            raise MCPError(code=INTERNAL_ERROR, message="the task store did not answer")
        return {"resultType": "complete"}


def _require_elicitation(ctx: ServerRequestContext[Any, Any]) -> None:
    """Refuse a tool that will ask for input unless the request declared elicitation (SEP-2133's -32021)."""
    capabilities = ctx.session.client_capabilities
    if capabilities is None or capabilities.elicitation is None:
        raise MCPError(code=MISSING_REQUIRED_CLIENT_CAPABILITY,
                       message="Client did not declare the elicitation capability this tool needs",
                       data={"requiredCapabilities": {"elicitation": {"form": {}}}})


def build_server(state_dir: Path) -> MCPServer:
    server = MCPServer(name="fake-task-server", version="1.0", extensions=[FakeTasksExtension(StateDir(state_dir))],
                       log_level="WARNING")

    # The task tools are listed for discovery; their calls never get past the interceptor.
    @server.tool()
    def slow_report(topic: str, seconds: float = 2, size: int = 0, poll_ms: int = 200,
                    ttl_ms: int | None = None, hang_get_s: float = 0, cancel_delay_ms: float = 0) -> str:
        """Write a report on a topic, slowly (a task)."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def failing_job(seconds: float = 1, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task that fails with a JSON-RPC error."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def tool_error_job(seconds: float = 1, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task that completes with a tool error."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def approval_job(seconds: float = 1, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task that asks which format to use."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def stubborn_job(seconds: float = 3, poll_ms: int = 200, ttl_ms: int | None = None,
                     cancel_failures: int = 0) -> str:
        """A task that ignores cancellation (and fails its first `cancel_failures` cancel requests)."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def flaky_job(seconds: float = 3, failures: int = 4, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task whose status reads fail for a while."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def ask_many(seconds: float = 0.3, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task that asks for a title, a number of copies, urgency and a format in one form."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def ask_first(poll_ms: int = 200) -> str:
        """Asks for confirmation before it starts a task."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def handle_job(task_id: str, seconds: float = 1, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task with the id the caller chooses (the existing task when the id is taken)."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def malformed_job(kind: str, after_s: float = 0.2, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task whose status reads turn malformed after a while (unknown_status, nan, huge, wrong_type,
        invalid_json)."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def chatty_job(seconds: float = 1, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task whose messages and error carry its id and the server's internal names."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def big_question(size: int, seconds: float = 1, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task that asks a question `size` characters long."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def quick_echo(text: str) -> str:
        """Echo the text back at once."""
        return f"echo: {text}"

    return server


def _raw_json(text: str) -> str:
    """A serialized message with the RAW markers written raw: NaN, 1e999, or a message that is not JSON."""
    if f'"{RAW}not-json"' in text:
        return "this is not JSON {" + ("\n" if text.endswith("\n") else "")
    return text.replace(f'"{RAW}NaN"', "NaN").replace(f'"{RAW}1e999"', "1e999")


class _RawJsonStdout:
    """The stdio transport's stdout, writing RAW markers raw."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def write(self, text: str) -> None:
        await self.inner.write(_raw_json(text))

    async def flush(self) -> None:
        await self.inner.flush()


class _RawJsonApp:
    """ASGI middleware writing RAW markers raw in JSON response bodies."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        body: list[bytes] = []

        async def rewrite(message: dict[str, Any]) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                if headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message  # held until the whole body is known
                    return
            elif message["type"] == "http.response.body" and start is not None:
                body.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                data = _raw_json(b"".join(body).decode()).encode()
                headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(data)).encode())]})
                await send({"type": "http.response.body", "body": data})
                return
            await send(message)

        await self.app(scope, receive, rewrite)


async def _serve_stdio(server: MCPServer) -> None:
    # Our own stdout stream, so the malformed answers can be written raw; stray prints go to stderr.
    wire = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdout = _RawJsonStdout(anyio.wrap_file(io.TextIOWrapper(wire, encoding="utf-8")))
    lowlevel = server._lowlevel_server  # what MCPServer.run_stdio_async serves
    async with stdio_server(stdout=stdout) as (read_stream, write_stream):  # type: ignore[arg-type]
        await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


async def _serve_http(server: MCPServer, port: int) -> None:
    import uvicorn

    app = _RawJsonApp(server.streamable_http_app(stateless_http=True, json_response=True))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    # Listening before saying so: uvicorn listens only once its startup is done, and a client that
    # connected in between was refused (a ConnectError seen once in CI). Connections now wait in
    # the backlog until it accepts them.
    sock.listen(128)
    print(f"LISTENING http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--port", type=int, default=0)
    options = parser.parse_args(argv)
    server = build_server(options.state_dir)
    with open(options.state_dir / "starts.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    if options.transport == "stdio":
        anyio.run(_serve_stdio, server)
        # Skip interpreter teardown (collecting thousands of pydantic objects): the client waits for our exit.
        sys.stdout.flush()
        os._exit(0)
    else:
        anyio.run(_serve_http, server, options.port)


# --- test helper -------------------------------------------------------------------------------


class McpTaskServer:
    """`with McpTaskServer("stdio"|"http", state_dir=...) as config:` a ServerConfig for the fake server."""

    def __init__(self, transport: Literal["stdio", "http"], *, state_dir: str | Path, timeout_s: float = 10.0) -> None:
        self.transport = transport
        self.state_dir = Path(state_dir)
        self.timeout_s = timeout_s
        self._process: subprocess.Popen[str] | None = None

    def _argv(self, transport: str) -> tuple[str, ...]:
        return (sys.executable, "-m", "tests.fakes.mcp_task_server", transport, "--state-dir", str(self.state_dir))

    def __enter__(self) -> ServerConfig:
        # Imported here so the server process itself never loads Longhaul code.
        from tasks.mcp.client import ServerConfig
        from tests.processes import ending_with_us

        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.transport == "stdio":
            return ServerConfig(name="fake-stdio", transport="stdio", command=self._argv("stdio"), cwd=str(ROOT),
                                timeout_s=self.timeout_s)
        self._process = subprocess.Popen(ending_with_us([*self._argv("http"), "--port", "0"]), cwd=ROOT,
                                         stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.startswith("LISTENING "):
            self.__exit__()
            raise RuntimeError(f"the fake MCP server did not start: {line!r}")
        return ServerConfig(name="fake-http", transport="http", url=line.split(" ", 1)[1], timeout_s=self.timeout_s)

    def __exit__(self, *exc_info: object) -> None:
        # The sessions this process opened to the fake (for stdio, its server processes) go with it.
        from tasks.mcp import sessions

        sessions.close_all()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._process = None


# The name the tests give the fake in Longhaul's servers file (LONGHAUL_MCP_SERVERS).
SERVER_NAME = "tools"


def write_servers_file(path: Path, server: ServerConfig, *, tenants: list[str] | None = None,
                       timeout_s: float = 20) -> Path:
    """A servers file naming `server` (as McpTaskServer yields it) SERVER_NAME, for Longhaul to read; the
    server's own internal names are listed under `redact`, as an operator who knows them would."""
    entry: dict[str, Any] = {"transport": server.transport, "timeout_s": timeout_s, "redact": [SERVER_INTERNAL]}
    if server.transport == "http":
        entry["url"] = server.url
    else:
        entry["command"] = list(server.command)
        entry["cwd"] = server.cwd or str(ROOT)
    if tenants is not None:
        entry["tenants"] = tenants
    path.write_text(json.dumps({"servers": {SERVER_NAME: entry}}))
    return path


if __name__ == "__main__":
    main()
