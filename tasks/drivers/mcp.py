"""The `mcp` driver: one tool call on a configured remote MCP server, followed as a durable task.

Input: {server, tool, arguments}, the server named by its title or its configured name (the name is
stored; only titles are ever shown). Like every driver, a step never talks to the network: it
requests MCP calls (tasks/mcp/calls.py) that gateway jobs run in the `mcp` pool, and the next
step reads their outcome. The first step requests the tools/call (with the Tasks extension;
requested `once`, so a gateway job that dies during it fails it rather than calls the tool
twice); a server that answers at once ends the task there, and one that asks before it creates
a task (an input-required result) has its questions asked of the owner, then is called again
with the answers. Otherwise the remote task id goes to the task row (`RemoteFacts`, unique per
owner and server among active tasks, never shown) and into the checkpoint, and each later step reads one poll's
outcome and requests the next poll: one step per poll, and meanwhile the task is running,
waiting on that unfinished call, holding no worker. Remote statuses map onto the task's
(DESIGN §10):

    working         -> running (the next poll is due at the server's interval)
    input_required  -> waiting_input, one question at a time (the answer goes back with
                       tasks/update; a key once answered is never asked or answered again,
                       however many polls still list it)
    completed       -> succeeded (a tool-level error: failed, its result kept)
    failed          -> failed
    cancelled       -> cancelled
    gone / expired  -> failed, saying so
    malformed       -> failed at once, a protocol error

Timing: the next poll is due at the last poll's completion time plus the server's
pollIntervalMs, kept within [LONGHAUL_MCP_POLL_FLOOR_MS, 24 h] and never after the task's
wall-time deadline. A poll that errors backs off min(interval * 2^(n-1), cap) from the failed
call's completion time; after DEGRADED_AFTER errors in a row the task is flagged
`tracking_degraded` and its last (redacted) poll error is kept, both cleared by the next good
poll. While the owner is asked, a slow poll (the Ask's `watch`, no sooner than a minute nor than
the server's interval: `watch_every`) notices a remote task that moved on, and the question is
withdrawn (`question_stands`); a watch that fails, or is closed by a pause, says nothing, and the
question stands.

A poll that learns nothing new writes no checkpoint and counts no step; a remote task is bounded
by its wall time, not max_steps. A cancel request runs `cancel_step` rounds instead:
tasks/cancel (counted; a failure is kept and retried with backoff from the failure), then polls
until the remote confirms or is gone, or until LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS pass (no round is
due after that, whatever interval the server asks for), so a cancel always ends; a cancel round's
failure is counted and kept but never flags `tracking_degraded`; a poll answered after the request
is never acted on. A task that ends
otherwise (its budget, an error) requests one tasks/cancel in the transaction that ends it
(`abandon`), unless the last poll saw the remote task stopped, or the handle belongs to another
of the owner's tasks. Every text shown is redacted of the remote id and the server's internals.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.conf import settings

from tasks import clock
from tasks.budgets import Budget
from tasks.context import StepContext
from tasks.drivers import Ask, Continue, Finish, OpRequest, Outcome, PartialResult, Pins, RemoteFacts
from tasks.errors import InvalidInput, PermanentError, RemoteCancelled, RemoteFailed, StepError
from tasks.events import NewEvent
from tasks.mcp import calls, client, config, forms
from tasks.models import Operation, Task, Tenant
from tasks.operations import OpOutcome
from tasks.statuses import TERMINAL, ErrorClass, OperationStatus

DEGRADED_AFTER = 3
GONE = "the remote task is gone: the MCP server no longer knows it (its time to live may have passed)"
ALREADY_TRACKED = "this remote task is already tracked by another of your tasks"
MAYBE_STARTED = calls.MAYBE_STARTED
MAX_ARGUMENTS_BYTES = 64_000
MAX_HANDLE_CHARS = 255  # Task.remote_handle
POLL_CEILING = timedelta(hours=24)
WATCH_EVERY = timedelta(seconds=60)  # polls while the owner is asked: no sooner than this
STOPPED = ("completed", "failed", "cancelled", "gone")  # remote statuses after which nothing is cancelled
DEFAULT_QUESTION = "The remote tool needs your input."
LEGACY_SUBMIT = "mcp.call_tool"  # the submission's ledger entry when steps called the server themselves


class GaveUp(StepError):
    """The server stayed unreachable through the retries the gateway made within the task's budget."""

    error_class = ErrorClass.TRANSIENT


