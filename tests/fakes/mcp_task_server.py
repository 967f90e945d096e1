"""A fake remote MCP server speaking the Tasks extension (io.modelcontextprotocol/tasks, 2026-07-28).

    python -m tests.fakes.mcp_task_server stdio --state-dir DIR
    python -m tests.fakes.mcp_task_server http --port 0 --state-dir DIR   # prints "LISTENING <url>" first

Tasks live in JSON files under the state dir, so a fresh stdio process per connection sees the
tasks an earlier process created, as a server with durable storage would. A task's status is
derived from the wall-clock time elapsed since it was created (or answered, or cancelled), never
from a background coroutine. Every request is counted in `calls.json` for the tests to read.

In tests:

    with McpTaskServer("http", state_dir=tmp_path) as server:   # a tasks.mcp.client.ServerConfig
        created = call_tool(server, "slow_report", {"topic": "tides", "seconds": 0.5})
    assert calls(tmp_path)["tools/call:slow_report"] == 1
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
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
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, CallToolRequestParams, RequestParams
from pydantic import Field

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.server import require_client_extension
from mcp.shared.exceptions import MCPError

if TYPE_CHECKING:
    from tasks.mcp.client import ServerConfig

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
ROOT = Path(__file__).resolve().parents[2]
TASK_TOOLS = ("slow_report", "failing_job", "tool_error_job", "approval_job", "stubborn_job", "flaky_job")
APPROVAL_KEY = "format"
APPROVAL_QUESTION = "Which format should the report use?"
APPROVAL_SCHEMA = {"type": "object", "properties": {"format": {"type": "string"}}, "required": ["format"]}
# approval_job works this long before it asks its question.
APPROVAL_ASKS_AFTER_S = 0.3
SLOW_REPORT_STEPS = 4


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
        # Task ids are ours (hex); anything else names no file.
        return self.path / "tasks" / f"{task_id}.json" if task_id.isalnum() else self.path / "tasks" / "-"

    def count(self, key: str) -> None:
        with self.locked():
            counters = self._read(self.path / "calls.json") or {}
            counters[key] = counters.get(key, 0) + 1
            self._write(self.path / "calls.json", counters)

    def create(self, record: dict[str, Any]) -> None:
        with self.locked():
            self._write(self._task_path(record["id"]), record)

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

    if tool == "approval_job":
        asked_at = started + APPROVAL_ASKS_AFTER_S
        answered_at = record.get("answered_at")
        done_at = answered_at + seconds if answered_at is not None else math.inf
    else:
        done_at = started + seconds
    if cancelled_at is not None and tool != "stubborn_job" and cancelled_at < done_at:
        return "cancelled", {"statusMessage": "cancelled at the client's request"}, cancelled_at
    if now >= done_at:
        status, fields = _finished(record)
        if cancelled_at is not None and cancelled_at < done_at:
            fields["statusMessage"] = "done (a cancel request was ignored)"
        return status, fields, done_at
    if tool == "approval_job":
        if now < asked_at:
            return "working", {"statusMessage": "preparing the report"}, started
        if answered_at is None:
            request = {"method": "elicitation/create",
                       "params": {"mode": "form", "message": APPROVAL_QUESTION, "requestedSchema": APPROVAL_SCHEMA}}
            return "input_required", {"statusMessage": "waiting for an answer",
                                      "inputRequests": {APPROVAL_KEY: request}}, asked_at
        return "working", {"statusMessage": f"rendering the report in {record['answer']}"}, answered_at
    steps = SLOW_REPORT_STEPS
    step = min(steps, int((now - started) / seconds * steps) + 1)
    return "working", {"statusMessage": f"step {step} of {steps}"}, started + (step - 1) * seconds / steps


def _finished(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = record["args"]
    match record["tool"]:
        case "failing_job":
            message = "the render farm rejected the job"
            return "failed", {"statusMessage": message, "error": {"code": INTERNAL_ERROR, "message": message}}
        case "tool_error_job":
            return "completed", {"statusMessage": "done", "result": _text_result("quota exceeded for this month",
                                                                                 is_error=True)}
        case "approval_job":
            return "completed", {"statusMessage": "done", "result": _text_result(f"report in {record['answer']}")}
        case "slow_report":
            text = f"Report on {args.get('topic', '')}: all sources agree."
            if int(args.get("size", 0)) > 0:
                text += "\n" + "x" * int(args["size"])
            return "completed", {"statusMessage": "done", "result": _text_result(text)}
        case _:
            return "completed", {"statusMessage": "done", "result": _text_result(f"{record['tool']} finished")}


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
        if params.name not in TASK_TOOLS:
            raise MCPError(code=INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        require_client_extension(ctx, TASKS_EXTENSION)
        args = dict(params.arguments or {})
        now = time.time()
        record = {
            "id": secrets.token_hex(16),
            "tool": params.name,
            "args": args,
            "default_seconds": {"slow_report": 2, "stubborn_job": 3, "flaky_job": 3}.get(params.name, 1),
            "created_at": now,
            "poll_ms": int(args.get("poll_ms", 200)),
            "ttl_ms": int(args["ttl_ms"]) if args.get("ttl_ms") is not None else 60_000,
            "flaky_failures_left": int(args.get("failures", 4)) if params.name == "flaky_job" else 0,
            "successful_gets": 0,
        }
        # The spec: answer only once a tasks/get for the id would resolve, i.e. after the write.
        self.state.create(record)
        # A CreateTaskResult is a plain Task: the inline result, error or inputRequests come from tasks/get.
        view = {k: v for k, v in _task_view(record, now).items() if k not in ("result", "error", "inputRequests")}
        return {"resultType": "task", **view}

    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> HandlerResult:
        self.state.count("tasks/get")
        require_client_extension(ctx, TASKS_EXTENSION)
        now = time.time()
        failing = False

        def poll(record: dict[str, Any]) -> dict[str, Any]:
            nonlocal failing
            if record["successful_gets"] > 0 and record["flaky_failures_left"] > 0:
                failing = True
                record["flaky_failures_left"] -= 1
            else:
                record["successful_gets"] += 1
            return record

        record = self.state.update(params.task_id, poll)
        if record is None or _not_found(record, now):
            raise _task_not_found(params.task_id, record)
        if failing:
            raise MCPError(code=INTERNAL_ERROR, message="task store temporarily unavailable")
        # `get_delay_ms`: a slow tasks/get, so a test can act while a poll is in flight.
        delay = float(record["args"].get("get_delay_ms", 0)) / 1000
        if delay > 0:
            await anyio.sleep(delay)
        return {"resultType": "complete", **_task_view(record, now)}

    async def update(self, ctx: ServerRequestContext[Any, Any], params: UpdateTaskParams) -> HandlerResult:
        self.state.count("tasks/update")
        require_client_extension(ctx, TASKS_EXTENSION)
        now = time.time()
        response = params.input_responses.get(APPROVAL_KEY)
        content = (response or {}).get("content")
        answer = content.get(APPROVAL_KEY) if isinstance(content, dict) else None
        if response is not None and (response.get("action") != "accept" or not isinstance(answer, str)):
            raise MCPError(code=INVALID_PARAMS, message=f"inputResponses[{APPROVAL_KEY!r}] must accept a string")

        def answer_question(record: dict[str, Any]) -> dict[str, Any]:
            # Responses to keys that are not outstanding are ignored, as the spec asks.
            if response is not None and _state(record, now)[0] == "input_required":
                record["answered_at"] = now
                record["answer"] = answer
            return record

        record = self.state.update(params.task_id, answer_question)
        if record is None or _not_found(record, now):
            raise _task_not_found(params.task_id, record)
        return {"resultType": "complete"}

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> HandlerResult:
        self.state.count("tasks/cancel")
        require_client_extension(ctx, TASKS_EXTENSION)
        now = time.time()

        def request_cancel(record: dict[str, Any]) -> dict[str, Any]:
            record.setdefault("cancel_requested_at", now)
            return record

        record = self.state.update(params.task_id, request_cancel)
        if record is None or _not_found(record, now):
            raise _task_not_found(params.task_id, record)
        return {"resultType": "complete"}


def build_server(state_dir: Path) -> MCPServer:
    server = MCPServer(name="fake-task-server", version="1.0", extensions=[FakeTasksExtension(StateDir(state_dir))],
                       log_level="WARNING")

    # The task tools are listed for discovery; their calls never get past the interceptor.
    @server.tool()
    def slow_report(topic: str, seconds: float = 2, size: int = 0, poll_ms: int = 200,
                    ttl_ms: int | None = None) -> str:
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
    def stubborn_job(seconds: float = 3, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task that ignores cancellation."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def flaky_job(seconds: float = 3, failures: int = 4, poll_ms: int = 200, ttl_ms: int | None = None) -> str:
        """A task whose status reads fail for a while."""
        raise RuntimeError("runs as a task")

    @server.tool()
    def quick_echo(text: str) -> str:
        """Echo the text back at once."""
        return f"echo: {text}"

    return server


async def _serve_http(server: MCPServer, port: int) -> None:
    import uvicorn

    app = server.streamable_http_app(stateless_http=True, json_response=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
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
    if options.transport == "stdio":
        server.run("stdio")
        # Skip interpreter teardown (collecting thousands of pydantic objects): the client waits for our exit.
        sys.stdout.flush()
        os._exit(0)
    else:
        import anyio

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

        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.transport == "stdio":
            return ServerConfig(name="fake-stdio", transport="stdio", command=self._argv("stdio"), cwd=str(ROOT),
                                timeout_s=self.timeout_s)
        self._process = subprocess.Popen([*self._argv("http"), "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                                         text=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.startswith("LISTENING "):
            self.__exit__()
            raise RuntimeError(f"the fake MCP server did not start: {line!r}")
        return ServerConfig(name="fake-http", transport="http", url=line.split(" ", 1)[1], timeout_s=self.timeout_s)

    def __exit__(self, *exc_info: object) -> None:
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


def write_servers_file(path: Path, server: ServerConfig, *, tenants: list[str] | None = None) -> Path:
    """A servers file naming `server` (as McpTaskServer yields it) SERVER_NAME, for Longhaul to read."""
    entry: dict[str, Any] = {"transport": server.transport, "timeout_s": 20}
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
