"""The requester side of the MCP Tasks extension (io.modelcontextprotocol/tasks, 2026-07-28); the only module
that speaks MCP.

Each request has an async function (`call_tool_async`...), which a gateway job awaits on its event loop
beside its other calls, and a synchronous twin (`call_tool`...) for code with no event loop (the chat
agent's tool list, tests). Each opens one session to the server, sends its request(s), closes, and
finishes within the server's `timeout_s`. Failures raise one of the `McpError` subclasses below; callers
decide retry or failure by type.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client import Transport
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim, UnexpectedClaimedResult
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict, TypeAdapter, ValidationError

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
_T = TypeVar("_T")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    transport: Literal["stdio", "http"]
    command: tuple[str, ...] = ()  # stdio: argv
    # repr=False: env and header values are often secrets and configs end up in logs.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # stdio: extra environment over a safe minimum
    cwd: str | None = None  # stdio
    url: str = ""  # http: the streamable-HTTP endpoint
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # http: resolved values
    timeout_s: float = 30.0


@dataclass(frozen=True)
class ToolResult:
    text: str  # the text content parts joined with "\n"
    content: list[dict[str, Any]]
    structured: dict[str, Any] | None
    is_error: bool


@dataclass(frozen=True)
class InputRequest:
    key: str
    method: str  # e.g. "elicitation/create"
    message: str
    schema: dict[str, Any] | None  # requestedSchema of an elicitation
    raw: dict[str, Any]


@dataclass(frozen=True)
class RemoteTask:
    task_id: str
    status: str  # working | input_required | completed | failed | cancelled
    status_message: str
    poll_interval_ms: int | None
    ttl_ms: int | None
    result: ToolResult | None  # when completed
    error: str | None  # when failed
    input_requests: tuple[InputRequest, ...]  # when input_required


@dataclass(frozen=True)
class Completed:
    result: ToolResult


@dataclass(frozen=True)
class Created:
    task: RemoteTask


class McpError(Exception):
    """Base of every error talking to a remote MCP server."""


class RemoteUnavailable(McpError):
    """Transient: refused, timed out, 5xx/429, the process died, or a JSON-RPC internal error."""


class NotSent(RemoteUnavailable):
    """Transient, and the request provably had no effect: the connection or session failed before it
    was sent, or the server refused it for its rate (429). Only then is a tool call safe to repeat."""


class RemoteTaskNotFound(McpError):
    """The server does not know the task id (never created, expired, or purged)."""


class RemoteProtocolError(McpError):
    """Permanent: a malformed answer, or the server lacks what the call needs."""


class ToolNotFound(McpError):
    """The server has no tool of that name."""


# --- wire shapes ---------------------------------------------------------------------------------------


class _CreateTaskResult(types.Result):
    """A tools/call answered with a task handle (`resultType: "task"`)."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"]
    task_id: str
    status: str


class _TaskRequest(types.Request[dict[str, Any], str]):
    # Over streamable HTTP the spec routes tasks/* by an Mcp-Name header carrying the task id.
    name_param = "taskId"


_RawResult: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


async def _unresolvable(result: _CreateTaskResult, ctx: ClaimContext) -> types.CallToolResult:
    # Tasks outlive a session: the caller stores the id and polls in later sessions.
    raise RemoteProtocolError("task handles are returned to the caller, not resolved in-session")


class _TasksExtension(ClientExtension):
    """Declares the extension per request and accepts `resultType: "task"` on tools/call."""

    identifier = TASKS_EXTENSION

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=_CreateTaskResult, resolve=_unresolvable)]


# --- public API ----------------------------------------------------------------------------------------


async def call_tool_async(server: ServerConfig, tool: str, arguments: dict[str, Any]) -> Completed | Created:
    """Call `tool`; the server answers with a plain result or a task handle to poll."""

    async def call(client: Client) -> Completed | Created:
        sent.append(True)
        answer = await client.session.call_tool(tool, arguments, allow_claimed=True, allow_input_required=True)
        if isinstance(answer, types.InputRequiredResult):
            raise RemoteProtocolError(f"MCP server {server.name!r}: tool {tool!r} asks for input before it starts, "
                                      "which Longhaul does not support")
        if isinstance(answer, _CreateTaskResult):
            return Created(_remote_task(server, answer.model_dump(by_alias=True, mode="json"), detailed=False))
        if isinstance(answer, types.CallToolResult):
            return Completed(_tool_result(answer.model_dump(by_alias=True, mode="json", exclude_none=True)))
        raise RemoteProtocolError(f"MCP server {server.name!r}: unexpected {type(answer).__name__} from tools/call")

    sent: list[bool] = []
    try:
        return await _session(server, f"tools/call {tool}", call)
    except RemoteUnavailable as exc:
        if not sent and not isinstance(exc, NotSent):
            raise NotSent(str(exc)) from exc
        raise


