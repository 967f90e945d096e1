"""Side effects the model proposes: a remote tool call or a cancel waits in the thread as a card until
the thread's owner confirms it.

With the openai provider the model chooses tools itself, and a quoted web page or a remote tool's
result can talk it into calling one; the user cannot be. So the model's `start_remote_tool` and
`cancel_background_task` become a Proposal here, and run only on the user's confirm (once: the
proposal row is locked and moved pending -> confirmed in the transaction that submits, and the task
keeps the run's idempotency key for the tool call). A server marked `confirm = false` in the servers
file is trusted: its tools run at once. What the user types themselves never comes here.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils.translation import gettext as _

from chat import tools
from chat.models import Message, Proposal, Run, Thread
from chat.streams import thread_group
from tasks import clock
from tasks.drivers import get_driver
from tasks.errors import Conflict, InvalidInput
from tasks.gateway.untrusted import neutralize_name
from tasks.models import AuditEntry, Task
from tasks.serializers import display_name
from tasks.statuses import TERMINAL

DECISIONS = ("confirm", "decline")
OUTCOME_CHARS = 4000


class AlreadyDecided(Conflict):
    """The proposal was confirmed or declined before: deciding again changes nothing."""

    def __init__(self, proposal: Proposal) -> None:
        super().__init__(f"this proposal was already {proposal.status}", code="already_decided")
        self.proposal = proposal


# --- proposing (the model's tool calls, from chat.agent) --------------------------------------


def propose_remote_tool(run: Run, *, server: str, tool: str, arguments: dict[str, Any], name: str,
                        n: int) -> tools.ToolReply:
    """A remote tool call the model asked for: a card for the user, or at once on a trusted server."""
    found = tools.resolve_server(run, server)
    if isinstance(found, tools.ToolReply):
        return found
    if not found.confirm:
        return tools.start_on_server(run, found, tool=tool, arguments=arguments, name=name, n=n)
    try:
        # Checked now, so that a card offers only what a confirm can start.
        get_driver("mcp").validate_input({"server": found.name, "tool": tool, "arguments": arguments},
                                         tenant=run.thread.tenant)
    except InvalidInput as exc:
        return tools.ToolReply(_("Could not start the task: %(error)s") % {"error": exc}, {"error": True})
    name = (name.strip() or tools.remote_task_name(found, tool))[:200]
    return _propose(run, n, Proposal.Action.START_REMOTE_TOOL,
                    {"server": found.name, "server_title": display_name(found), "tool": tool,
                     "arguments": arguments, "name": name})


def propose_cancel(run: Run, *, name: str, n: int) -> tools.ToolReply:
    """A cancel the model asked for: the card names the one task it would stop (resolved now)."""
    found = tools.find_task(run.thread, name, active_only=True)
    if isinstance(found, str):
        return tools.ToolReply(found, {"ambiguous": True})
    return _propose(run, n, Proposal.Action.CANCEL_BACKGROUND_TASK, {"task": str(found.public_id),
                                                                      "name": found.name})


def _propose(run: Run, n: int, action: str, arguments: dict[str, Any]) -> tools.ToolReply:
    now = clock.now()
    with transaction.atomic():
        # (run, n) is unique: a run replayed after a crash finds its proposal instead of making a second card.
        proposal, created = Proposal.objects.get_or_create(
            run=run, n=n, defaults={"thread_id": run.thread_id, "tenant_id": run.tenant_id, "action": action,
                                    "arguments": arguments, "created_at": now})
        if created:
            Message.objects.create(thread_id=run.thread_id, role=Message.Role.ASSISTANT, content=describe(proposal),
                                   data={"proposal": str(proposal.public_id)}, created_at=now)
            _wake(run.thread)
    return tools.ToolReply(_("Waiting for the user to confirm in the thread; nothing has run yet."),
                           {"proposed": str(proposal.public_id)})


def describe(proposal: Proposal) -> str:
    """The card's words (also what the model reads of it in the history)."""
    args = proposal.arguments
    if proposal.action == Proposal.Action.CANCEL_BACKGROUND_TASK:
        return _("I'd like to cancel **%(name)s**. Nothing happens until you confirm.") % {
            "name": neutralize_name(str(args.get("name", "")))}
    return _("I'd like to run **%(tool)s** on **%(server)s**. Nothing runs until you confirm.") % {
        "tool": neutralize_name(str(args.get("tool", ""))), "server": str(args.get("server_title", ""))}


