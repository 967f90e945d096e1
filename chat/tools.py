"""The chat agent's built-in tools. Names, never ids: the model and the user refer to tasks by name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from chat.models import Run, Thread
from tasks import actions
from tasks.errors import Conflict, InvalidInput, QuotaExceeded
from tasks.gateway.untrusted import neutralize_name
from tasks.models import Task
from tasks.serializers import display_name
from tasks.statuses import TERMINAL, TaskStatus

if TYPE_CHECKING:
    from tasks.mcp.config import Server  # loaded only where a remote tool is used (the MCP SDK is heavy)

PROJECTION_LIMIT = 20
PREVIEW_CHARS = 200
FILLER = frozenset("the a an my this that task tasks research background job please".split())


@dataclass(frozen=True)
class ToolReply:
    """What a tool tells the agent, and what the thread's message data may record."""

    text: str
    data: dict[str, Any]


# A task's status in the assistant's words.
STATUS_WORDS = {
    TaskStatus.QUEUED: gettext_lazy("queued"),
    TaskStatus.RUNNING: gettext_lazy("running"),
    TaskStatus.WAITING_TOOL: gettext_lazy("waiting tool"),
    TaskStatus.WAITING_INPUT: gettext_lazy("waiting input"),
    TaskStatus.RETRY_WAIT: gettext_lazy("retry wait"),
    TaskStatus.PAUSED: gettext_lazy("paused"),
    TaskStatus.PARTIAL: gettext_lazy("partial"),
    TaskStatus.SUCCEEDED: gettext_lazy("succeeded"),
    TaskStatus.FAILED: gettext_lazy("failed"),
    TaskStatus.CANCELLED: gettext_lazy("cancelled"),
}


def status_words(status: str) -> str:
    """A status as the assistant says it ("waiting input", "等待回答")."""
    return str(STATUS_WORDS.get(status, status.replace("_", " ")))


def thread_tasks(thread: Thread) -> list[Task]:
    """The thread's tasks, active first, newest first; at most PROJECTION_LIMIT."""
    tasks = list(Task.objects.filter(thread=thread).order_by("-created_at")[:100])
    tasks.sort(key=lambda t: (t.status in TERMINAL, -t.created_at.timestamp()))
    return tasks[:PROJECTION_LIMIT]


def project(task: Task) -> dict[str, Any]:
    """The whitelisted view of a task given to the agent."""
    result = task.result if isinstance(task.result, dict) else {}
    preview = str(result.get("summary") or result.get("report") or "")[:PREVIEW_CHARS]
    view = {"name": neutralize_name(task.name), "kind": task.kind, "status": task.status,
            "created": task.created_at.isoformat(timespec="seconds"),
            "updated": task.updated_at.isoformat(timespec="seconds")}
    if preview:
        view["result_preview"] = preview
    if task.status == TaskStatus.WAITING_INPUT:
        view["question"] = task.question[:500]
    return view


def _tokens(text: str) -> list[str]:
    return [w for w in re.findall(r"[\w.]+", text.lower()) if w not in FILLER]


def find_task(thread: Thread, name: str, *, active_only: bool) -> Task | str:
    """The one task a name refers to, or a message listing the candidates by name."""
    tasks = [t for t in thread_tasks(thread) if not active_only or t.status not in TERMINAL]
    if not tasks:
        return _("There are no active background tasks in this conversation.") if active_only else \
            _("There are no background tasks in this conversation.")
    wanted = name.strip().lower()
    exact = [t for t in tasks if t.name.lower() == wanted]
    if len(exact) == 1:
        return exact[0]
    words = _tokens(name)
    matches = [t for t in tasks if words and all(w in t.name.lower() for w in words)] if words else []
    if len(matches) == 1:
        return matches[0]
    # Translators: ", " joins the quoted names of a list of tasks.
    names = _(", ").join(_("“%(name)s”") % {"name": neutralize_name(t.name)} for t in (matches or tasks)[:10])
    if matches:
        return _("More than one task matches “%(name)s”: %(names)s. Which one do you mean?") % {
            "name": neutralize_name(name), "names": names}
    return _("No task matches “%(name)s”. The tasks here are: %(names)s.") % {"name": neutralize_name(name),
                                                                               "names": names}


def start_background_task(run: Run, *, kind: str, name: str, input: dict[str, Any], n: int = 0) -> ToolReply:
    thread = run.thread
    try:
        task, created = actions.submit(
            tenant=thread.tenant, user=thread.owner,
            submission=actions.Submission(kind=kind, input=input, name=name, thread_id=thread.pk,
                                          # A run replayed after a crash submits the same task, not a second one.
                                          idempotency_key=f"run:{run.public_id}:{n}"),
        )
    except (InvalidInput, QuotaExceeded, Conflict) as exc:
        return ToolReply(_("Could not start the task: %(error)s") % {"error": exc}, {"error": True})
    return ToolReply(_("Started “%(name)s” in the background (%(status)s).")
                     % {"name": neutralize_name(task.name), "status": status_words(task.status)},
                     {"started": str(task.public_id), "created": created})


