"""The `mcp` driver: one tool call on a configured remote MCP server, followed as a durable task.

Input: {server, tool, arguments}. The first step calls the tool with the Tasks
extension (through the operation ledger, so a replayed step finds the call made);
a server that answers at once ends the task there. Otherwise the remote task id goes
into the checkpoint, which never leaves the server, and each later step polls
`tasks/get` once and returns Wait until the next poll: the task keeps its slot but
no worker. Remote statuses map onto the task's (DESIGN §10):

    working         -> running (Wait for the server's poll interval)
    input_required  -> waiting_input (the owner's answer goes back with tasks/update)
    completed       -> succeeded (a tool-level error: failed, its result kept)
    failed          -> failed
    cancelled       -> cancelled
    gone / expired  -> failed, saying so

A poll that errors backs off; after DEGRADED_AFTER errors in a row the task is
flagged `tracking_degraded` (cleared by the next good poll). A cancel request runs
`cancel_step` instead: tasks/cancel, then polls until the remote confirms or is gone,
or until LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS pass, so a cancel always ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.conf import settings

from tasks import clock
from tasks.context import StepContext
from tasks.drivers import Ask, Finish, Outcome, PartialResult, Wait
from tasks.errors import InvalidInput, PermanentError, RemoteCancelled, RemoteFailed, TransientError
from tasks.events import NewEvent
from tasks.mcp import client, config
from tasks.models import Operation, Task, Tenant
from tasks.statuses import OperationStatus

log = logging.getLogger(__name__)
DEGRADED_AFTER = 3
ABANDON_TIMEOUT_S = 10.0
GONE = "the remote task is gone: the MCP server no longer knows it (its time to live may have passed)"
MAYBE_STARTED = ("the MCP server did not answer the tool call, so it may or may not have started the tool; "
                 "it was not called again, so that it cannot run twice")
MAX_ARGUMENTS_BYTES = 64_000
SUBMIT = "mcp.call_tool"


class McpDriver:
    kind: ClassVar[str] = "mcp"
    schema_version: ClassVar[int] = 1
    debug_only: ClassVar[bool] = False

    # --- input ------------------------------------------------------------------------

    def validate_input(self, raw: Any, *, tenant: Tenant | None = None) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise InvalidInput("input must be an object with server, tool and arguments", field="input")
        unknown = sorted(set(raw) - {"server", "tool", "arguments"})
        if unknown:
            raise InvalidInput(f"input has unknown fields: {', '.join(unknown)}", field=f"input.{unknown[0]}")
        name, tool, arguments = raw.get("server"), raw.get("tool"), raw.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise InvalidInput("input.server must name a configured MCP server", field="input.server")
        server = config.servers().get(name)
        if server is None or (tenant is not None and not server.allows(tenant.slug)):
            known = ", ".join(s.name for s in config.for_tenant(tenant.slug if tenant else "")) or "none"
            raise InvalidInput(f"unknown MCP server {name!r}; configured servers: {known}", field="input.server")
        if not isinstance(tool, str) or not 1 <= len(tool) <= 200:
            raise InvalidInput("input.tool must be a tool name of 1 to 200 characters", field="input.tool")
        if not isinstance(arguments, dict):
            raise InvalidInput("input.arguments must be an object", field="input.arguments")
        if len(json.dumps(arguments)) > MAX_ARGUMENTS_BYTES:
            raise InvalidInput(f"input.arguments must be at most {MAX_ARGUMENTS_BYTES} bytes of JSON",
                               field="input.arguments")
        return {"server": name, "tool": tool, "arguments": arguments}

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]:
        return {"remote": None, "errors": 0, "degraded": False, "message": "", "asked": [], "poll_ms": None}

    # --- steps ------------------------------------------------------------------------

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        server = self._server(ctx)
        if state["remote"] is None:
            return self._submit(state, ctx, server)
        if state["asked"]:
            return self._send_answer(state, ctx, server)
        try:
            remote = client.get_task(server, state["remote"])
        except client.RemoteTaskNotFound as exc:
            raise PermanentError(GONE, detail=str(exc)) from None
        except client.McpError as exc:
            # A poll only reads: whatever failed (network, a 401 after a token rotation, a malformed
            # answer), back off and try again; the owner sees "tracking degraded" and may cancel.
            return self._poll_failed(state, ctx, exc)
        # A poll answered after a cancel request is not acted on (DESIGN §10): stop here, unwritten.
        ctx.check_safe_point(force=True)
        return self._follow(state, ctx, remote)

    def _submit(self, state: dict[str, Any], ctx: StepContext, server: client.ServerConfig) -> Outcome:
        spec = ctx.input

        def call() -> dict[str, Any]:
            try:
                answer = client.call_tool(server, spec["tool"], spec["arguments"])
            except client.NotSent as exc:
                raise TransientError("the MCP server could not be reached; trying again", detail=str(exc)) from None
            except client.RemoteUnavailable as exc:
                raise PermanentError(MAYBE_STARTED, detail=str(exc)) from None
            except client.ToolNotFound as exc:
                raise PermanentError(f"the MCP server has no tool {spec['tool']!r}", detail=str(exc)) from None
            except client.McpError as exc:
                # Its words help the owner fix the arguments; no remote task exists yet to leak an id of.
                raise PermanentError(f"the MCP server refused the tool call: {exc}"[:500], detail=str(exc)) from None
            if isinstance(answer, client.Completed):
                return {"completed": _tool_result(answer.result)}
            return {"task": _remote_task(answer.task)}

        def died_during_the_call() -> None:
            # MCP cannot tell whether a call whose answer was lost started the tool: rather than risk
            # running it twice, stop and say so.
            raise PermanentError(MAYBE_STARTED)

        outcome = ctx.operation(SUBMIT, call, args=spec, kind="tool", side_effect=True, verify=died_during_the_call)
        if "completed" in outcome:
            return self._finish(state, outcome["completed"])
        remote = outcome["task"]
        ctx.emit("remote_started", tool=spec["tool"], server=spec["server"])
        state = {**state, "remote": remote["task_id"]}
        return self._follow(state, ctx, remote)

    def _follow(self, state: dict[str, Any], ctx: StepContext, remote: dict[str, Any] | client.RemoteTask) -> Outcome:
        if isinstance(remote, client.RemoteTask):
            remote = _remote_task(remote)
        events: list[NewEvent] = []
        if state["degraded"]:
            events.append(NewEvent("tracking_restored", {}))
        state = {**state, "errors": 0, "degraded": False, "poll_ms": remote["poll_interval_ms"]}
        message = remote["status_message"][:500]
        if message and message != state["message"]:
            events.append(NewEvent("progress", {"message": message}))
            state = {**state, "message": message}
        status = remote["status"]
        if status == "completed" and remote["result"] is None:
            # A tools/call handle carries no result, even for a task that is already done.
            return Wait(state, clock.now(), events, tracking_degraded=False)
        if status == "completed":
            return self._finish(state, remote["result"], events)
        if status == "failed":
            raise PermanentError(f"the remote task failed: {remote['error'] or 'no reason given'}")
        if status == "cancelled":
            raise RemoteCancelled("the remote server cancelled the task")
        if status == "input_required" and remote["input_requests"]:
            asked = remote["input_requests"]
            question = "\n".join(r["message"] for r in asked if r["message"]) or "The remote tool needs your input."
            return Ask({**state, "asked": asked}, question, events)
        return Wait(state, clock.now() + _poll_interval(remote["poll_interval_ms"]), events,
                    tracking_degraded=False)

    def _send_answer(self, state: dict[str, Any], ctx: StepContext, server: client.ServerConfig) -> Outcome:
        if not ctx.answer:
            return Ask(state, "\n".join(r["message"] for r in state["asked"]) or "The remote tool needs your input.")
        requests = [client.InputRequest(key=r["key"], method=r["method"], message=r["message"], schema=r["schema"],
                                        raw=r["raw"]) for r in state["asked"]]
        try:
            responses = {r.key: client.answer_for(r, ctx.answer) for r in requests}
        except client.McpError as exc:
            raise PermanentError("the remote tool asked for input Longhaul cannot give as text",
                                 detail=str(exc)) from None

        def update() -> dict[str, Any]:
            try:
                client.update_task(server, state["remote"], responses)
            except client.RemoteUnavailable as exc:
                # Safe to send again: a server ignores responses to questions no longer open.
                raise TransientError("the MCP server could not be reached; trying again", detail=str(exc)) from None
            except client.McpError as exc:
                # The spec's "invalid params" covers both a gone task and a refused answer.
                raise PermanentError("the remote tool refused the answer, or no longer knows the task",
                                     detail=str(exc)) from None
            return {"sent": sorted(responses)}

        ctx.operation("mcp.tasks_update", update, args={"remote": state["remote"], "responses": responses},
                      kind="tool", side_effect=True)
        return Wait({**state, "asked": []}, clock.now() + _poll_interval(state.get("poll_ms")),
                    [NewEvent("answer_sent", {})])

    def _poll_failed(self, state: dict[str, Any], ctx: StepContext, exc: client.McpError) -> Wait:
        errors = state.get("errors", 0) + 1
        base = _poll_interval(state.get("poll_ms")).total_seconds()
        delay = min(base * 2 ** min(errors, 16), settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS)
        degraded = errors >= DEGRADED_AFTER
        events = []
        if degraded and not state.get("degraded"):
            # Fixed words: a server's own error text may carry its task id.
            kind = "not reachable" if isinstance(exc, client.RemoteUnavailable) else "answering with errors"
            events.append(NewEvent("tracking_degraded", {"errors": errors, "message": f"the MCP server is {kind}"}))
        state = {**state, "errors": errors, "degraded": degraded}
        return Wait(state, clock.now() + timedelta(seconds=delay), events, tracking_degraded=degraded)

    def _finish(self, state: dict[str, Any], result: dict[str, Any], events: list[NewEvent] | None = None) -> Finish:
        if result["is_error"]:
            raise RemoteFailed(f"the tool reported an error: {result['summary'][:300] or 'no message'}",
                               result=result)
        return Finish(state, result, events or [])

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None:
        return None  # a remote tool's work is all or nothing

    # --- cancel -----------------------------------------------------------------------

    def remote_to_cancel(self, task_id: int, state: dict[str, Any] | None) -> bool:
        return _remote_id(task_id, state) is not None

    def cancel_step(self, state: dict[str, Any], ctx: StepContext) -> Wait | None:
        """One round of remote cancellation; None once the remote stopped or is gone, or the
        time to confirm ran out (measured from the first round, after at least one attempt)."""
        remote_id = _remote_id(ctx.task.pk, state)
        if remote_id is None:
            return None
        now = clock.now()
        state = {**self.initial_state(ctx.input), **state, "remote": remote_id}
        started = state.setdefault("cancel_started", now.isoformat())
        out_of_time = now - datetime.fromisoformat(started) > timedelta(
            seconds=settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS)
        if out_of_time and state.get("cancel_tries", 0) > 0:
            ctx.emit("remote_cancel_unconfirmed",
                     message="the remote server did not confirm the cancel; it may still be running")
            return None
        try:
            server = self._server(ctx)
        except PermanentError:
            ctx.emit("remote_cancel_unconfirmed", message="the MCP server is no longer configured")
            return None
        state["cancel_tries"] = state.get("cancel_tries", 0) + 1
        try:
            if not state.get("cancel_sent"):
                try:
                    client.cancel_task(server, remote_id)
                except client.RemoteTaskNotFound:
                    pass  # or a refusal: the status below tells which
                state["cancel_sent"] = True
                ctx.emit("remote_cancel_sent")
            remote = client.get_task(server, remote_id)
        except client.RemoteTaskNotFound:
            return None
        except client.McpError as exc:
            return self._poll_failed(state, ctx, exc)
        if remote.status in ("cancelled", "completed", "failed"):
            return None
        return Wait({**state, "errors": 0}, now + _poll_interval(remote.poll_interval_ms))

    def abandon(self, task: Task, state: dict[str, Any] | None) -> None:
        remote_id = _remote_id(task.pk, state)
        if remote_id is None or (state or {}).get("cancel_sent"):
            return
        try:
            server = _server_config(task)
            # Short: the caller holds the task's lease and is about to end it.
            client.cancel_task(dataclasses.replace(server, timeout_s=min(server.timeout_s, ABANDON_TIMEOUT_S)),
                               remote_id)
        except (client.McpError, PermanentError) as exc:
            log.warning("task %s: could not ask the remote server to stop: %s", task.pk, type(exc).__name__)

    def _server(self, ctx: StepContext) -> client.ServerConfig:
        return _server_config(ctx.task)


def _server_config(task: Task) -> client.ServerConfig:
    server = config.servers().get(task.input["server"])
    if server is None or not server.allows(task.tenant.slug):
        raise PermanentError(f"the MCP server {task.input['server']!r} is no longer configured for this workspace")
    return server.config


def _poll_interval(server_ms: int | None) -> timedelta:
    """The server's poll interval within our floor and ceiling."""
    floor, ceiling = settings.LONGHAUL_MCP_POLL_FLOOR_MS, settings.LONGHAUL_MCP_POLL_CEILING_MS
    return timedelta(milliseconds=min(max(server_ms or floor, floor), ceiling))


def _remote_id(task_id: int, state: dict[str, Any] | None) -> str | None:
    """The remote task id from the checkpoint, or from the submission's ledger entry when the step
    that submitted was stopped before its checkpoint was written."""
    if state and state.get("remote"):
        return str(state["remote"])
    submitted = (Operation.objects.filter(task_id=task_id, name=SUBMIT, status=OperationStatus.SUCCEEDED)
                 .values_list("result", flat=True).first())
    if isinstance(submitted, dict) and "task" in submitted:
        return str(submitted["task"]["task_id"])
    return None


def _remote_task(task: client.RemoteTask) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "status": task.status,
        "status_message": task.status_message or "",
        "poll_interval_ms": task.poll_interval_ms,
        "result": _tool_result(task.result) if task.result is not None else None,
        "error": task.error,
        "input_requests": [{"key": r.key, "method": r.method, "message": r.message, "schema": r.schema, "raw": r.raw}
                           for r in task.input_requests],
    }


def _tool_result(result: client.ToolResult | None) -> dict[str, Any]:
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
