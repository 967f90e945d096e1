"""How the command line shows tasks, events and results to a person (rich); --json bypasses all of it."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any, Self

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.table import Table

from longhaul.shapes import Event, Task

DETAIL_CHARS = 100
# Event kinds counted in the progress line: checkable facts, never a guessed percentage (DESIGN §6).
COUNTED = {"source_read": "sources read", "evidence_added": "quotes", "retry_scheduled": "retries"}
STATUS_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "partial": "yellow",
                "waiting_input": "magenta", "paused": "magenta"}


def styled_status(status: str) -> str:
    style = STATUS_STYLE.get(status)
    return f"[{style}]{status}[/]" if style else status


def task_table(tasks: list[Task]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("id", "name", "kind", "status", "created"):
        # Only the name may fold: ids and times are copied and pasted, and must stay whole.
        table.add_column(column, no_wrap=column != "name", overflow="fold")
    for task in tasks:
        table.add_row(task["id"], escape(task.get("name", "")), task.get("kind", ""),
                      styled_status(task.get("status", "")), task.get("created_at", "")[:16].replace("T", " "))
    return table


def task_line(task: Task) -> str:
    return f"{task['id']}  {styled_status(task.get('status', ''))}  {escape(task.get('name', ''))}"


def event_detail(data: Any) -> str:
    """An event's data in one short line: the facts a person scans for."""
    if not data:
        return ""
    if isinstance(data, dict):
        text = " ".join(f"{k}={v if isinstance(v, int | float) else json.dumps(v, ensure_ascii=False)}"
                        for k, v in data.items())
    else:
        text = json.dumps(data, ensure_ascii=False)
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 1] + "…"


def event_line(event: Event) -> str:
    clock = str(event.get("at", ""))[11:19]
    detail = event_detail(event.get("data"))
    return (f"[dim]#{event['seq']:<4}{clock}[/]  [bold]{escape(event['kind'])}[/]"
            + (f"  [dim]{escape(detail)}[/]" if detail else ""))


class Watcher:
    """Event lines as they come, under a live line with the phase and the counts so far."""

    def __init__(self, console: Console, task: Task) -> None:
        self.console = console
        self.task = task
        self.phase = task.get("status", "")
        self.counts: Counter[str] = Counter()
        self.started = time.monotonic()
        self._spinner = Spinner("dots", text=self._progress_text())
        # transient: the live line is scaffolding; the event lines above it are the record.
        self._live = Live(self._spinner, console=console, transient=True, refresh_per_second=8,
                          redirect_stdout=False, redirect_stderr=False)

    def __enter__(self) -> Self:
        self.console.print(f"watching {task_line(self.task)}", highlight=False)
        self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.stop()

    def note(self, text: str) -> None:
        self.console.print(f"[dim]{escape(text)}[/]", highlight=False)

    def show(self, event: Event) -> None:
        self.phase = event["kind"]
        if event["kind"] in COUNTED:
            self.counts[event["kind"]] += 1
        self.console.print(event_line(event), highlight=False, soft_wrap=True)
        self._spinner.update(text=self._progress_text())

    def _progress_text(self) -> str:
        parts = [self.phase] + [f"{n} {COUNTED[kind]}" for kind, n in self.counts.items()]
        parts.append(f"{time.monotonic() - self.started:.0f} s")
        return " · ".join(parts)


def result_markdown(result: Any) -> str:
    """A result as Markdown: a research report as written, an MCP tool's text, else JSON in a fence."""
    if isinstance(result, dict):
        if isinstance(result.get("report"), str):
            return result["report"]
        texts = [c.get("text") for c in result.get("content", []) if isinstance(c, dict)] \
            if isinstance(result.get("content"), list) else []
        if texts and all(isinstance(t, str) for t in texts):
            return "\n\n".join(texts) + "\n"
    if isinstance(result, str):
        return result if result.endswith("\n") else result + "\n"
    return "```json\n" + json.dumps(result, indent=2, ensure_ascii=False) + "\n```\n"
