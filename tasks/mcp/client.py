"""The requester side of the MCP Tasks extension (io.modelcontextprotocol/tasks, 2026-07-28); the only module
that speaks MCP.

Each request has an async function (`call_tool_async`...), which a gateway job awaits on its event loop
beside its other calls, and a synchronous twin (`call_tool`...) for code with no event loop (the chat
agent's tool list, tests). Both run the request on the server's long-lived session (tasks/mcp/sessions.py:
one per server and process, on a background event loop; for stdio, one server process), which is opened
on first use and opened again when it breaks: a request that finds its session broken is sent once more
on a fresh one, if it is safe to repeat or provably was not sent. A message the server writes that is not
JSON-RPC fails only the call it answers (`MalformedAnswer`), when that can be told (it names the request,
or one call alone awaits an answer); otherwise it breaks the session, and every call awaiting an answer
raises `RemoteUnavailable`, not sent again at once. Each call finishes within the server's
`timeout_s`. Every request declares the `elicitation` capability (a strict server refuses tools that ask
for input otherwise); questions reach the user through the task (`InputNeeded`, `tasks/get`), never
in-session. Failures raise one of the `McpError` subclasses below; callers decide retry or failure by type.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeVar

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.extension import ClientExtension, UnexpectedClaimedResult
from mcp.client.session import ClientRequestContext
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import TypeAdapter, ValidationError

from tasks.mcp import sessions

log = logging.getLogger(__name__)
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
TASKS_EXTENSION_VERSION = "2026-07-28"
# Recorded on mcp tasks and on each of their calls.
TOOL_PROTOCOL = f"{TASKS_EXTENSION}@{TASKS_EXTENSION_VERSION}"
TASK_STATUSES = ("working", "input_required", "completed", "failed", "cancelled")
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


@dataclass(frozen=True)
class InputNeeded:
    """The tool asks before it starts: call it again with `input_responses` (keyed like the requests) and
    `request_state` echoed. `requests` may be empty when the server only wants the state back."""

    requests: tuple[InputRequest, ...]
    request_state: str | None


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


class MalformedAnswer(RemoteProtocolError):
    """Permanent: the server's answer breaks the protocol (not JSON, a non-finite number, a wrong type, an
    unknown status, a missing field). Asking again would not help."""


class ToolNotFound(McpError):
    """The server has no tool of that name."""


# --- wire shapes ---------------------------------------------------------------------------------------


class _TaskRequest(types.Request[dict[str, Any], str]):
    # Over streamable HTTP the spec routes tasks/* by an Mcp-Name header carrying the task id.
    name_param = "taskId"


_RawResult: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


class _TasksExtension(ClientExtension):
    """Declares the Tasks extension on every request; a tools/call may then answer with a task handle."""

    identifier = TASKS_EXTENSION


async def _decline(context: ClientRequestContext, params: Any) -> types.ElicitResult:
    # Declaring elicitation is what lets a server ask at all; Longhaul asks its user through the task
    # (tasks/get, InputNeeded), so a question sent inside a session is declined.
    return types.ElicitResult(action="decline")


# --- public API ----------------------------------------------------------------------------------------


async def call_tool_async(server: ServerConfig, tool: str, arguments: dict[str, Any], *,
                          input_responses: dict[str, dict[str, Any]] | None = None,
                          request_state: str | None = None) -> Completed | Created | InputNeeded:
    """Call `tool`: a plain result, a task handle to poll, or questions to answer before it starts."""
    return await sessions.run(_call_tool(server, tool, arguments, input_responses, request_state))


async def get_task_async(server: ServerConfig, task_id: str) -> RemoteTask:
    """The task's current status, with its result, error or input requests inline."""
    return await sessions.run(_get_task(server, task_id))


async def update_task_async(server: ServerConfig, task_id: str, responses: dict[str, dict[str, Any]]) -> None:
    """Answer the task's outstanding input requests (`responses` keyed like `InputRequest.key`)."""
    await sessions.run(_update_task(server, task_id, responses))


async def cancel_task_async(server: ServerConfig, task_id: str) -> None:
    """Ask the server to cancel the task; cancellation is cooperative, so poll to see what happened."""
    await sessions.run(_cancel_task(server, task_id))


