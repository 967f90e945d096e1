"""The `longhaul` command line: thin commands over longhaul.client.

Output: a command's product goes to stdout (a table, a report, JSON); progress and errors go to
stderr, so `longhaul research "..." --wait > report.md` keeps only the report. Every error is
one line and an exit code from longhaul.outcomes; `--json` makes both machine-readable.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from longhaul import __version__, config
from longhaul.client import Client
from longhaul.display import Watcher, result_markdown, task_line, task_table
from longhaul.errors import AuthenticationFailed, LonghaulError, NotFound
from longhaul.outcomes import EXIT_CODES_HELP, Exit, for_error, for_status
from longhaul.shapes import TERMINAL, WAITS_FOR_PERSON, Event, Task

ACTIVE = ["queued", "running", "waiting_tool", "waiting_input", "retry_wait", "paused", "partial"]
MAX_NAME = 200  # the API's longest task name

app = typer.Typer(
    name="longhaul",
    help="Submit, watch, answer and cancel Longhaul background tasks from a terminal.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
run_app = typer.Typer(help="Run a remote tool as a background task.", no_args_is_help=True)
app.add_typer(run_app, name="run")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts; errors too, on stderr.")]
WaitOption = Annotated[bool, typer.Option("--wait", help="Watch until the task ends, then print its result.")]
NameOption = Annotated[str | None, typer.Option("--name", help="The task's name (default: from the input).")]
Ref = Annotated[str, typer.Argument(metavar="ID|NAME", help="A task id, or a task's exact name.")]


# --- plumbing -----------------------------------------------------------------------

def print_json(value: Any) -> None:
    # flush per line: a script reading `watch --json` acts on each event as it comes.
    print(json.dumps(value, ensure_ascii=False), flush=True)


def fail(exc: LonghaulError, *, as_json: bool) -> NoReturn:
    """One line on stderr, then the outcome's exit code."""
    if as_json:
        body = {"error": exc.message, "code": exc.code}
        if exc.field:
            body["field"] = exc.field
        print(json.dumps(body, ensure_ascii=False), file=sys.stderr, flush=True)
    else:
        where = f", field {exc.field}" if exc.field else ""
        hint = "; run `longhaul login URL` with a valid token" if isinstance(exc, AuthenticationFailed) else ""
        err.print(f"error: {exc.message} ({exc.code}{where}){hint}", markup=False)
    raise typer.Exit(int(for_error(exc)))


def usage(message: str, *, as_json: bool) -> NoReturn:
    if as_json:
        print(json.dumps({"error": message, "code": "usage"}), file=sys.stderr, flush=True)
    else:
        err.print(f"error: {message}", markup=False)
    raise typer.Exit(int(Exit.USAGE))


@contextmanager
def reporting(*, as_json: bool) -> Iterator[None]:
    """Turns the client's typed errors into one line and an exit code; Ctrl-C into 130."""
    try:
        yield
    except LonghaulError as exc:
        fail(exc, as_json=as_json)
    except KeyboardInterrupt:
        raise typer.Exit(int(Exit.INTERRUPTED)) from None


def connect() -> Client:
    return Client.from_config()


def find_task(client: Client, ref: str, *, status: list[str] | None = None) -> Task:
    """The task `ref` names (an id, or a name; among `status` when given), with a message naming it."""
    try:
        return client.resolve(ref, status=status)
    except NotFound as exc:
        among = " among active tasks" if status == ACTIVE else ""
        raise NotFound(f"no task has the id or name {ref!r}{among}", status=exc.status, code=exc.code) from exc


def parse_json_object(raw: str, *, option: str, as_json: bool) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        usage(f"{option} is not valid JSON: {exc}", as_json=as_json)
    if not isinstance(value, dict):
        usage(f"{option} must be a JSON object", as_json=as_json)
    return value


# --- watching -----------------------------------------------------------------------

def settled(client: Client, task_id: str, event: Event) -> Task | None:
    """The task, if `event` left it waiting for a person and nothing has happened since; else None."""
    if event["status"] not in WAITS_FOR_PERSON:
        return None
    task = client.get(task_id)
    waiting = task.get("status") in WAITS_FOR_PERSON and task.get("last_event_seq", 0) <= event["seq"]
    return task if waiting else None


def watch_task(client: Client, task: Task, *, after: int, show: Callable[[Event], None]) -> Task:
    """Show every event after `after` until the task ends or waits for a person; the task then.

    Ctrl-C stops watching and leaves the task running (KeyboardInterrupt carries on up)."""
    if task.get("status") in WAITS_FOR_PERSON and task.get("last_event_seq", 0) <= after:
        return task
    follow = client.follow(task["id"], after=after)
    try:
        for event in follow:
            show(event)
            if (now := settled(client, task["id"], event)) is not None:
                return now
    except KeyboardInterrupt:
        err.print(f"stopped watching; the task goes on. Resume with: longhaul watch {task['id']} "
                  f"--after {follow.cursor}", markup=False)
        raise
    return client.get(task["id"])