class McpDriver:
    kind: ClassVar[str] = "mcp"
    schema_version: ClassVar[int] = 1
    debug_only: ClassVar[bool] = False

    def pins(self) -> Pins:
        return Pins(tool_protocol=client.TOOL_PROTOCOL)

    # --- input ------------------------------------------------------------------------

    def validate_input(self, raw: Any, *, tenant: Tenant | None = None, internal: bool = False) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise InvalidInput("input must be an object with server, tool and arguments", field="input")
        unknown = sorted(set(raw) - {"server", "tool", "arguments"})
        if unknown:
            raise InvalidInput(f"input has unknown fields: {', '.join(unknown)}", field=f"input.{unknown[0]}")
        name, tool, arguments = raw.get("server"), raw.get("tool"), raw.get("arguments", {})
        if not isinstance(name, str) or not name.strip():
            raise InvalidInput("input.server must name a configured MCP server", field="input.server")
        server = _named_server(name, tenant)
        if server is None:
            # Titles only: a server's configured name never leaves Longhaul.
            known = ", ".join(s.title for s in _usable_servers(tenant)) or "none"
            raise InvalidInput(f"unknown MCP server {name!r}; configured servers: {known}", field="input.server")
        if not isinstance(tool, str) or not 1 <= len(tool) <= 200:
            raise InvalidInput("input.tool must be a tool name of 1 to 200 characters", field="input.tool")
        if not isinstance(arguments, dict):
            raise InvalidInput("input.arguments must be an object", field="input.arguments")
        if len(json.dumps(arguments)) > MAX_ARGUMENTS_BYTES:
            raise InvalidInput(f"input.arguments must be at most {MAX_ARGUMENTS_BYTES} bytes of JSON",
                               field="input.arguments")
        return {"server": server.name, "tool": tool, "arguments": arguments}

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]:
        # awaiting: the call the last step requested, whose outcome the next step reads (None, "call",
        # "poll", "update", "watch"; in cancel rounds "cancel", "cancel_poll"). asking: the question out
        # ({key, method, message, schema}). answered: input-request keys answered, never asked again.
        # before: questions a server asked before creating its task ({requests, responses, request_state}).
        return {"remote": None, "errors": 0, "degraded": False, "message": "", "poll_ms": None,
                "awaiting": None, "asking": None, "answered": [], "before": None}

    # --- steps ------------------------------------------------------------------------

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        _server_config(ctx.task)  # still configured for this workspace (the file, not the network)
        state = _upgraded({**self.initial_state(ctx.input), **state})
        awaiting = state["awaiting"]
        if awaiting == "call":
            return self._after_call(state, ctx, _awaited(ctx))
        if state["asking"] is not None:
            return self._after_question(state, ctx)
        if state["remote"] is None:
            return self._submit(state, ctx)
        if awaiting == "update":
            return self._after_update(state, ctx, _awaited(ctx))
        if awaiting == "poll":
            return self._after_poll(state, ctx, _awaited(ctx))
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
            message = _shown(outcome.error_message, ctx)
            if outcome.error_class == ErrorClass.TRANSIENT:  # provably not sent, each time the gateway tried
                raise GaveUp(f"gave up: {message}")
            if outcome.error_class == ErrorClass.PERMANENT:  # the server's answer, classified by the gateway
                raise PermanentError(message)
            # Its gateway job died, or ran out of time: MCP cannot tell whether the tool started.
            raise PermanentError(MAYBE_STARTED, detail=outcome.error_message)
        if "completed" in outcome.result:
            return self._finish(state, ctx, outcome.result["completed"])
        if "input_needed" in outcome.result:
            # The server asks before it creates a task: ask the owner, then call again with the answers.
            needed = outcome.result["input_needed"]
            before = {"requests": needed["requests"], "responses": {}, "request_state": needed["request_state"]}
            return self._ask_next({**state, "awaiting": None, "before": before}, ctx, [])
        remote = outcome.result["task"]
        handle = str(remote["task_id"])
        if len(handle) > MAX_HANDLE_CHARS:
            # Not stored (it would not fit); the task's end cancels it once (abandon).
            raise PermanentError(f"protocol error: the MCP server's task id is {len(handle)} characters long, "
                                 f"over the limit of {MAX_HANDLE_CHARS}")
        if _tracked_elsewhere(ctx.task, handle):
            raise PermanentError(ALREADY_TRACKED)  # and its remote work, another task's, is left alone
        ctx.emit("remote_started", tool=spec["tool"])  # never the server's configured name
        facts = RemoteFacts(handle=handle, server=spec["server"])
        state = {**state, "remote": handle, "awaiting": None, "before": None}
        return self._follow(state, ctx, remote, done_at=_finished_at(ctx), facts=facts)

    def _after_poll(self, state: dict[str, Any], ctx: StepContext, outcome: OpOutcome | None) -> Outcome:
        if outcome is None or not outcome.finished:
            return self._poll(state, ctx, at=None)
        done_at = _finished_at(ctx)
        if not outcome.ok:
            # A poll only reads: whatever failed (network, a 401 after a token rotation), back off and try
            # again; the owner sees "tracking degraded" and may cancel.
            state, events, delay, degraded = _backed_off(state, outcome)
            error = _shown(outcome.error_message, ctx) or "the poll failed"
            return self._poll(state, ctx, at=_due(ctx, done_at + delay), events=events, degraded=degraded,
                              facts=RemoteFacts(poll_error=error))
        if "protocol_error" in outcome.result:
            raise PermanentError(_shown(outcome.result["protocol_error"], ctx))
        if "gone" in outcome.result:
            raise PermanentError(GONE, detail=outcome.result["gone"])
        return self._follow(state, ctx, outcome.result["task"], done_at=done_at)

    def _follow(self, state: dict[str, Any], ctx: StepContext, remote: dict[str, Any], *, done_at: datetime,
                facts: RemoteFacts | None = None) -> Outcome:
        events: list[NewEvent] = []
        if state["degraded"]:
            events.append(NewEvent("tracking_restored", {}))
        if state["errors"]:
            facts = RemoteFacts(**{**_facts(facts), "poll_error": ""})
        state = {**state, "errors": 0, "degraded": False, "poll_ms": remote["poll_interval_ms"]}
        message = _shown(remote["status_message"], ctx)[:calls.STATUS_MESSAGE_CHARS]
        if message and message != state["message"]:
            events.append(NewEvent("progress", {"message": message}))
            state = {**state, "message": message}
        status = remote["status"]
        if status == "completed" and remote["result"] is None:
            # A tools/call handle carries no result, even for a task that is already done.
            return self._poll(state, ctx, at=None, events=events, degraded=False, facts=facts)
        if status == "completed":
            return self._finish(state, ctx, remote["result"], events, facts=facts)
        if status == "failed":
            reason = _shown(remote["error"] or "", ctx) or "no reason given"
            raise PermanentError(f"the remote task failed: {reason}"[:calls.ERROR_CHARS])
        if status == "cancelled":
            raise RemoteCancelled("the remote server cancelled the task")
        if status == "input_required":
            # The acknowledgement of an answer is eventually consistent: a key once answered is never asked again.
            open_ = [r for r in remote["input_requests"] if r["key"] not in state["answered"]]
            if open_:
                return self._ask({**state, "awaiting": None}, ctx, open_[0], events, facts=facts)
        interval = _poll_interval(remote["poll_interval_ms"])
        return self._poll(state, ctx, at=_due(ctx, done_at + interval), events=events, degraded=False, facts=facts)

    def _poll(self, state: dict[str, Any], ctx: StepContext, *, at: datetime | None,
              events: list[NewEvent] | None = None, degraded: bool | None = None,
              facts: RemoteFacts | None = None) -> Continue:
        """Request the next tasks/get, due `at` (None: now); the task waits on it meanwhile."""
        request = calls.get(ctx.input["server"], state["remote"], at=at)
        return Continue({**state, "awaiting": "poll"}, events or [], [request], tracking_degraded=degraded,
                        remote=facts)

    # --- questions --------------------------------------------------------------------

    def _ask(self, state: dict[str, Any], ctx: StepContext, request: dict[str, Any], events: list[NewEvent], *,
             facts: RemoteFacts | None = None, note: str = "") -> Ask:
        """Ask the owner one input request; while a remote task waits for the answer, watch it slowly."""
        if request.get("method") != "elicitation/create":
            raise PermanentError("the remote tool asked for input Longhaul cannot give "
                                 f"({str(request.get('method'))[:100]})")
        schema = request.get("schema") or None
        try:
            forms.fields(schema)
        except forms.Unsupported as exc:
            raise PermanentError(f"the remote tool asked a question Longhaul cannot show as a form: {exc}") from None
        asking = {"key": request["key"], "method": request["method"], "message": request.get("message") or "",
                  "schema": schema}
        question = _shown(asking["message"], ctx) or DEFAULT_QUESTION
        if note:
            question = f"{question}\n\n{note}"
        watch = None
        if state["remote"] is not None:
            # Slowly (a minute at least): enough to see the remote task resolve, expire or be cancelled meanwhile.
            watch = calls.get(ctx.input["server"], state["remote"], at=clock.now() + self.watch_every(state, None))
        state = {**state, "asking": asking, "awaiting": "watch" if watch is not None else None}
        # A question without fields is answered in free text (accepted as it is).
        form = forms.keeping_order(schema) if forms.fields(schema) else None
        return Ask(state, question, events, remote=facts, form=form, watch=watch)

    def _ask_next(self, state: dict[str, Any], ctx: StepContext, events: list[NewEvent]) -> Outcome:
        """Before the remote task exists: ask the next unanswered question, or call again with the answers."""
        before = state["before"]
        waiting = [r for r in before["requests"] if r["key"] not in before["responses"]]
        if waiting:
            return self._ask(state, ctx, waiting[0], events)
        spec = ctx.input
        request = calls.call_tool(spec["server"], spec["tool"], spec["arguments"],
                                  input_responses=before["responses"], request_state=before["request_state"])
        return Continue({**state, "asking": None, "awaiting": "call"}, [*events, NewEvent("answer_sent", {})],
                        [request])

    def _after_question(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        """The step after a question: its answer, or (withdrawn) what the watching poll saw."""
        if ctx.answer or ctx.answer_data is not None:
            return self._send_answer(state, ctx)
        outcome = _awaited(ctx) if state["awaiting"] == "watch" else None
        if outcome is not None and outcome.finished and outcome.ok:
            # Withdrawn: the remote task moved on without the answer (if it did not, the poll asks again).
            return self._after_poll({**state, "asking": None, "awaiting": "poll"}, ctx, outcome)
        # No answer, and no watch that saw anything (a step run again; a watch closed by a pause or that
        # failed): the question stands, so it is asked again.
        return self._ask(state, ctx, state["asking"], [])

    def _send_answer(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        asking = state["asking"]
        answer = ctx.answer_data if ctx.answer_data is not None else ctx.answer
        try:
            if not forms.fields(asking["schema"]) and isinstance(answer, str):
                response: dict[str, Any] = {"action": "accept", "content": {}}  # nothing to fill: an acknowledgement
            else:
                response = forms.response(asking["schema"], answer)
        except forms.InvalidAnswer as exc:
            return self._ask(state, ctx, asking, [], note=f"That answer does not fit: {exc}")
        except forms.FormError as exc:
            raise PermanentError(f"the remote tool asked a question Longhaul cannot show as a form: {exc}") from None
        key = asking["key"]
        if state["remote"] is None:
            before = {**state["before"], "responses": {**state["before"]["responses"], key: response}}
            return self._ask_next({**state, "asking": None, "before": before}, ctx, [])
        update = calls.update(ctx.input["server"], state["remote"], {key: response})
        state = {**state, "asking": None, "answered": [*state["answered"], key], "awaiting": "update"}
        return Continue(state, [], [update])

    def _after_update(self, state: dict[str, Any], ctx: StepContext, outcome: OpOutcome | None) -> Outcome:
        if outcome is None:
            return self._poll(state, ctx, at=None)
        if not outcome.finished:
            # Sent again as it was: a server ignores responses to questions no longer open.
            return Continue(state, [], [calls.update(ctx.input["server"], state["remote"], outcome.args["responses"])])
        if not outcome.ok:
            message = _shown(outcome.error_message, ctx)
            if outcome.error_class == ErrorClass.TRANSIENT:
                raise GaveUp(f"gave up: {message}")
            raise PermanentError(message)
        at = _due(ctx, _finished_at(ctx) + _poll_interval(state["poll_ms"]))
        return self._poll(state, ctx, at=at, events=[NewEvent("answer_sent", {})])

    def watch_every(self, state: dict[str, Any], result: Any) -> timedelta:
        """How often the remote task is watched while its owner is asked: no sooner than a minute, nor
        than the server asks (its latest word: a watch's answer, else the last poll's)."""
        remote = result.get("task") if isinstance(result, dict) else None
        poll_ms = remote.get("poll_interval_ms") if isinstance(remote, dict) else None
        if poll_ms is None:
            poll_ms = (state or {}).get("poll_ms")
        return max(WATCH_EVERY, _poll_interval(poll_ms))

    def question_stands(self, state: dict[str, Any], result: Any) -> bool:
        """Whether a watching poll's result still shows the asked question open (the runtime never shows
        this a failed poll: that says nothing, and the question stands)."""
        asking = (state or {}).get("asking")
        if asking is None:
            return False
        if not isinstance(result, dict):
            return True
        remote = result.get("task")
        if not isinstance(remote, dict):
            return False  # gone, or a malformed answer
        return remote.get("status") == "input_required" and any(
            r.get("key") == asking["key"] for r in remote.get("input_requests") or [])

    def _finish(self, state: dict[str, Any], ctx: StepContext, result: dict[str, Any],
                events: list[NewEvent] | None = None, *, facts: RemoteFacts | None = None) -> Finish:
        if result["is_error"]:
            summary = _shown(result["summary"], ctx)[:300]
            raise RemoteFailed(f"the tool reported an error: {summary or 'no message'}", result=result)
        return Finish({**state, "awaiting": None}, result, events or [], remote=facts)

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None:
        return None  # a remote tool's work is all or nothing

    # --- cancel -----------------------------------------------------------------------

    def remote_to_cancel(self, task_id: int, state: dict[str, Any] | None) -> bool:
        return _remote_id(task_id, state) is not None

    def cancel_step(self, state: dict[str, Any], ctx: StepContext) -> Continue | None:
        """One round of remote cancellation: read the last round's call, request the next (tasks/cancel
        until one is answered, then polls). No requests once the remote stopped or is gone, or the time to
        confirm ran out (measured from the first round, after at least one attempt); None when there is no
        remote task."""
        remote_id = _remote_id(ctx.task.pk, state)
        if remote_id is None:
            return None
        now = clock.now()
        state = {**self.initial_state(ctx.input), **state, "remote": remote_id}
        awaiting = state.get("awaiting")
        attempts = state.get("cancel_attempts", 0)
        # A step's call still out when the cancel came (a poll, say) is never read: only the rounds' own are.
        outcome = _awaited(ctx) if awaiting in ("cancel", "cancel_poll") else None
        at: datetime | None = None
        events: list[NewEvent] = []
        facts: dict[str, Any] = {}
        if outcome is None and _last_remote_status(ctx.task.pk) in STOPPED:
            return Continue(state, events)  # the last poll saw it stop: nothing to cancel
        if outcome is not None and outcome.finished:
            done_at = _finished_at(ctx)
            if not outcome.ok:
                # Counted, and kept if it was the cancel's, but never "tracking degraded": the task is ending.
                state["errors"] = state.get("errors", 0) + 1
                at = done_at + _retry_delay(state)
                if awaiting == "cancel":
                    facts["cancel_error"] = _shown(outcome.error_message, ctx) or "the cancel failed"
            elif awaiting == "cancel":
                state["cancel_sent"] = True  # or the server did not know the task: the poll tells which
                events.append(NewEvent("remote_cancel_sent", {"attempts": attempts}))
                facts["cancel_error"] = ""
            elif "gone" in outcome.result or "protocol_error" in outcome.result \
                    or outcome.result["task"]["status"] in STOPPED:
                return Continue(state, events, remote=_remote_facts(facts))  # stopped, one way or another
            else:
                state["errors"] = 0
                at = done_at + _poll_interval(outcome.result["task"]["poll_interval_ms"])
        started = state.setdefault("cancel_started", now.isoformat())
        window_ends = datetime.fromisoformat(started) + timedelta(seconds=settings.LONGHAUL_MCP_CANCEL_CONFIRM_SECONDS)
        out_of_time = now > window_ends
        if out_of_time and state.get("cancel_tries", 0) > 0:
            tried = f"{attempts} attempt" + ("" if attempts == 1 else "s")
            events.append(NewEvent("remote_cancel_unconfirmed", {
                "attempts": attempts,
                "message": f"the remote server did not confirm the cancel after {tried}; it may still be running"}))
            return Continue(state, events, remote=_remote_facts(facts))
        try:
            _server_config(ctx.task)
        except PermanentError:
            events.append(NewEvent("remote_cancel_unconfirmed", {"attempts": attempts,
                                                                 "message": "the MCP server is no longer configured"}))
            return Continue(state, events, remote=_remote_facts(facts))
        state["cancel_tries"] = state.get("cancel_tries", 0) + 1
        if at is not None:
            at = min(at, window_ends)  # a server asking for hourly polls does not stretch the window to hours
        server = ctx.input["server"]
        if not state.get("cancel_sent"):
            request, awaiting = calls.cancel(server, remote_id, at=at), "cancel"
            state["cancel_attempts"] = attempts + 1
            facts["cancel_attempts"] = attempts + 1
        else:
            request, awaiting = calls.get(server, remote_id, at=at), "cancel_poll"
        return Continue({**state, "awaiting": awaiting}, events, [request], remote=_remote_facts(facts))

    def abandon(self, task: Task, state: dict[str, Any] | None) -> list[OpRequest]:
        remote_id = _remote_id(task.pk, state)
        if remote_id is None or (state or {}).get("cancel_sent"):
            return []
        if _last_remote_status(task.pk) in STOPPED:
            return []  # it stopped on its own: nothing to stop
        if task.remote_handle != remote_id and _tracked_elsewhere(task, remote_id):
            return []  # another of the owner's tasks follows this remote task: its work is not ours to stop
        return [calls.cancel(task.input["server"], remote_id, abandon=True)]


def _upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written before questions were asked one at a time ("asked": every open request)."""
    asked = state.pop("asked", None)
    if asked and state["asking"] is None:
        first = asked[0]
        state["asking"] = {"key": first["key"], "method": first["method"], "message": first["message"],
                           "schema": first["schema"]}
    return state


def _server_config(task: Task) -> client.ServerConfig:
    server = config.servers().get(task.input["server"])
    if server is None or not server.allows(task.tenant.slug):
        raise PermanentError("the MCP server is no longer configured for this workspace")
    return server.config


def _shown(text: str, ctx: StepContext) -> str:
    """A text for the owner's eyes: without the remote task id or the server's internals, bounded."""
    handles = {ctx.task.remote_handle}
    outcome = _awaited(ctx)
    if outcome is not None:
        handles.add(outcome.args.get("remote"))
        if isinstance(outcome.result, dict) and isinstance(outcome.result.get("task"), dict):
            handles.add(str(outcome.result["task"].get("task_id") or ""))
    text = calls.redact(text, server=ctx.input["server"])
    for handle in handles:
        if handle:
            text = calls.redact(text, handle=handle)
    return text


def _usable_servers(tenant: Tenant | None) -> list[config.Server]:
    return config.for_tenant(tenant.slug) if tenant is not None else list(config.servers().values())


def _named_server(typed: str, tenant: Tenant | None) -> config.Server | None:
    """The server `typed` names, by its title or its configured name, case-insensitively (as chat's
    find_server), among those the tenant may use."""
    wanted = typed.strip().casefold()
    usable = _usable_servers(tenant)
    return next((s for s in usable if s.title.casefold() == wanted), None) \
        or next((s for s in usable if s.name.casefold() == wanted), None)


def _tracked_elsewhere(task: Task, handle: str) -> bool:
    """Whether another of the owner's active tasks follows this remote task on the same server (one that
    ended lets go of it: servers may reuse ids)."""
    return (Task.objects.filter(owner_id=task.owner_id, remote_server=task.input["server"], remote_handle=handle)
            .exclude(status__in=TERMINAL).exclude(pk=task.pk).exists())


def _awaited(ctx: StepContext) -> OpOutcome | None:
    """The outcome of the one call the last step (or cancel round) requested."""
    outcomes = ctx.requested_outcomes()
    return outcomes[-1] if outcomes else None


def _finished_at(ctx: StepContext) -> datetime:
    """When the call the last step requested finished: the schedule counts from then, not from this step."""
    step = ctx.step - 1
    finished = (Operation.objects.filter(task_id=ctx.task.pk, step=step, mode=Operation.Mode.GATEWAY,
                                         finished_at__isnull=False)
                .exclude(key__startswith=f"{ctx.task.pk}:{step}:a")
                .order_by("-n").values_list("finished_at", flat=True).first())
    return finished or clock.now()


def _due(ctx: StepContext, at: datetime) -> datetime:
    """`at`, or the task's wall-time deadline if that comes first (the budget ends it then)."""
    started = ctx.task.started_at
    if started is None:
        return at
    return min(at, started + timedelta(seconds=Budget.of(ctx.task.budget).max_wall_seconds))


def _last_remote_status(task_id: int) -> str | None:
    """What the last answered call said of the remote task (a poll's, or the handle's): its status or "gone"."""
    last = (Operation.objects.filter(task_id=task_id, kind=calls.KIND, name__in=(calls.GET, calls.CALL_TOOL),
                                     status=OperationStatus.SUCCEEDED)
            .order_by("-finished_at", "-id").values_list("result", flat=True).first())
    if not isinstance(last, dict):
        return None
    if "gone" in last:
        return "gone"
    remote = last.get("task")
    return remote.get("status") if isinstance(remote, dict) else None


def _facts(facts: RemoteFacts | None) -> dict[str, Any]:
    if facts is None:
        return {}
    return {name: getattr(facts, name) for name in ("handle", "server", "poll_error", "cancel_attempts",
                                                    "cancel_error")}


def _remote_facts(values: dict[str, Any]) -> RemoteFacts | None:
    return RemoteFacts(**values) if values else None


def _backed_off(state: dict[str, Any], outcome: OpOutcome) -> tuple[dict[str, Any], list[NewEvent], timedelta, bool]:
    """After a failed call: the state, events, the delay before the next one, and whether tracking is degraded."""
    errors = state.get("errors", 0) + 1
    delay = _retry_delay({**state, "errors": errors})
    degraded = errors >= DEGRADED_AFTER
    events = []
    if degraded and not state.get("degraded"):
        # Fixed words: a server's own error text may carry its task id.
        kind = "not reachable" if outcome.error_class == ErrorClass.TRANSIENT else "answering with errors"
        events.append(NewEvent("tracking_degraded", {"errors": errors, "message": f"the MCP server is {kind}"}))
    return {**state, "errors": errors, "degraded": degraded}, events, delay, degraded


def _retry_delay(state: dict[str, Any]) -> timedelta:
    """How long after its `errors`-th failure in a row a call is tried again: min(interval * 2^(n-1), cap)."""
    base = _poll_interval(state.get("poll_ms")).total_seconds()
    errors = max(1, state.get("errors", 1))
    return timedelta(seconds=min(base * 2 ** min(errors - 1, 16), settings.LONGHAUL_MCP_BACKOFF_CAP_SECONDS))


def _poll_interval(server_ms: int | None) -> timedelta:
    """The server's poll interval within our floor and 24 hours (unknown: the floor)."""
    floor = timedelta(milliseconds=settings.LONGHAUL_MCP_POLL_FLOOR_MS)
    if server_ms is None:
        return floor
    # Clamped as a number first: a huge finite interval (1e17 ms) is past what a timedelta holds.
    ceiling_ms = POLL_CEILING / timedelta(milliseconds=1)
    return max(timedelta(milliseconds=min(server_ms, ceiling_ms)), floor)


def _remote_id(task_id: int, state: dict[str, Any] | None) -> str | None:
    """The remote task id from the checkpoint, or from the tools/call's outcome when no step has read it
    yet (a cancel came while the call was out, or the task ended meanwhile)."""
    if state and state.get("remote"):
        return str(state["remote"])
    submitted = (Operation.objects.filter(task_id=task_id, name__in=(calls.CALL_TOOL, LEGACY_SUBMIT),
                                          status=OperationStatus.SUCCEEDED)
                 .order_by("-id").values_list("result", flat=True).first())
    if isinstance(submitted, dict) and "task" in submitted:
        return str(submitted["task"]["task_id"])
    return None