async def list_tools_async(server: ServerConfig) -> list[dict[str, Any]]:
    """The server's tools as {name, description, inputSchema}, for the chat agent."""
    return await sessions.run(_list_tools(server))


# The synchronous twins, for code with no event loop; they wait for the sessions loop.


def call_tool(server: ServerConfig, tool: str, arguments: dict[str, Any], *,
              input_responses: dict[str, dict[str, Any]] | None = None,
              request_state: str | None = None) -> Completed | Created | InputNeeded:
    return sessions.run_sync(_call_tool(server, tool, arguments, input_responses, request_state))


def get_task(server: ServerConfig, task_id: str) -> RemoteTask:
    return sessions.run_sync(_get_task(server, task_id))


def update_task(server: ServerConfig, task_id: str, responses: dict[str, dict[str, Any]]) -> None:
    sessions.run_sync(_update_task(server, task_id, responses))


def cancel_task(server: ServerConfig, task_id: str) -> None:
    sessions.run_sync(_cancel_task(server, task_id))


def list_tools(server: ServerConfig) -> list[dict[str, Any]]:
    return sessions.run_sync(_list_tools(server))


# --- the requests (run on the sessions loop) -----------------------------------------------------------


async def _call_tool(server: ServerConfig, tool: str, arguments: dict[str, Any],
                     input_responses: dict[str, dict[str, Any]] | None, request_state: str | None
                     ) -> Completed | Created | InputNeeded:
    request = types.CallToolRequest(params=types.CallToolRequestParams(
        name=tool, arguments=arguments, input_responses=input_responses, request_state=request_state))

    async def call(client: Client) -> Completed | Created | InputNeeded:
        return _call_answer(server, await client.session.send_request(request, _RawResult))

    # A tool call is repeated on a fresh session only when it provably was not sent: it may not be idempotent.
    return await _on_session(server, f"tools/call {tool}", call, repeatable=False)


async def _get_task(server: ServerConfig, task_id: str) -> RemoteTask:
    async def get(client: Client) -> RemoteTask:
        request = _TaskRequest(method="tasks/get", params={"taskId": task_id})
        return _remote_task(server, "tasks/get", await client.session.send_request(request, _RawResult))

    return await _on_session(server, "tasks/get", get)


async def _update_task(server: ServerConfig, task_id: str, responses: dict[str, dict[str, Any]]) -> None:
    request = _TaskRequest(method="tasks/update", params={"taskId": task_id, "inputResponses": responses})

    async def update(client: Client) -> None:
        _require_finite(server, "tasks/update", await client.session.send_request(request, _RawResult))

    # Safe to repeat: a server ignores responses to questions no longer outstanding.
    await _on_session(server, "tasks/update", update)


async def _cancel_task(server: ServerConfig, task_id: str) -> None:
    async def cancel(client: Client) -> None:
        request = _TaskRequest(method="tasks/cancel", params={"taskId": task_id})
        _require_finite(server, "tasks/cancel", await client.session.send_request(request, _RawResult))

    await _on_session(server, "tasks/cancel", cancel)


async def _list_tools(server: ServerConfig) -> list[dict[str, Any]]:
    async def list_(client: Client) -> list[dict[str, Any]]:
        tools, cursor = [], None
        while True:
            page = await client.session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
            tools += [{"name": t.name, "description": t.description or "", "inputSchema": t.input_schema}
                      for t in page.tools]
            if not (cursor := page.next_cursor):
                return tools

    return await _on_session(server, "tools/list", list_)


# --- sessions ------------------------------------------------------------------------------------------


@dataclass
class _Attempt:
    """What one request did on the wire, noted by the transport wrappers running in the request's context."""

    written: bool = False  # the request went onto the transport, so the server may have it
    refused: bool = False  # http: the connection was refused, so it did not
    http_status: int | None = None  # the last error status, which the SDK folds into one JSON-RPC code
    scope: anyio.CancelScope | None = None  # the call on its session (None: the session's own opening)
    done: bool = False  # the call ended; an answer arriving now concerns no call
    malformed: MalformedAnswer | None = None  # the answer to this call, and only this one, broke the protocol
    cut_off: bool = False  # a message no request could be matched to broke the session while this call waited


_attempt: ContextVar[_Attempt | None] = ContextVar("mcp_attempt", default=None)