def watch_and_report(client: Client, task: Task, *, after: int, as_json: bool, console: Console) -> Task:
    """Watch with a live display on `console`, or as JSON lines; ends with the final status line."""
    if as_json:
        final = watch_task(client, task, after=after, show=print_json)
        kind = "end" if final.get("status") in TERMINAL else "waiting"
        print_json({"type": kind, "status": final.get("status"), "result_version": final.get("result_version", 0),
                    "question": final.get("question", "")})
        return final
    with Watcher(console, task) as watcher:
        final = watch_task(client, task, after=after, show=watcher.show)
    describe_outcome(final, console)
    return final


def describe_outcome(task: Task, console: Console) -> None:
    status = task.get("status", "")
    line = f"{task['id']} {status}"
    if status == "failed" and task.get("error_message"):
        line += f": {task['error_message']}"
    if status == "waiting_input":
        line += f". It asks: {task.get('question', '')}\nAnswer with: longhaul answer {task['id']} TEXT"
    if status == "paused":
        line += f". Resume with: longhaul resume {task['id']}"
    if task.get("result_version", 0) and status not in ("failed", "waiting_input"):
        line += f" (result v{task['result_version']}: longhaul result {task['id']})"
    console.print(line, markup=False)


def submit_and_maybe_wait(client: Client, kind: str, task_input: dict[str, Any], *, name: str, wait: bool,
                          as_json: bool) -> None:
    task = client.submit(kind, task_input, name=name)
    if not wait:
        if as_json:
            print_json(task)
        else:
            out.print(task_line(task))
            err.print(f"watch it with: longhaul watch {task['id']}", markup=False)
        return
    # --wait: the display goes to stderr, so stdout carries the result alone.
    final = watch_and_report(client, task, after=0, as_json=False, console=err) if not as_json else \
        watch_task(client, task, after=0, show=lambda event: None)
    result = client.result(task["id"]) if final.get("result_version", 0) else None
    if as_json:
        print_json({"task": final, "result": result})
    elif result is not None:
        out.out(result_markdown(result["result"]), end="", highlight=False)
    raise typer.Exit(int(for_status(final.get("status", ""))))


# --- commands -----------------------------------------------------------------------