def start_remote_tool(run: Run, *, server: str, tool: str, arguments: dict[str, Any], name: str = "",
                      n: int = 0) -> ToolReply:
    """Run a tool of a configured MCP server as a background task; the thread is told how it ends.

    `server` is what the user or the model wrote: a server's display name (or its configured name);
    the configured name goes into the task's input and never back into the conversation."""
    found = resolve_server(run, server)
    if isinstance(found, ToolReply):
        return found
    return start_on_server(run, found, tool=tool, arguments=arguments, name=name, n=n)


def start_on_server(run: Run, server: Server, *, tool: str, arguments: dict[str, Any], name: str = "",
                    n: int = 0) -> ToolReply:
    """Run `tool` of a resolved server as a background task."""
    name = name or remote_task_name(server, tool)
    return start_background_task(run, kind="mcp", name=name,
                                 input={"server": server.name, "tool": tool, "arguments": arguments}, n=n)


def remote_task_name(server: Server, tool: str) -> str:
    return _("%(tool)s on %(server)s") % {"tool": tool, "server": display_name(server)}


def resolve_server(run: Run, typed: str) -> Server | ToolReply:
    """The configured server `typed` names (see find_server), or a ToolReply naming the servers there are."""
    found = find_server(run, typed)
    if found is not None:
        return found
    titles = _(", ").join(f"“{s['name']}”" for s in remote_servers(run))
    if not titles:
        return ToolReply(_("No remote tools are set up for this workspace."), {"error": True})
    return ToolReply(_("There is no remote server called “%(server)s”. The servers here are: %(servers)s.")
                     % {"server": neutralize_name(typed), "servers": titles}, {"error": True})


def find_server(run: Run, typed: str) -> Any:
    """The configured server (tasks.mcp.config.Server) of this workspace that `typed` names, or None."""
    from tasks.mcp import config

    wanted = typed.strip().casefold()
    servers = config.for_tenant(run.thread.tenant.slug)
    return next((s for s in servers if display_name(s).casefold() == wanted), None) \
        or next((s for s in servers if s.name.casefold() == wanted), None)


def remote_servers(run: Run) -> list[dict[str, str]]:
    """The MCP servers this thread's workspace may use, by display name, for the agent and the user."""
    from tasks.mcp import config

    return [{"name": display_name(s), "description": s.description} for s in config.for_tenant(run.thread.tenant.slug)]


def list_background_tasks(run: Run) -> ToolReply:
    views = [project(t) for t in thread_tasks(run.thread)]
    return ToolReply(str(views), {"tasks": len(views)})


def cancel_background_task(run: Run, *, name: str) -> ToolReply:
    found = find_task(run.thread, name, active_only=True)
    if isinstance(found, str):
        return ToolReply(found, {"ambiguous": True})
    return cancel_task(found, user=run.thread.owner)


def cancel_task(found: Task, *, user: Any) -> ToolReply:
    """Ask a task of the thread to stop; what the thread is told."""
    task = actions.request_cancel(found, user=user, reason="asked in chat")
    if task.status == TaskStatus.CANCELLED:
        text = _("“%(name)s” is cancelled.") % {"name": neutralize_name(task.name)}
    else:
        text = _("“%(name)s” is being cancelled.") % {"name": neutralize_name(task.name)}
    return ToolReply(text, {"cancelled": str(task.public_id)})


def answer_background_task(run: Run, *, name: str, answer: str) -> ToolReply:
    waiting = [t for t in thread_tasks(run.thread) if t.status == TaskStatus.WAITING_INPUT]
    found: Task | str
    if not name.strip() and len(waiting) == 1:
        found = waiting[0]
    else:
        found = find_task(run.thread, name, active_only=True)
    if isinstance(found, str):
        return ToolReply(found, {"ambiguous": True})
    try:
        task = actions.answer(found, user=run.thread.owner, text=answer)
    except (Conflict, InvalidInput) as exc:
        return ToolReply(str(exc), {"error": True})
    return ToolReply(_("Passed your answer to “%(name)s”; it goes on.") % {"name": neutralize_name(task.name)},
                     {"answered": str(task.public_id)})


def debug_kinds_enabled() -> bool:
    return bool(settings.LONGHAUL_DEBUG_DRIVERS)