async def _on_session(server: ServerConfig, what: str, body: Callable[[Client], Awaitable[_T]], *,
                      repeatable: bool = True) -> _T:
    """`body` on the server's session within `timeout_s`; failures classified as McpError.

    A session found broken is replaced and the request sent once more on the new one, when it is
    `repeatable` or provably was not sent."""
    attempt = _Attempt()
    session: sessions.Session[Client] | None = None
    try:
        with anyio.fail_after(server.timeout_s):
            for last_try in (False, True):
                _attempt.set(None)  # a session opened now must not note its own requests in this call's attempt
                try:
                    session = await sessions.get(_key(server), lambda s: _open(server, s), timeout_s=server.timeout_s,
                                                 name=server.name)
                except McpError as exc:
                    raise (NotSent(str(exc)) if type(exc) is RemoteUnavailable else exc) from exc.__cause__
                attempt = _Attempt()
                _attempt.set(attempt)
                try:
                    with session.call() as scope:
                        attempt.scope = scope
                        return await body(session.client)  # type: ignore[arg-type]
                    # Only a malformed answer to this call (`_InFlight.unreadable`) or `session.fail` cancels
                    # the call's scope: its answer broke the protocol, or the session broke under it.
                    if attempt.malformed is not None:
                        raise attempt.malformed
                    error: BaseException = session.error or RuntimeError("the MCP session closed")
                except McpError:
                    raise
                except Exception as exc:  # noqa: BLE001 - classified below; what is not remote is re-raised
                    error = exc
                finally:
                    attempt.done = True
                classified = _classify(server, what, error, attempt.http_status)
                if classified is None:
                    raise error
                not_sent = not attempt.written or attempt.refused
                if _breaks_session(error):
                    session.fail(classified)
                    # A call cut off by a server that writes garbage is not sent again at once, where the
                    # garbage would cut off the calls on the next session too: its caller retries later.
                    if not last_try and not attempt.cut_off and (repeatable or not_sent):
                        continue
                if not_sent and type(classified) is RemoteUnavailable:
                    raise NotSent(str(classified)) from error
                raise classified from error
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
    except TimeoutError as exc:
        if session is not None:
            session.retire()  # a server that hangs gets a fresh session (for stdio, process) next time
        error_class = NotSent if not attempt.written else RemoteUnavailable
        raise error_class(f"MCP server {server.name!r} ({what}): no answer within {server.timeout_s:g} s") from exc


def _key(server: ServerConfig) -> tuple[Any, ...]:
    """A server's session key: every setting, so a changed config gets a fresh session. Name first."""
    return (server.name, server.transport, server.command, tuple(sorted(server.env.items())), server.cwd,
            server.url, tuple(sorted(server.headers.items())), server.timeout_s)


@asynccontextmanager
async def _open(server: ServerConfig, session: sessions.Session[Client]) -> AsyncIterator[Client]:
    """A connected Client for `server`; runs in the session's runner task."""
    opening = _Attempt()
    _attempt.set(opening)
    in_flight = _InFlight(server, session)
    client = Client(_watched(_transport(server), in_flight), extensions=[_TasksExtension()], cache=None,
                    elicitation_callback=_decline)
    try:
        await client.__aenter__()
    except Exception as exc:
        raise _classify(server, "connect", exc, opening.http_status) or exc from exc
    opening.done = True
    try:
        yield client
    finally:
        await client.__aexit__(None, None, None)


