"""MCP requests as gateway operations (DESIGN §4, §10): what a step asks for, and how a gateway job runs it.

A step never talks to an MCP server. The `mcp` driver requests one of these operations in
the `mcp` pool; a gateway job runs it on its event loop beside its other calls (at most
LONGHAUL_MCP_CONCURRENCY at once per server) and records what came back on the row:

    tools/call    {server, tool, arguments}   -> {"completed": result} | {"task": remote task}
    tasks/get     {server, remote}            -> {"task": remote task} | {"gone": detail}
    tasks/update  {server, remote, responses} -> {"sent": [keys]}
    tasks/cancel  {server, remote[, abandon]} -> {"sent": true} | {"gone": detail}

A tools/call is requested `once`: it is repeated only when it provably was not sent (in
place, within the task's retry budget), and one whose gateway job died is failed, never run
again. The others are safe to repeat. Failures are recorded already classified:
TransientError when the server could not be reached, PermanentError otherwise. Results and
texts are bounded before they are stored.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from tasks.drivers import OpRequest
from tasks.errors import PermanentError, TransientError
from tasks.gateway.retry import RetryBudget, with_retries
from tasks.mcp import client, config
from tasks.models import Task

KIND = "mcp"
CALL_TOOL = "tools/call"
GET = "tasks/get"
UPDATE = "tasks/update"
CANCEL = "tasks/cancel"
MAYBE_STARTED = ("the MCP server did not answer the tool call, so it may or may not have started the tool; "
                 "it was not called again, so that it cannot run twice")
STATUS_MESSAGE_CHARS = 500


# --- what a step asks for ---------------------------------------------------------------


def call_tool(server: str, tool: str, arguments: dict[str, Any]) -> OpRequest:
    return OpRequest(KIND, CALL_TOOL, {"server": server, "tool": tool, "arguments": arguments}, once=True)


def get(server: str, remote: str, *, at: datetime | None = None) -> OpRequest:
    return OpRequest(KIND, GET, {"server": server, "remote": remote}, not_before=at)


def update(server: str, remote: str, responses: dict[str, dict[str, Any]]) -> OpRequest:
    return OpRequest(KIND, UPDATE, {"server": server, "remote": remote, "responses": responses})


def cancel(server: str, remote: str, *, at: datetime | None = None, abandon: bool = False) -> OpRequest:
    args: dict[str, Any] = {"server": server, "remote": remote}
    if abandon:
        args["abandon"] = True  # the task ended otherwise: this call belongs to its end, not to a step
    return OpRequest(KIND, CANCEL, args, not_before=at)


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
        raise PermanentError(f"the MCP server {name!r} is no longer configured for this workspace")
    return server.config


def _tenant_slug(task_id: int) -> str | None:
    return Task.objects.filter(pk=task_id).values_list("tenant__slug", flat=True).first()


async def _call_tool(server: client.ServerConfig, args: dict[str, Any]) -> dict[str, Any]:
    tool = args["tool"]
    try:
        answer = await client.call_tool_async(server, tool, args["arguments"])
    except client.NotSent as exc:
        raise TransientError("the MCP server could not be reached, so the tool was not called",
                             detail=str(exc)) from None
    except client.RemoteUnavailable as exc:
        raise PermanentError(MAYBE_STARTED, detail=str(exc)) from None
    except client.ToolNotFound as exc:
        raise PermanentError(f"the MCP server has no tool {tool!r}", detail=str(exc)) from None
    except client.McpError as exc:
        # Its words help the owner fix the arguments; no remote task exists yet to leak an id of.
        raise PermanentError(f"the MCP server refused the tool call: {exc}"[:500], detail=str(exc)) from None
    if isinstance(answer, client.Completed):
        return {"completed": tool_result(answer.result)}
    return {"task": remote_task(answer.task)}


async def _get(server: client.ServerConfig, remote: str) -> dict[str, Any]:
    try:
        return {"task": remote_task(await client.get_task_async(server, remote))}
    except client.RemoteTaskNotFound as exc:
        return {"gone": str(exc)[:500]}
    except client.RemoteUnavailable as exc:
        raise TransientError("the MCP server is not reachable", detail=str(exc)) from None
    except client.McpError as exc:
        # A 401 after a token rotation, a malformed answer...: the step backs off and polls again.
        raise PermanentError("the MCP server answered the poll with an error", detail=str(exc)) from None


async def _update(server: client.ServerConfig, args: dict[str, Any]) -> dict[str, Any]:
    try:
        await client.update_task_async(server, args["remote"], args["responses"])
    except client.RemoteUnavailable as exc:
        # Safe to send again: a server ignores responses to questions no longer open.
        raise TransientError("the MCP server could not be reached to send the answer", detail=str(exc)) from None
    except client.McpError as exc:
        # The spec's "invalid params" covers both a gone task and a refused answer.
        raise PermanentError("the remote tool refused the answer, or no longer knows the task",
                             detail=str(exc)) from None
    return {"sent": sorted(args["responses"])}


async def _cancel(server: client.ServerConfig, remote: str) -> dict[str, Any]:
    try:
        await client.cancel_task_async(server, remote)
    except client.RemoteTaskNotFound as exc:
        return {"gone": str(exc)[:500]}  # or a refusal: a poll tells which
    except client.RemoteUnavailable as exc:
        raise TransientError("the MCP server could not be reached to cancel", detail=str(exc)) from None
    except client.McpError as exc:
        raise PermanentError("the MCP server refused the cancel", detail=str(exc)) from None
    return {"sent": True}


# --- what is stored -----------------------------------------------------------------------


def remote_task(task: client.RemoteTask) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "status": task.status,
        "status_message": (task.status_message or "")[:STATUS_MESSAGE_CHARS],
        "poll_interval_ms": task.poll_interval_ms,
        "result": tool_result(task.result) if task.result is not None else None,
        "error": (task.error or "")[:2000] or None,
        "input_requests": [{"key": r.key, "method": r.method, "message": r.message[:4000], "schema": r.schema,
                            "raw": r.raw} for r in task.input_requests],
    }


def tool_result(result: client.ToolResult | None) -> dict[str, Any]:
    """What the task keeps of a tool's result: the text up to a limit, a preview, and whether it was cut."""
    text = result.text if result else ""
    limit = settings.LONGHAUL_MCP_RESULT_MAX_CHARS
    preview_chars = settings.LONGHAUL_MCP_RESULT_PREVIEW_CHARS
    structured = result.structured if result else None
    if structured is not None and len(json.dumps(structured)) > limit:
        structured = None
    return {
        "summary": text[:preview_chars],  # the preview: what the panel and the chat show first
        "text": text[:limit],
        "chars": len(text),
        "truncated": len(text) > limit,
        "structured": structured,
        "is_error": bool(result and result.is_error),
    }