async def get_task_async(server: ServerConfig, task_id: str) -> RemoteTask:
    """The task's current status, with its result, error or input requests inline."""

    async def get(client: Client) -> RemoteTask:
        request = _TaskRequest(method="tasks/get", params={"taskId": task_id})
        raw = await client.session.send_request(request, _RawResult)
        return _remote_task(server, raw)

    return await _session(server, "tasks/get", get)


async def update_task_async(server: ServerConfig, task_id: str, responses: dict[str, dict[str, Any]]) -> None:
    """Answer the task's outstanding input requests (`responses` keyed like `InputRequest.key`)."""
    request = _TaskRequest(method="tasks/update", params={"taskId": task_id, "inputResponses": responses})

    async def update(client: Client) -> None:
        await client.session.send_request(request, _RawResult)

    await _session(server, "tasks/update", update)


async def cancel_task_async(server: ServerConfig, task_id: str) -> None:
    """Ask the server to cancel the task; cancellation is cooperative, so poll to see what happened."""

    async def cancel(client: Client) -> None:
        await client.session.send_request(_TaskRequest(method="tasks/cancel", params={"taskId": task_id}), _RawResult)

    await _session(server, "tasks/cancel", cancel)


async def list_tools_async(server: ServerConfig) -> list[dict[str, Any]]:
    """The server's tools as {name, description, inputSchema}, for the chat agent."""

    async def list_(client: Client) -> list[dict[str, Any]]:
        tools, cursor = [], None
        while True:
            page = await client.session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
            tools += [{"name": t.name, "description": t.description or "", "inputSchema": t.input_schema}
                      for t in page.tools]
            if not (cursor := page.next_cursor):
                return tools

    return await _session(server, "tools/list", list_)


# The synchronous twins, for code with no event loop: anyio.run fails inside a running loop, which is our bug.


def call_tool(server: ServerConfig, tool: str, arguments: dict[str, Any]) -> Completed | Created:
    return anyio.run(call_tool_async, server, tool, arguments)


def get_task(server: ServerConfig, task_id: str) -> RemoteTask:
    return anyio.run(get_task_async, server, task_id)


def update_task(server: ServerConfig, task_id: str, responses: dict[str, dict[str, Any]]) -> None:
    anyio.run(update_task_async, server, task_id, responses)


def cancel_task(server: ServerConfig, task_id: str) -> None:
    anyio.run(cancel_task_async, server, task_id)


def list_tools(server: ServerConfig) -> list[dict[str, Any]]:
    return anyio.run(list_tools_async, server)


def answer_for(request: InputRequest, text: str) -> dict[str, Any]:
    """The inputResponse accepting an elicitation with the user's free-text answer."""
    schema = request.schema or {}
    properties: dict[str, Any] = schema.get("properties") or {}
    strings = [name for name, prop in properties.items() if isinstance(prop, dict) and prop.get("type") == "string"]
    required = [name for name in schema.get("required") or [] if name in strings]
    target = strings[0] if len(strings) == 1 else (required[0] if required else None)
    if request.method != "elicitation/create" or target is None:
        raise RemoteProtocolError(f"input request {request.key!r} does not take a free-text answer")
    return {"action": "accept", "content": {target: text}}


# --- plumbing ------------------------------------------------------------------------------------------


async def _session(server: ServerConfig, what: str, body: Callable[[Client], Awaitable[_T]]) -> _T:
    """One session to the server running `body`, within `timeout_s`; failures classified as McpError."""
    http_statuses: list[int] = []  # error statuses seen, which the SDK folds into one JSON-RPC code
    try:
        with anyio.fail_after(server.timeout_s):
            client = Client(_transport(server, http_statuses), extensions=[_TasksExtension()], cache=None,
                            read_timeout_seconds=server.timeout_s)
            async with client:
                return await body(client)
    except McpError:
        raise
    except Exception as exc:
        error = _classify(server, what, exc, http_statuses[-1] if http_statuses else None)
        if error is None:
            raise
        raise error from exc


@asynccontextmanager
async def _http_transport(server: ServerConfig, statuses: list[int]) -> AsyncIterator[Any]:  # the SDK's stream pair
    async def record(response: httpx2.Response) -> None:
        if response.status_code >= 400:
            statuses.append(response.status_code)

    # Our own httpx2 client carries the headers; the SDK leaves closing a client it was given to us.
    async with httpx2.AsyncClient(headers=dict(server.headers), timeout=server.timeout_s,
                                  event_hooks={"response": [record]}) as http:
        async with streamable_http_client(server.url, http_client=http) as streams:
            yield streams