# --- deciding (the user, through chat.api) -----------------------------------------------------


def decide(proposal: Proposal, *, user: Any, decision: str) -> Proposal:
    """pending -> confirmed (its action runs, once) or declined; the thread is told either way."""
    if decision not in DECISIONS:
        raise InvalidInput(f"decision must be one of {', '.join(DECISIONS)}", field="decision")
    now = clock.now()
    with transaction.atomic():
        # The thread's row first, as every message and run takes it before any task's (chat/runs.py):
        # confirming locks the task it cancels or admits, and the message telling it then needs the thread.
        Thread.objects.select_for_update().filter(pk=proposal.thread_id).first()
        fresh = Proposal.objects.select_for_update(of=("self",)).select_related(
            "run__thread__tenant", "run__thread__owner").get(pk=proposal.pk)
        if fresh.status != Proposal.Status.PENDING:
            raise AlreadyDecided(fresh)
        if decision == "confirm":
            reply, status = _carry_out(fresh), Proposal.Status.CONFIRMED
        else:
            reply, status = tools.ToolReply(_("Declined: nothing was run."), {}), Proposal.Status.DECLINED
        Proposal.objects.filter(pk=fresh.pk, status=Proposal.Status.PENDING).update(
            status=status, decided_at=now, decided_by=user, outcome=reply.text[:OUTCOME_CHARS])
        Message.objects.create(thread_id=fresh.thread_id, role=Message.Role.ASSISTANT, content=reply.text,
                               data={**reply.data, "decides": str(fresh.public_id)}, created_at=now)
        AuditEntry.objects.create(tenant_id=fresh.tenant_id, actor=user, action=f"proposal.{decision}",
                                  target_type="proposal", target_id=str(fresh.public_id), at=now,
                                  details={"action": fresh.action, "error": bool(reply.data.get("error"))})
        _wake(fresh.run.thread)
    fresh.refresh_from_db()
    return fresh


def _carry_out(proposal: Proposal) -> tools.ToolReply:
    """Do what the proposal says, as the model's tool call would have. Inside decide's transaction."""
    from tasks.mcp import config

    run, args = proposal.run, proposal.arguments
    if proposal.action == Proposal.Action.CANCEL_BACKGROUND_TASK:
        task = Task.objects.filter(public_id=args.get("task"), tenant_id=proposal.tenant_id,
                                   thread_id=proposal.thread_id).first()
        if task is None:
            return tools.ToolReply(_("“%(name)s” no longer exists; nothing to cancel.")
                                   % {"name": neutralize_name(str(args.get("name", "")))}, {"error": True})
        if task.status in TERMINAL:
            return tools.ToolReply(_("“%(name)s” has already ended (%(status)s); nothing to cancel.")
                                   % {"name": neutralize_name(task.name), "status": tools.status_words(task.status)},
                                   {"task": str(task.public_id)})
        return tools.cancel_task(task, user=run.thread.owner)
    server = next((s for s in config.for_tenant(run.thread.tenant.slug) if s.name == args.get("server")), None)
    if server is None:
        return tools.ToolReply(_("“%(server)s” is no longer set up for this workspace; nothing was started.")
                               % {"server": str(args.get("server_title", ""))}, {"error": True})
    # The run's key for this tool call: however often confirm is pressed, one task.
    return tools.start_on_server(run, server, tool=str(args.get("tool", "")), arguments=args.get("arguments") or {},
                                 name=str(args.get("name", "")), n=proposal.n)


def _wake(thread: Thread) -> None:
    from tasks.events import wake_group

    transaction.on_commit(lambda: wake_group(thread_group(thread.pk)))