class _InFlight:
    """One session's requests still awaiting their answers, by JSON-RPC id, each with the call that sent it;
    so that a message the transport cannot read fails only the call it answers, when that can be told."""

    def __init__(self, server: ServerConfig, session: sessions.Session[Client]) -> None:
        self.server = server
        self.session = session
        self._waiting: dict[str, _Attempt] = {}

    def sent(self, request_id: Any, attempt: _Attempt) -> None:
        # Calls that ended unanswered (timed out, cancelled) are forgotten here.
        self._waiting = {key: a for key, a in self._waiting.items() if not a.done}
        self._waiting[_id_key(request_id)] = attempt

    def received(self, item: Any) -> None:
        """Note an incoming message: an answer, or a failure to read one."""
        if isinstance(item, Exception):
            self._unreadable(item)
            return
        message = getattr(item, "message", None)
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError) and message.id is not None:
            self._waiting.pop(_id_key(message.id), None)

    def _unreadable(self, exc: Exception) -> None:
        where = f"MCP server {self.server.name!r}"
        if not isinstance(exc, ValueError):
            self.session.fail(RemoteUnavailable(f"{where}: the connection failed: {type(exc).__name__}"))
            return
        waiting = {key: a for key, a in self._waiting.items() if not a.done}
        named = _answered_id(exc)
        if named is not None:
            owner = waiting.get(named)
            if owner is None:
                log.info("%s: a malformed answer to a request no call awaits any more; ignored", where)
                return
        elif len({id(a) for a in waiting.values()}) == 1:
            # Not even JSON, yet a server only answers what it is asked, and one call alone awaits an answer.
            owner = next(iter(waiting.values()))
        else:
            # Any of the waiting calls may have lost its answer, and the stream may be out of step: every call
            # in flight ends, as after a dropped connection (a transient failure), and the session is replaced.
            for attempt in waiting.values():
                attempt.cut_off = True
            self.session.fail(RemoteUnavailable(f"{where}: the connection failed: a message that is not JSON-RPC "
                                                 "and cannot be matched to a request"))
            return
        self._waiting = {key: a for key, a in self._waiting.items() if a is not owner}
        malformed = MalformedAnswer(f"{where}: malformed answer: a message that is not JSON-RPC")
        if owner.scope is None:  # the answer to the session's own opening request
            self.session.fail(malformed)
            return
        owner.malformed = malformed
        owner.scope.cancel()


def _id_key(request_id: Any) -> str:
    return str(request_id)


def _answered_id(exc: ValueError) -> str | None:
    """The request id a message the transport could not read answers, if it is JSON and names one."""
    if not isinstance(exc, ValidationError):
        return None
    for error in exc.errors():
        message = error.get("input")
        # The whole message is the input of the union's "field missing" errors, one level down.
        if len(error.get("loc") or ()) <= 2 and isinstance(message, dict) and "method" not in message \
                and ("result" in message or "error" in message):
            request_id = message.get("id")
            if isinstance(request_id, int | str) and not isinstance(request_id, bool):
                return _id_key(request_id)
    return None


@asynccontextmanager
async def _watched(transport: Any, in_flight: _InFlight) -> AsyncIterator[tuple[Any, Any]]:
    """The transport's streams, noting what is sent and received in `in_flight`."""
    async with transport as (read_stream, write_stream):
        yield _WatchedReads(read_stream, in_flight), _WatchedWrites(write_stream, in_flight)


class _WatchedReads:
    """A transport's read stream that notes each message in `in_flight` before the session sees it."""

    def __init__(self, inner: Any, in_flight: _InFlight) -> None:
        self.inner = inner
        self.in_flight = in_flight

    async def receive(self) -> Any:
        item = await self.inner.receive()
        self.in_flight.received(item)
        return item

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # e.g. `last_context`, which the SDK reads after each receive

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> bool | None:
        return await self.inner.__aexit__(*exc_info)