@app.callback()
def options(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Say on stderr how the stream connects.")] = False,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()
    if verbose:
        # The package's own logger only: httpx2's request lines would drown what matters.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("longhaul: %(message)s"))
        logger = logging.getLogger("longhaul")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


@app.command()
def login(
    url: Annotated[str, typer.Argument(help="The server, e.g. http://127.0.0.1:8000")],
    token: Annotated[str | None, typer.Option(help="An API token (manage.py drf_create_token USER); "
                                                   "asked for when left out.")] = None,
    tenant: Annotated[str | None, typer.Option(help="The tenant to act in, for a user in several.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Check a token against the server and store both in the config file (mode 0600)."""
    with reporting(as_json=as_json):
        token = token or typer.prompt("Token", hide_input=True)
        with Client(url, token, tenant=tenant) as client:
            me = client.me()
            path = config.save(config.Login(url=client.settings.url, token=token, tenant=tenant))
        if as_json:
            print_json({"url": client.settings.url, "username": me.get("username"), "tenant": me.get("tenant"),
                        "config": str(path)})
        else:
            where = f" in {me['tenant']['slug']}" if me.get("tenant") else ""
            out.print(f"signed in to {client.settings.url} as {me.get('username')}{where}; token kept in {path}",
                      markup=False)


@app.command()
def logout(as_json: JsonOption = False) -> None:
    """Forget the stored token."""
    removed = config.forget()
    if as_json:
        print_json({"removed": removed, "config": str(config.config_path())})
    else:
        out.print("signed out" if removed else "was not signed in")


@app.command()
def research(
    question: Annotated[str, typer.Argument(help="What to find out.")],
    name: NameOption = None,
    max_sources: Annotated[int | None, typer.Option(help="1 to 30.")] = None,
    depth: Annotated[int | None, typer.Option(help="1 to 3.")] = None,
    constraints: Annotated[str | None, typer.Option(help="Limits on what counts as an answer.")] = None,
    wait: WaitOption = False,
    as_json: JsonOption = False,
) -> None:
    """Start a research task; with --wait, watch it and print its report."""
    task_input: dict[str, Any] = {"question": question}
    for key, value in (("max_sources", max_sources), ("depth", depth), ("constraints", constraints)):
        if value is not None:
            task_input[key] = value
    with reporting(as_json=as_json), connect() as client:
        submit_and_maybe_wait(client, "research", task_input, name=name or question[:MAX_NAME], wait=wait,
                              as_json=as_json)


@run_app.command("mcp")
def run_mcp(
    server: Annotated[str, typer.Argument(help="A configured MCP server's name.")],
    tool: Annotated[str, typer.Argument(help="The tool to call.")],
    args: Annotated[str, typer.Option("--args", help="The tool's arguments as a JSON object.")] = "{}",
    name: NameOption = None,
    wait: WaitOption = False,
    as_json: JsonOption = False,
) -> None:
    """Call a tool on a remote MCP server as a background task."""
    arguments = parse_json_object(args, option="--args", as_json=as_json)
    with reporting(as_json=as_json), connect() as client:
        submit_and_maybe_wait(client, "mcp", {"server": server, "tool": tool, "arguments": arguments},
                              name=name or f"{tool} on {server}", wait=wait, as_json=as_json)


@app.command()
def watch(
    ref: Ref,
    after: Annotated[int, typer.Option(help="Show only events after this seq (to resume a watch).")] = 0,
    as_json: JsonOption = False,
) -> None:
    """Follow a task's events live until it ends or waits for you; Ctrl-C leaves it running.

    With --json: one JSON line per event, then {"type": "end"|"waiting", "status": ...}."""
    with reporting(as_json=as_json), connect() as client:
        final = watch_and_report(client, find_task(client, ref), after=after, as_json=as_json, console=out)
        raise typer.Exit(int(for_status(final.get("status", ""))))


@app.command("list")
def list_tasks(
    status: Annotated[str | None, typer.Option(help="Comma-separated statuses, e.g. running,queued.")] = None,
    kind: Annotated[str | None, typer.Option(help="research, mcp, ...")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first (1 to 200).")] = 50,
    as_json: JsonOption = False,
) -> None:
    """Your tasks, newest first."""
    with reporting(as_json=as_json), connect() as client:
        tasks = client.list(status=status, kind=kind, limit=limit)
        if as_json:
            print_json(tasks)
        elif tasks:
            out.print(task_table(tasks))
        else:
            err.print("no tasks")


@app.command()
def show(ref: Ref, as_json: JsonOption = False) -> None:
    """One task's state."""
    with reporting(as_json=as_json), connect() as client:
        task = find_task(client, ref)
        if as_json:
            print_json(task)
        else:
            describe_outcome(task, out)


@app.command()
def cancel(
    ref: Annotated[str, typer.Argument(metavar="ID|NAME", help="A task id, or an active task's exact name.")],
    reason: Annotated[str, typer.Option(help="Said in the task's events.")] = "",
    keep_results: Annotated[bool, typer.Option(help="End partial with what is done, instead of cancelled.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Stop a task (now, or at its next safe point). A name that matches several tasks lists them."""
    with reporting(as_json=as_json), connect() as client:
        task = find_task(client, ref, status=ACTIVE)
        task = client.cancel(task["id"], reason=reason, keep_results=keep_results)
        if as_json:
            print_json(task)
        else:
            out.print(f"cancel requested: {task_line(task)}")


@app.command()
def pause(ref: Ref, reason: Annotated[str, typer.Option()] = "", as_json: JsonOption = False) -> None:
    """Pause a task at its next safe point."""
    with reporting(as_json=as_json), connect() as client:
        task = client.pause(find_task(client, ref, status=ACTIVE)["id"], reason=reason)
        print_json(task) if as_json else out.print(f"pause requested: {task_line(task)}")


@app.command()
def resume(ref: Ref, as_json: JsonOption = False) -> None:
    """Resume a paused or partial task."""
    with reporting(as_json=as_json), connect() as client:
        task = client.resume(find_task(client, ref, status=["paused", "partial"])["id"])
        print_json(task) if as_json else out.print(f"resumed: {task_line(task)}")


@app.command()
def answer(
    ref: Ref,
    text: Annotated[str | None, typer.Argument(help="The answer, as text.")] = None,
    data: Annotated[str | None, typer.Option(
        help='A structured answer as JSON, e.g. \'{"action": "accept", "content": {"approve": true}}\'.')] = None,
    as_json: JsonOption = False,
) -> None:
    """Answer the question a task is waiting on."""
    if (text is None) == (data is None):
        usage("give the answer as TEXT or as --data JSON (one of them)", as_json=as_json)
    value: str | dict[str, Any] = text if text is not None else parse_json_object(data or "", option="--data",
                                                                                   as_json=as_json)
    with reporting(as_json=as_json), connect() as client:
        task = client.answer(find_task(client, ref, status=["waiting_input"])["id"], value)
        print_json(task) if as_json else out.print(f"answered: {task_line(task)}")


@app.command()
def result(
    ref: Ref,
    format: Annotated[str, typer.Option("--format", help="md: the report as Markdown; json: the whole result.")]
    = "md",
    as_json: JsonOption = False,
) -> None:
    """Print a task's result (a research task's report, by default as Markdown)."""
    if format not in ("md", "json"):
        usage(f"--format must be md or json, not {format!r}", as_json=as_json)
    with reporting(as_json=as_json), connect() as client:
        found = client.result(find_task(client, ref)["id"])
        if as_json or format == "json":
            print_json(found)
        else:
            sys.stdout.write(result_markdown(found["result"]))
            sys.stdout.flush()


@app.command()
def delete(ref: Ref, as_json: JsonOption = False) -> None:
    """Delete an ended task and everything it produced."""
    with reporting(as_json=as_json), connect() as client:
        task = find_task(client, ref)
        client.delete(task["id"])
        print_json({"deleted": task["id"]}) if as_json else out.print(f"deleted {task['id']}")


def main() -> None:
    """The console script. click exits with the command's code (typer.Exit), 2 on bad usage."""
    app()
