"""The `mcp` driver: one tool call on a configured remote MCP server, followed as a durable task.

Input: {server, tool, arguments}. Like every driver, a step never talks to the network: it
requests MCP calls (tasks/mcp/calls.py) that gateway jobs run in the `mcp` pool, and the next
step reads their outcome. The first step requests the tools/call (with the Tasks extension;
requested `once`, so a gateway job that dies during it fails it rather than calls the tool
twice); a server that answers at once ends the task there. Otherwise the remote task id goes
into the checkpoint, which never leaves the server, and each later step reads one poll's
outcome and requests the next poll, due at the server's poll interval: one step per poll,
and meanwhile the task is running, waiting on that unfinished call, holding no worker. Remote
statuses map onto the task's (DESIGN §10):

    working         -> running (the next poll is due at the server's interval)
    input_required  -> waiting_input (the owner's answer goes back with tasks/update)
    completed       -> succeeded (a tool-level error: failed, its result kept)
    failed          -> failed
    cancelled       -> cancelled
    gone / expired  -> failed, saying so

A poll that errors backs off; after DEGRADED_AFTER errors in a row the task is flagged
`tracking_degraded` (cleared by the next good poll). A poll that learns nothing new writes no
checkpoint and counts no step; a remote task is bounded by its wall time, not max_steps. A cancel
request runs `cancel_step` rounds instead: tasks/cancel, then polls until the remote confirms
or is gone, or until LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS pass, so a cancel always ends; a poll
answered after the request is never acted on. A task that ends otherwise (its budget, an
error) requests one tasks/cancel in the transaction that ends it (`abandon`).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.conf import settings

from tasks import clock
from tasks.context import StepContext
from tasks.drivers import Ask, Continue, Finish, OpRequest, Outcome, PartialResult
from tasks.errors import InvalidInput, PermanentError, RemoteCancelled, RemoteFailed, StepError
from tasks.events import NewEvent
from tasks.mcp import calls, client, config
from tasks.models import Operation, Task, Tenant
from tasks.operations import OpOutcome
from tasks.statuses import ErrorClass, OperationStatus

DEGRADED_AFTER = 3
GONE = "the remote task is gone: the MCP server no longer knows it (its time to live may have passed)"
MAYBE_STARTED = calls.MAYBE_STARTED
MAX_ARGUMENTS_BYTES = 64_000
LEGACY_SUBMIT = "mcp.call_tool"  # the submission's ledger entry when steps called the server themselves


class GaveUp(StepError):
    """The server stayed unreachable through the retries the gateway made within the task's budget."""

    error_class = ErrorClass.TRANSIENT


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
        # awaiting: the call the last step requested, whose outcome the next step reads
        # (None, "call", "poll", "update"; in cancel rounds "cancel", "cancel_poll").
        return {"remote": None, "errors": 0, "degraded": False, "message": "", "asked": [], "poll_ms": None,
                "awaiting": None}

    # --- steps ------------------------------------------------------------------------

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        _server_config(ctx.task)  # still configured for this workspace (the file, not the network)
        awaiting = state.get("awaiting")
        if awaiting == "call":
            return self._after_call(state, ctx, _awaited(ctx))
        if state["remote"] is None:
            return self._submit(state, ctx)
        if awaiting == "update":
            return self._after_update(state, ctx, _awaited(ctx))
        if awaiting == "poll":
            return self._after_poll(state, ctx, _awaited(ctx))
        if state["asked"]:
            return self._send_answer(state, ctx)
        return self._poll(state, ctx, at=None)  # nothing out (a checkpoint from before calls were operations)

    def _submit(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        spec = ctx.input
        legacy = Operation.objects.filter(task_id=ctx.task.pk, name=LEGACY_SUBMIT).first()
        if legacy is not None:
            # Submitted by a step that called the server itself (before an upgrade): never a second time.
            finished = legacy.status == OperationStatus.SUCCEEDED
            return self._after_call(state, ctx, OpOutcome(
                name=calls.CALL_TOOL, args=spec, ok=finished, result=legacy.result, error_class="",
                error_message="", usage={}, finished=finished))
        request = calls.call_tool(spec["server"], spec["tool"], spec["arguments"])
        return Continue({**state, "awaiting": "call"}, [], [request])

    def _after_call(self, state: dict[str, Any], ctx: StepContext, outcome: OpOutcome | None) -> Outcome:
        spec = ctx.input
        if outcome is None or not outcome.finished:
            raise PermanentError(MAYBE_STARTED, detail="the tool call's outcome is missing")
        if not outcome.ok:
            if outcome.error_class == ErrorClass.TRANSIENT:  # provably not sent, each time the gateway tried
                raise GaveUp(f"gave up: {outcome.error_message}")
            if outcome.error_class == ErrorClass.PERMANENT:  # the server's answer, classified by the gateway
                raise PermanentError(outcome.error_message)
            # Its gateway job died, or ran out of time: MCP cannot tell whether the tool started.
            raise PermanentError(MAYBE_STARTED, detail=outcome.error_message)
        if "completed" in outcome.result:
            return self._finish(state, outcome.result["completed"])
        remote = outcome.result["task"]
        ctx.emit("remote_started", tool=spec["tool"], server=spec["server"])
        return self._follow({**state, "remote": remote["task_id"], "awaiting": None}, ctx, remote)

    def _after_poll(self, state: dict[str, Any], ctx: StepContext, outcome: OpOutcome | None) -> Outcome:
        if outcome is None or not outcome.finished:
            return self._poll(state, ctx, at=None)
        if not outcome.ok:
            # A poll only reads: whatever failed (network, a 401 after a token rotation, a malformed
            # answer), back off and try again; the owner sees "tracking degraded" and may cancel.
            state, events, delay, degraded = _backed_off(state, outcome)
            return self._poll(state, ctx, at=clock.now() + delay, events=events, degraded=degraded)
        if "gone" in outcome.result:
            raise PermanentError(GONE, detail=outcome.result["gone"])
        return self._follow(state, ctx, outcome.result["task"])

    def _follow(self, state: dict[str, Any], ctx: StepContext, remote: dict[str, Any]) -> Outcome:
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
            return self._poll(state, ctx, at=None, events=events, degraded=False)
        if status == "completed":
            return self._finish(state, remote["result"], events)
        if status == "failed":
            raise PermanentError(f"the remote task failed: {remote['error'] or 'no reason given'}")
        if status == "cancelled":
            raise RemoteCancelled("the remote server cancelled the task")
        if status == "input_required" and remote["input_requests"]:
            asked = remote["input_requests"]
            question = "\n".join(r["message"] for r in asked if r["message"]) or "The remote tool needs your input."
            return Ask({**state, "asked": asked, "awaiting": None}, question, events)
        return self._poll(state, ctx, at=clock.now() + _poll_interval(remote["poll_interval_ms"]), events=events,
                          degraded=False)

    def _poll(self, state: dict[str, Any], ctx: StepContext, *, at: datetime | None,
              events: list[NewEvent] | None = None, degraded: bool | None = None) -> Continue:
        """Request the next tasks/get, due `at` (None: now); the task waits on it meanwhile."""
        request = calls.get(ctx.input["server"], state["remote"], at=at)
        return Continue({**state, "awaiting": "poll"}, events or [], [request], tracking_degraded=degraded)

    def _send_answer(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        if not ctx.answer:
            return Ask(state, "\n".join(r["message"] for r in state["asked"]) or "The remote tool needs your input.")
        requests = [client.InputRequest(key=r["key"], method=r["method"], message=r["message"], schema=r["schema"],
                                        raw=r["raw"]) for r in state["asked"]]
        try:
            responses = {r.key: client.answer_for(r, ctx.answer) for r in requests}
        except client.McpError as exc:
            raise PermanentError("the remote tool asked for input Longhaul cannot give as text",
                                 detail=str(exc)) from None
        update = calls.update(ctx.input["server"], state["remote"], responses)
        return Continue({**state, "awaiting": "update"}, [], [update])

    def _after_update(self, state: dict[str, Any], ctx: StepContext, outcome: OpOutcome | None) -> Outcome:
        if outcome is None or not outcome.finished:
            return self._send_answer(state, ctx)  # safe to send again: a server ignores closed questions
        if not outcome.ok:
            if outcome.error_class == ErrorClass.TRANSIENT:
                raise GaveUp(f"gave up: {outcome.error_message}")
            raise PermanentError(outcome.error_message)
        state = {**state, "asked": []}
        return self._poll(state, ctx, at=clock.now() + _poll_interval(state.get("poll_ms")),
                          events=[NewEvent("answer_sent", {})])

    def _finish(self, state: dict[str, Any], result: dict[str, Any], events: list[NewEvent] | None = None) -> Finish:
        if result["is_error"]:
            raise RemoteFailed(f"the tool reported an error: {result['summary'][:300] or 'no message'}",
                               result=result)
        return Finish({**state, "awaiting": None}, result, events or [])

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None:
        return None  # a remote tool's work is all or nothing

    # --- cancel -----------------------------------------------------------------------

    def remote_to_cancel(self, task_id: int, state: dict[str, Any] | None) -> bool:
        return _remote_id(task_id, state) is not None

    def cancel_step(self, state: dict[str, Any], ctx: StepContext) -> Continue | None:
        """One round of remote cancellation: read the last round's call, request the next (tasks/cancel
        once, then polls). No requests once the remote stopped or is gone, or the time to confirm ran out
        (measured from the first round, after at least one attempt); None when there is no remote task."""
        remote_id = _remote_id(ctx.task.pk, state)
        if remote_id is None:
            return None
        now = clock.now()
        state = {**self.initial_state(ctx.input), **state, "remote": remote_id}
        awaiting = state.get("awaiting")
        # A step's call still out when the cancel came (a poll, say) is never read: only the rounds' own are.
        outcome = _awaited(ctx) if awaiting in ("cancel", "cancel_poll") else None
        at: datetime | None = None
        events: list[NewEvent] = []
        degraded: bool | None = None
        if outcome is not None and outcome.finished:
            if not outcome.ok:
                state, events, delay, degraded = _backed_off(state, outcome)
                at = now + delay
            elif awaiting == "cancel":
                state["cancel_sent"] = True  # or the server did not know the task: the poll tells which
                events.append(NewEvent("remote_cancel_sent", {}))
            elif "gone" in outcome.result or outcome.result["task"]["status"] in ("cancelled", "completed", "failed"):
                return Continue(state, events)  # stopped, one way or another
            else:
                state["errors"] = 0
                at = now + _poll_interval(outcome.result["task"]["poll_interval_ms"])
        started = state.setdefault("cancel_started", now.isoformat())
        out_of_time = now - datetime.fromisoformat(started) > timedelta(
            seconds=settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS)
        if out_of_time and state.get("cancel_tries", 0) > 0:
            events.append(NewEvent("remote_cancel_unconfirmed", {
                "message": "the remote server did not confirm the cancel; it may still be running"}))
            return Continue(state, events)
        try:
            _server_config(ctx.task)
        except PermanentError:
            events.append(NewEvent("remote_cancel_unconfirmed", {"message": "the MCP server is no longer configured"}))
            return Continue(state, events)
        state["cancel_tries"] = state.get("cancel_tries", 0) + 1
        server = ctx.input["server"]
        if not state.get("cancel_sent"):
            request, awaiting = calls.cancel(server, remote_id, at=at), "cancel"
        else:
            request, awaiting = calls.get(server, remote_id, at=at), "cancel_poll"
        return Continue({**state, "awaiting": awaiting}, events, [request], tracking_degraded=degraded)

    def abandon(self, task: Task, state: dict[str, Any] | None) -> list[OpRequest]:
        remote_id = _remote_id(task.pk, state)
        if remote_id is None or (state or {}).get("cancel_sent"):
            return []
        return [calls.cancel(task.input["server"], remote_id, abandon=True)]


def _server_config(task: Task) -> client.ServerConfig:
    server = config.servers().get(task.input["server"])
    if server is None or not server.allows(task.tenant.slug):
        raise PermanentError(f"the MCP server {task.input['server']!r} is no longer configured for this workspace")
    return server.config


def _awaited(ctx: StepContext) -> OpOutcome | None:
    """The outcome of the one call the last step (or cancel round) requested."""
    outcomes = ctx.requested_outcomes()
    return outcomes[-1] if outcomes else None


def _backed_off(state: dict[str, Any], outcome: OpOutcome) -> tuple[dict[str, Any], list[NewEvent], timedelta, bool]:
    """After a failed poll: the state, events, the delay before the next one, and whether tracking is degraded."""
    errors = state.get("errors", 0) + 1
    base = _poll_interval(state.get("poll_ms")).total_seconds()
    delay = min(base * 2 ** min(errors, 16), settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS)
    degraded = errors >= DEGRADED_AFTER
    events = []
    if degraded and not state.get("degraded"):
        # Fixed words: a server's own error text may carry its task id.
        kind = "not reachable" if outcome.error_class == ErrorClass.TRANSIENT else "answering with errors"
        events.append(NewEvent("tracking_degraded", {"errors": errors, "message": f"the MCP server is {kind}"}))
    return {**state, "errors": errors, "degraded": degraded}, events, timedelta(seconds=delay), degraded


def _poll_interval(server_ms: int | None) -> timedelta:
    """The server's poll interval within our floor and ceiling."""
    floor, ceiling = settings.LONGHAUL_MCP_POLL_FLOOR_MS, settings.LONGHAUL_MCP_POLL_CEILING_MS
    return timedelta(milliseconds=min(max(server_ms or floor, floor), ceiling))


def _remote_id(task_id: int, state: dict[str, Any] | None) -> str | None:
    """The remote task id from the checkpoint, or from the tools/call's outcome when no step has read it
    yet (a cancel came while the call was out, or the task ended meanwhile)."""
    if state and state.get("remote"):
        return str(state["remote"])
    submitted = (Operation.objects.filter(task_id=task_id, name__in=(calls.CALL_TOOL, LEGACY_SUBMIT),
                                          status=OperationStatus.SUCCEEDED)
                 .values_list("result", flat=True).first())
    if isinstance(submitted, dict) and "task" in submitted:
        return str(submitted["task"]["task_id"])
    return None