def _transport(server: ServerConfig, http_statuses: list[int]) -> Transport:
    if server.transport == "http":
        return _http_transport(server, http_statuses)
    if not server.command:
        raise RemoteProtocolError(f"MCP server {server.name!r}: no command configured")
    # The SDK passes only a few safe variables (PATH, HOME...) on; PYTHONPATH lets Python servers find their code.
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    params = StdioServerParameters(command=server.command[0], args=list(server.command[1:]),
                                   env=env | dict(server.env), cwd=server.cwd)
    return stdio_client(params)


def _leaf(exc: BaseException) -> BaseException:
    """The first real exception inside task-group wrappers."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


# JSON-RPC codes after which trying again later can work: internal error, the SDK's connection
# closed (-32000) and request timeout (-32001), and the rest of the implementation-defined range.
_TRANSIENT_CODES = {types.INTERNAL_ERROR, *range(-32019, -31999)}


def _classify(server: ServerConfig, what: str, exc: BaseException, http_status: int | None) -> McpError | None:
    """The McpError for a failure, or None for one that is a bug here rather than a remote problem."""
    exc = _leaf(exc)
    where = f"MCP server {server.name!r} ({what})"
    if isinstance(exc, McpError):
        return exc
    if isinstance(exc, MCPError) and exc.code == types.INTERNAL_ERROR and http_status is not None:
        # The SDK reports every HTTP error status as -32603; 401/403/400... will not get better by retrying.
        if http_status == 429:
            return NotSent(f"{where}: HTTP 429")
        if http_status == 408 or http_status >= 500:
            return RemoteUnavailable(f"{where}: HTTP {http_status}")
        return RemoteProtocolError(f"{where}: HTTP {http_status}")
    if isinstance(exc, MCPError):
        if exc.code == types.INVALID_PARAMS and what.startswith("tasks/"):
            # The spec's answer for an unknown or expired task id.
            return RemoteTaskNotFound(f"{where}: task not found: {exc.message}")
        if exc.code == types.INVALID_PARAMS and what.startswith("tools/call") and "unknown tool" in exc.message.lower():
            # -32602 also means "bad arguments"; only the message tells the two apart.
            return ToolNotFound(f"{where}: no such tool: {exc.message}")
        if exc.code in _TRANSIENT_CODES:
            return RemoteUnavailable(f"{where}: error {exc.code}: {exc.message}")
        return RemoteProtocolError(f"{where}: error {exc.code}: {exc.message}")
    if isinstance(exc, TimeoutError):
        return RemoteUnavailable(f"{where}: no answer within {server.timeout_s:g} s")
    if isinstance(exc, OSError | httpx2.TransportError | anyio.BrokenResourceError | anyio.ClosedResourceError
                  | anyio.EndOfStream):
        return RemoteUnavailable(f"{where}: connection failed: {type(exc).__name__}")
    if isinstance(exc, ValidationError | UnexpectedClaimedResult | RuntimeError | ValueError | KeyError):
        return RemoteProtocolError(f"{where}: malformed answer: {type(exc).__name__}")
    return None


def _remote_task(server: ServerConfig, raw: dict[str, Any], *, detailed: bool = True) -> RemoteTask:
    """A task from tasks/get (`detailed`: result, error or inputRequests inline) or from a tools/call handle,
    which carries only the status; the caller learns the rest from tasks/get."""
    try:
        status = raw["status"]
        if status not in ("working", "input_required", "completed", "failed", "cancelled"):
            raise ValueError(status)
        error = raw.get("error")
        requests = raw.get("inputRequests") or {} if status == "input_required" else {}
        return RemoteTask(
            task_id=str(raw["taskId"]),
            status=status,
            status_message=str(raw.get("statusMessage") or ""),
            poll_interval_ms=_int_or_none(raw.get("pollIntervalMs")),
            ttl_ms=_int_or_none(raw.get("ttlMs")),
            result=_tool_result(raw["result"]) if status == "completed" and (detailed or "result" in raw) else None,
            error=_error_message(raw, error) if status == "failed" else None,
            input_requests=tuple(_input_request(key, value) for key, value in requests.items()),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RemoteProtocolError(f"MCP server {server.name!r}: malformed task: {type(exc).__name__} {exc}") from exc


def _error_message(raw: dict[str, Any], error: Any) -> str:
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(raw.get("statusMessage") or "the remote task failed")


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _tool_result(raw: dict[str, Any]) -> ToolResult:
    content = list(raw.get("content") or [])
    structured = raw.get("structuredContent")
    return ToolResult(
        text="\n".join(part["text"] for part in content if part.get("type") == "text"),
        content=content,
        structured=structured if isinstance(structured, dict) else None,
        is_error=bool(raw.get("isError", False)),
    )


def _input_request(key: str, raw: dict[str, Any]) -> InputRequest:
    params = raw.get("params") or {}
    return InputRequest(key=key, method=str(raw["method"]), message=str(params.get("message") or ""),
                        schema=params.get("requestedSchema"), raw=raw)
