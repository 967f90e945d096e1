"""MCP requests as gateway operations (DESIGN §4, §10): what a step asks for, and how a gateway job runs it.

A step never talks to an MCP server. The `mcp` driver requests one of these operations in
the `mcp` pool; a gateway job runs it on its event loop beside its other calls (at most
LONGHAUL_MCP_CONCURRENCY at once per server) and records what came back on the row:

    tools/call    {server, tool, arguments[, input_responses, request_state]}
                  -> {"completed": result} | {"task": remote task} | {"input_needed": questions}
    tasks/get     {server, remote}            -> {"task": remote task} | {"gone": detail}
                                                 | {"protocol_error": what is wrong}
    tasks/update  {server, remote, responses} -> {"sent": [keys]}
    tasks/cancel  {server, remote[, abandon]} -> {"sent": true} | {"gone": detail}

A tools/call is requested `once`: it is repeated only when it provably was not sent (in
place, within the task's retry budget), and one whose gateway job died is failed, never run
again. The others are safe to repeat. Failures are recorded already classified:
TransientError when the server could not be reached, PermanentError otherwise; a malformed
answer to a poll is a result (`protocol_error`), so the step fails the task at once instead of
backing off as it does after an error.

What is stored is bounded and redacted here, where the server's configuration is known: the
remote task id, the configured server name, its URL, command and secrets never appear in a
stored text (`redact`); a tool's result keeps the server's name, a word it may well use. Texts:
status messages 500 characters, errors 4,000; a question (an input request) or the state a tool
that asks first wants back over 64 KiB is refused; a result over 64 KiB keeps a preview and says
so (`result_truncated`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings

from tasks.drivers import OpRequest
from tasks.errors import PermanentError, TransientError
from tasks.gateway.retry import RetryBudget, with_retries
from tasks.mcp import client, config, forms
from tasks.models import Task

KIND = "mcp"
CALL_TOOL = "tools/call"
GET = "tasks/get"
UPDATE = "tasks/update"
CANCEL = "tasks/cancel"
MAYBE_STARTED = ("the MCP server did not answer the tool call, so it may or may not have started the tool; "
                 "it was not called again, so that it cannot run twice")
STATUS_MESSAGE_CHARS = 500
ERROR_CHARS = 4_000
RESULT_MAX_BYTES = 64 * 1024  # a larger result keeps only its preview
QUESTION_MAX_BYTES = 64 * 1024  # a larger question fails the task
REQUEST_STATE_MAX_BYTES = 64 * 1024  # the state a tool that asks first wants back; a larger one fails the task
# A remote task id shorter than this is never replaced in a text: "42" or "job-7" is also a common number or
# word, and replacing every one of them would garble the text while hiding nothing worth hiding.
HANDLE_MIN_CHARS = 8
HANDLE = "[remote task]"
SERVER = "[server]"
# The keys of a question's schema whose strings the user sees: titles, descriptions and the choices.
SHOWN_SCHEMA_KEYS = ("title", "description", "enum", "enumNames", "const", "default")


# --- what a step asks for ---------------------------------------------------------------


def call_tool(server: str, tool: str, arguments: dict[str, Any], *, input_responses: dict[str, Any] | None = None,
              request_state: str | None = None) -> OpRequest:
    """The tool call; with `input_responses`, the call again with the answers to the questions it asked first."""
    args: dict[str, Any] = {"server": server, "tool": tool, "arguments": arguments}
    if input_responses is not None:
        args["input_responses"] = input_responses
        args["request_state"] = request_state
    return OpRequest(KIND, CALL_TOOL, args, once=True)


def get(server: str, remote: str, *, at: datetime | None = None) -> OpRequest:
    return OpRequest(KIND, GET, {"server": server, "remote": remote}, not_before=at)


def update(server: str, remote: str, responses: dict[str, dict[str, Any]]) -> OpRequest:
    return OpRequest(KIND, UPDATE, {"server": server, "remote": remote, "responses": responses})


def cancel(server: str, remote: str, *, at: datetime | None = None, abandon: bool = False) -> OpRequest:
    args: dict[str, Any] = {"server": server, "remote": remote}
    if abandon:
        args["abandon"] = True  # the task ended otherwise: this call belongs to its end, not to a step
    return OpRequest(KIND, CANCEL, args, not_before=at)


# --- redaction ----------------------------------------------------------------------------


def redact(text: str, *, handle: str | None = None, server: client.ServerConfig | str | None = None,
           limit: int | None = ERROR_CHARS, name: bool = True) -> str:
    """`text` without the remote task id (of HANDLE_MIN_CHARS or more) and the server's internals (configured
    name, URL, host, command, header and environment values), cut to `limit` characters.

    `name=False` keeps the configured name, for a tool's result: a server named "tools" says nothing
    secret, and its results may well use the word."""
    if not text:
        return ""
    replacements = [(token, SERVER) for token in _internals(server, name=name)]
    if handle and len(handle) >= HANDLE_MIN_CHARS:
        replacements.append((handle, HANDLE))
    # Longest first, so a URL goes as a whole before its host does.
    for token, mark in sorted(replacements, key=lambda pair: -len(pair[0])):
        text = re.sub(rf"(?<![\w.-]){re.escape(token)}(?![\w-])", mark, text)
    return text[:limit] if limit is not None else text


def _internals(server: client.ServerConfig | str | None, *, name: bool = True) -> list[str]:
    """The words that say which server this is (its configured name, unless not `name`), or how to reach it,
    and those its configuration lists."""
    if server is None:
        return []
    if isinstance(server, str):
        configured = config.servers().get(server)
        words = _internals(configured.config, name=name) if configured is not None else []
        return [server, *words] if name else words
    configured = config.servers().get(server.name)
    # Secrets go too, should a server echo them; short values ("1", "on") are words, not secrets.
    tokens = {v for v in (*server.headers.values(), *server.env.values()) if len(v) >= 8}
    if name:
        tokens.add(server.name)
    if server.url:
        parts = urlsplit(server.url)
        tokens |= {server.url, server.url.rstrip("/"), parts.netloc, parts.hostname or ""}
    if server.command:
        tokens.add(" ".join(server.command))
        # Paths and module names say where the server lives; short words ("stdio", "-m") say nothing.
        tokens |= {part for part in server.command if "/" in part or "." in part or len(part) >= 12}
    if server.cwd:
        tokens.add(server.cwd)
    if configured is not None and configured.config == server:
        tokens |= set(configured.redact)
    return [t for t in tokens if t and len(t) >= 2]


def _redact_strings(value: Any, scrub: Any, *, keys: tuple[str, ...] | None = None) -> Any:
    """`value` with its strings scrubbed; with `keys`, only the strings (or lists of strings) under those keys
    (a schema's titles and choices)."""
    if isinstance(value, dict):
        return {k: (_redact_strings(v, scrub) if keys is not None and k in keys and isinstance(v, str | list)
                    else scrub(v) if isinstance(v, str) and keys is None
                    else _redact_strings(v, scrub, keys=keys)) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_strings(v, scrub, keys=keys) for v in value]
    if isinstance(value, str) and keys is None:
        return scrub(value)
    return value


# --- what a gateway job does ------------------------------------------------------------


async def run(name: str, args: dict[str, Any], *, task_id: int, budget: RetryBudget) -> dict[str, Any]:
    """Run one MCP operation; its result as stored, or a classified StepError."""
    server = await sync_to_async(_server_for)(task_id, args["server"])
    if name == CALL_TOOL:
        return await with_retries(lambda: _call_tool(server, args), budget=budget, retry_on=(TransientError,))
    if name == GET:
        return await _get(server, args["remote"])
    if name == UPDATE:
        return await with_retries(lambda: _update(server, args), budget=budget, retry_on=(TransientError,))
    if name == CANCEL:
        return await _cancel(server, args["remote"])
    raise PermanentError(f"unknown MCP operation {name!r}")


def _server_for(task_id: int, name: str) -> client.ServerConfig:
    """The server as configured now, if the task's workspace may still use it."""
    slug = _tenant_slug(task_id)
    server = config.servers().get(name)
    if server is None or slug is None or not server.allows(slug):
        raise PermanentError("the MCP server is no longer configured for this workspace")
    return server.config


def _tenant_slug(task_id: int) -> str | None:
    return Task.objects.filter(pk=task_id).values_list("tenant__slug", flat=True).first()


def _said(exc: BaseException, server: client.ServerConfig, handle: str | None = None) -> str:
    """What the server (or the connection) said, fit to store."""
    return redact(str(exc), handle=handle, server=server, limit=1_000)


async def _call_tool(server: client.ServerConfig, args: dict[str, Any]) -> dict[str, Any]:
    tool = args["tool"]
    answers: dict[str, Any] = {}
    if "input_responses" in args:  # only then: a server gets the keywords it was asked with
        answers = {"input_responses": args["input_responses"], "request_state": args.get("request_state")}
    try:
        answer = await client.call_tool_async(server, tool, args["arguments"], **answers)
    except client.NotSent as exc:
        raise TransientError("the MCP server could not be reached, so the tool was not called",
                             detail=str(exc)) from None
    except client.RemoteUnavailable as exc:
        raise PermanentError(MAYBE_STARTED, detail=str(exc)) from None
    except client.ToolNotFound as exc:
        raise PermanentError(f"the MCP server has no tool {tool!r}", detail=str(exc)) from None
    except client.MalformedAnswer as exc:
        raise PermanentError(f"protocol error: the MCP server's answer to the tool call is malformed "
                             f"({_said(exc, server)})", detail=str(exc)) from None
    except client.McpError as exc:
        # Its words help the owner fix the arguments; no remote task exists yet to leak an id of.
        raise PermanentError(f"the MCP server refused the tool call: {_said(exc, server)}", detail=str(exc)) from None
    if isinstance(answer, client.Completed):
        return {"completed": tool_result(answer.result, server=server)}
    if isinstance(answer, client.Created):
        return {"task": remote_task(answer.task, server=server)}
    # InputNeeded: the server asks before it creates any task; the step asks the owner.
    state_size = len(answer.request_state.encode()) if answer.request_state is not None else 0
    if state_size > REQUEST_STATE_MAX_BYTES:
        # It would be stored (operation result, checkpoint) until the call is made again.
        raise PermanentError(f"protocol error: the remote tool asked to keep a state of {state_size // 1024} KiB, "
                             f"over the limit of {REQUEST_STATE_MAX_BYTES // 1024} KiB")
    try:
        questions = input_requests(answer.requests, server=server)
    except TooBig as exc:
        raise PermanentError(str(exc)) from None
    return {"input_needed": {"requests": questions, "request_state": answer.request_state}}


async def _get(server: client.ServerConfig, remote: str) -> dict[str, Any]:
    try:
        return {"task": remote_task(await client.get_task_async(server, remote), server=server)}
    except client.RemoteTaskNotFound as exc:
        return {"gone": _said(exc, server, remote)}
    except client.MalformedAnswer as exc:
        return {"protocol_error": f"protocol error: the MCP server's answer to a poll is malformed "
                                  f"({_said(exc, server, remote)})"}
    except TooBig as exc:
        return {"protocol_error": str(exc)}
    except client.RemoteUnavailable as exc:
        raise TransientError(f"the MCP server is not reachable: {_said(exc, server, remote)}",
                             detail=str(exc)) from None
    except client.McpError as exc:
        # A 401 after a token rotation...: the step backs off and polls again.
        raise PermanentError(f"the MCP server answered the poll with an error: {_said(exc, server, remote)}",
                             detail=str(exc)) from None


async def _update(server: client.ServerConfig, args: dict[str, Any]) -> dict[str, Any]:
    remote = args["remote"]
    try:
        await client.update_task_async(server, remote, args["responses"])
    except client.RemoteUnavailable as exc:
        # Safe to send again: a server ignores responses to questions no longer open.
        raise TransientError(f"the MCP server could not be reached to send the answer: {_said(exc, server, remote)}",
                             detail=str(exc)) from None
    except client.McpError as exc:
        # The spec's "invalid params" covers both a gone task and a refused answer.
        raise PermanentError("the remote tool refused the answer, or no longer knows the task: "
                             f"{_said(exc, server, remote)}", detail=str(exc)) from None
    return {"sent": sorted(args["responses"])}


async def _cancel(server: client.ServerConfig, remote: str) -> dict[str, Any]:
    try:
        await client.cancel_task_async(server, remote)
    except client.RemoteTaskNotFound as exc:
        return {"gone": _said(exc, server, remote)}  # or a refusal: a poll tells which
    except client.RemoteUnavailable as exc:
        raise TransientError(f"the server did not answer: {_said(exc, server, remote)}", detail=str(exc)) from None
    except client.McpError as exc:
        raise PermanentError(f"the server refused the cancel: {_said(exc, server, remote)}", detail=str(exc)) from None
    return {"sent": True}


# --- what is stored -----------------------------------------------------------------------


class TooBig(Exception):
    """A question over QUESTION_MAX_BYTES: refused, never stored."""


def remote_task(task: client.RemoteTask, *, server: client.ServerConfig) -> dict[str, Any]:
    handle = task.task_id

    def scrub(text: str) -> str:
        return redact(text, handle=handle, server=server, limit=None)

    return {
        "task_id": handle,
        "status": task.status,
        "status_message": scrub(task.status_message or "")[:STATUS_MESSAGE_CHARS],
        "poll_interval_ms": task.poll_interval_ms,
        "result": tool_result(task.result, server=server, handle=handle) if task.result is not None else None,
        "error": scrub(task.error or "")[:ERROR_CHARS] or None,
        "input_requests": input_requests(task.input_requests, server=server, handle=handle),
    }


def input_requests(requests: Iterable[client.InputRequest], *, server: client.ServerConfig,
                   handle: str | None = None) -> list[dict[str, Any]]:
    """The questions as stored (redacted; the raw request is not kept); TooBig for one over 64 KiB."""

    def scrub(text: str) -> str:
        return redact(text, handle=handle, server=server, limit=None)

    stored = []
    for r in requests:
        # The raw request holds the message and the schema: measured once.
        size = len(json.dumps(r.raw, default=str).encode())
        if size > QUESTION_MAX_BYTES:
            raise TooBig(f"protocol error: the remote tool asked a question of {size // 1024} KiB, "
                         f"over the limit of {QUESTION_MAX_BYTES // 1024} KiB")
        schema = _redact_strings(r.schema, scrub, keys=SHOWN_SCHEMA_KEYS) if r.schema else r.schema
        # Stored as jsonb, which sorts keys: the schema keeps its fields' order beside them.
        stored.append({"key": r.key, "method": r.method, "message": scrub(r.message),
                       "schema": forms.keeping_order(schema)})
    return stored


def tool_result(result: client.ToolResult | None, *, server: client.ServerConfig,
                handle: str | None = None) -> dict[str, Any]:
    """What the task keeps of a tool's result: all of it up to 64 KiB; past that a preview, saying so.
    Scrubbed of the handle and how to reach the server, not of the server's name (see `redact`)."""

    def scrub(text: str) -> str:
        return redact(text, handle=handle, server=server, limit=None, name=False)

    text = scrub(result.text if result else "")
    structured = result.structured if result else None
    if structured is not None:
        structured = _redact_strings(structured, scrub)
    size = len(text.encode()) + (len(json.dumps(structured).encode()) if structured is not None else 0)
    too_big = size > RESULT_MAX_BYTES
    preview = text[:settings.LONGHAUL_MCP_RESULT_PREVIEW_CHARS]
    return {
        "summary": preview,  # what the panel and the chat show first
        "text": preview if too_big else text,
        "chars": len(text),
        "bytes": size,
        "truncated": too_big,
        "result_truncated": too_big,
        "structured": None if too_big else structured,
        "is_error": bool(result and result.is_error),
    }