class _WatchedWrites:
    """A transport's write stream that notes, in the sending request's attempt, that a request went out, and
    in `in_flight` which call awaits its answer."""

    def __init__(self, inner: Any, in_flight: _InFlight) -> None:
        self.inner = inner
        self.in_flight = in_flight

    async def send(self, item: Any) -> None:
        attempt = _attempt.get()
        message = getattr(item, "message", None)
        is_request = isinstance(message, types.JSONRPCRequest)
        written = attempt.written if attempt is not None else False
        if attempt is not None and is_request:
            attempt.written = True  # a send that is interrupted may still have delivered
            self.in_flight.sent(message.id, attempt)
        try:
            await self.inner.send(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            if attempt is not None:
                attempt.written = written
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> bool | None:
        return await self.inner.__aexit__(*exc_info)


class _RefusalsNoted(httpx2.AsyncBaseTransport):
    """The HTTP transport, noting a refused connection in the sending request's attempt."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            return await self.inner.handle_async_request(request)
        except httpx2.ConnectError:
            if (attempt := _attempt.get()) is not None:
                attempt.refused = True
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def _http_transport(server: ServerConfig) -> AsyncIterator[Any]:  # the SDK's stream pair
    async def record(response: httpx2.Response) -> None:
        if response.status_code >= 400 and (attempt := _attempt.get()) is not None:
            attempt.http_status = response.status_code

    # Our own httpx2 client carries the headers; the SDK leaves closing a client it was given to us.
    http = httpx2.AsyncClient(headers=dict(server.headers), timeout=server.timeout_s,
                              transport=_RefusalsNoted(httpx2.AsyncHTTPTransport()), event_hooks={"response": [record]})
    async with http, streamable_http_client(server.url, http_client=http) as streams:
        yield streams


def _transport(server: ServerConfig) -> Any:  # an mcp.client.Transport
    if server.transport == "http":
        return _http_transport(server)
    if not server.command:
        raise RemoteProtocolError(f"MCP server {server.name!r}: no command configured")
    # The SDK passes only a few safe variables (PATH, HOME...) on; PYTHONPATH lets Python servers find their code.
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    params = StdioServerParameters(command=server.command[0], args=list(server.command[1:]),
                                   env=env | dict(server.env), cwd=server.cwd)
    return stdio_client(params)


# --- failures ------------------------------------------------------------------------------------------


def _leaf(exc: BaseException) -> BaseException:
    """The first real exception inside task-group wrappers."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


# JSON-RPC codes after which trying again later can work: internal error, the SDK's connection
# closed (-32000) and request timeout (-32001), and the rest of the implementation-defined range.
_TRANSIENT_CODES = {types.INTERNAL_ERROR, *range(-32019, -31999)}
_BROKEN = (OSError, httpx2.TransportError, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream)


def _breaks_session(exc: BaseException) -> bool:
    """Whether a failure means the connection is gone (as opposed to one request failing)."""
    exc = _leaf(exc)
    if isinstance(exc, MCPError):
        return exc.code == types.CONNECTION_CLOSED
    return isinstance(exc, (*_BROKEN, RemoteUnavailable))


def _names_a_missing_task(message: str) -> bool:
    message = message.lower()
    return any(words in message for words in ("not found", "expired", "unknown task", "no such task"))


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
        if exc.code == types.PARSE_ERROR:
            # What the HTTP transport answers for a body that is not JSON.
            return MalformedAnswer(f"{where}: malformed answer: not JSON")
        if exc.code == types.INVALID_PARAMS and what.startswith("tasks/") and _names_a_missing_task(exc.message):
            # The spec's answer for an unknown or expired task id; -32602 also means "bad params" (an answer
            # that does not fit the question), which only the message tells apart.
            return RemoteTaskNotFound(f"{where}: task not found: {exc.message}")
        if exc.code == types.INVALID_PARAMS and what.startswith("tools/call") and "unknown tool" in exc.message.lower():
            # -32602 also means "bad arguments"; only the message tells the two apart.
            return ToolNotFound(f"{where}: no such tool: {exc.message}")
        if exc.code in _TRANSIENT_CODES:
            return RemoteUnavailable(f"{where}: error {exc.code}: {exc.message}")
        return RemoteProtocolError(f"{where}: error {exc.code}: {exc.message}")
    if isinstance(exc, TimeoutError):
        return RemoteUnavailable(f"{where}: no answer within {server.timeout_s:g} s")
    if isinstance(exc, _BROKEN):
        return RemoteUnavailable(f"{where}: connection failed: {type(exc).__name__}")
    if isinstance(exc, ValidationError | UnexpectedClaimedResult | ValueError | KeyError | TypeError | OverflowError):
        return MalformedAnswer(f"{where}: malformed answer: {type(exc).__name__}")
    if isinstance(exc, RuntimeError):  # the SDK's word for a server it cannot work with (no common version...)
        return RemoteProtocolError(f"{where}: {exc}")
    return None


# --- answers -------------------------------------------------------------------------------------------


def _malformed(server: ServerConfig, what: str, problem: str) -> MalformedAnswer:
    return MalformedAnswer(f"MCP server {server.name!r} ({what}): malformed answer: {problem}")


def _require_finite(server: ServerConfig, what: str, raw: Any) -> None:
    """Refuse NaN and infinities anywhere in an answer: JSON has none, but parsers accept NaN and 1e999."""
    stack = [raw]
    while stack:
        value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise _malformed(server, what, f"a non-finite number ({value})")
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _call_answer(server: ServerConfig, raw: dict[str, Any]) -> Completed | Created | InputNeeded:
    what = "tools/call"
    _require_finite(server, what, raw)
    kind = raw.get("resultType", "complete")
    if kind == "task":
        return Created(_remote_task(server, what, raw, detailed=False))
    if kind == "input_required":
        requests, state = raw.get("inputRequests") or {}, raw.get("requestState")
        if not isinstance(requests, dict) or (state is not None and not isinstance(state, str)):
            raise _malformed(server, what, "inputRequests must be an object and requestState text")
        if not requests and state is None:
            raise _malformed(server, what, "an input-required result without inputRequests or requestState")
        return InputNeeded(tuple(_input_request(server, what, key, value) for key, value in requests.items()), state)
    if kind != "complete":
        raise _malformed(server, what, f"unknown resultType {str(kind)[:40]!r}")
    try:
        types.CallToolResult.model_validate(raw, by_name=False)
    except ValidationError as exc:
        raise _malformed(server, what, f"not a tool result ({exc.error_count()} problems)") from None
    return Completed(_tool_result(server, what, raw))


def _remote_task(server: ServerConfig, what: str, raw: dict[str, Any], *, detailed: bool = True) -> RemoteTask:
    """A task from tasks/get (`detailed`: result, error or inputRequests inline) or from a tools/call handle,
    which carries only the status; the caller learns the rest from tasks/get. Checked field by field."""
    _require_finite(server, what, raw)
    task_id, status, message = raw.get("taskId"), raw.get("status"), raw.get("statusMessage")
    if not isinstance(task_id, str) or not task_id:
        raise _malformed(server, what, "taskId must be non-empty text")
    if status not in TASK_STATUSES:
        shown = repr(status)[:40] if isinstance(status, str) else f"of type {type(status).__name__}"
        raise _malformed(server, what, f"status {shown} is not a task status")
    if message is not None and not isinstance(message, str):
        raise _malformed(server, what, "statusMessage must be text")
    result = raw.get("result")
    if status == "completed" and (detailed or result is not None) and not isinstance(result, dict):
        raise _malformed(server, what, "a completed task without its result")
    requests = raw.get("inputRequests") or {} if status == "input_required" else {}
    if not isinstance(requests, dict):
        raise _malformed(server, what, "inputRequests must be an object")
    return RemoteTask(
        task_id=task_id,
        status=status,
        status_message=message or "",
        poll_interval_ms=_whole(server, what, raw, "pollIntervalMs"),
        ttl_ms=_whole(server, what, raw, "ttlMs"),
        result=_tool_result(server, what, result) if status == "completed" and isinstance(result, dict) else None,
        error=_error_message(raw) if status == "failed" else None,
        input_requests=tuple(_input_request(server, what, key, value) for key, value in requests.items()),
    )


def _whole(server: ServerConfig, what: str, raw: dict[str, Any], name: str) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        raise _malformed(server, what, f"{name} must be a whole number of milliseconds")
    return int(value)


def _error_message(raw: dict[str, Any]) -> str:
    error = raw.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    return str(raw.get("statusMessage") or "the remote task failed")


def _tool_result(server: ServerConfig, what: str, raw: dict[str, Any]) -> ToolResult:
    content = raw.get("content") or []
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise _malformed(server, what, "a result's content must be a list of objects")
    texts = [part.get("text") for part in content if part.get("type") == "text"]
    if not all(isinstance(text, str) for text in texts):
        raise _malformed(server, what, "a text part without text")
    structured = raw.get("structuredContent")
    return ToolResult(
        text="\n".join(texts),  # type: ignore[arg-type]
        content=list(content),
        structured=structured if isinstance(structured, dict) else None,
        is_error=raw.get("isError") is True,
    )


def _input_request(server: ServerConfig, what: str, key: str, raw: Any) -> InputRequest:
    if not isinstance(raw, dict) or not isinstance(raw.get("method"), str):
        raise _malformed(server, what, f"input request {key[:40]!r} has no method")
    params = raw.get("params") or {}
    if not isinstance(params, dict):
        raise _malformed(server, what, f"input request {key[:40]!r}: params must be an object")
    schema = params.get("requestedSchema")
    return InputRequest(key=key, method=raw["method"], message=str(params.get("message") or ""),
                        schema=schema if isinstance(schema, dict) else None, raw=raw)
