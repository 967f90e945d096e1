"""Chat pages: server-rendered shells that the page's ES module brings to life, and the cited-source page."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from uuid import UUID

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from chat.models import Thread
from tasks.gateway import corpus
from tasks.gateway.tools import CORPUS_SCHEME
from tasks.tenancy import visible_tasks


def _threads(request: HttpRequest):
    return Thread.objects.filter(tenant=request.tenant, owner=request.user).order_by("-updated_at")


@login_required
def chat_page(request: HttpRequest) -> HttpResponse:
    return render(request, "chat/page.html", {"threads": _threads(request)[:100], "tenant": request.tenant,
                                              "thread": None})


@login_required
def thread_page(request: HttpRequest, thread_id: UUID) -> HttpResponse:
    """A thread of the user's own; any other (another tenant's, deleted, unknown) is a 404."""
    thread = _threads(request).filter(public_id=thread_id).first()
    if thread is None:
        raise Http404("no such thread")
    return render(request, "chat/page.html", {"threads": _threads(request)[:100], "tenant": request.tenant,
                                              "thread": thread})


@dataclass(frozen=True)
class Block:
    """One block of a cited section: "code", "item" or "para", its text in pieces, the quoted ones marked."""

    kind: str
    pieces: list[tuple[str, bool]]


@login_required
def cited_source(request: HttpRequest, task_id: UUID, n: int) -> HttpResponse:
    """The section a research report cites as [n], read from the offline corpus, its quoted sentences marked.

    Only a task the user may see (visible_tasks: their own, or the tenant's for an admin);
    any other, or a source the report does not list, is a 404. Web sources are not kept,
    so their page shows the quotes and the address.
    """
    task = visible_tasks(request.user, request.tenant).filter(public_id=task_id, kind="research").first()
    result = task.result if task is not None and isinstance(task.result, dict) else {}
    source = next((s for s in result.get("sources", []) if isinstance(s, dict) and s.get("n") == n), None)
    if source is None:
        raise Http404("no such source")
    quotes = [e["quote"] for e in result.get("evidence", []) if e.get("n") == n and isinstance(e.get("quote"), str)]
    url = str(source.get("url", ""))
    in_corpus = url.startswith(CORPUS_SCHEME)
    document = None
    if in_corpus:
        try:
            corpus.ensure_index(wait_s=0)  # a page never waits for, nor fails on, an index being built
            document = corpus.read(url)
        except (sqlite3.Error, corpus.CorpusError):
            document = None
    blocks = _blocks(document["text"], quotes) if document else [Block("para", [(q, True)]) for q in quotes]
    return render(request, "chat/source.html", {
        "task": task, "source": source, "n": n, "blocks": blocks, "kept": document is not None,
        "in_corpus": in_corpus, "web_url": url if url.startswith(("http://", "https://")) else "",
        "headings": document["headings"].split(" \u203a ") if document and document["headings"] else [],
        "corpus": result.get("corpus", ""), "tenant": request.tenant,
    })


def _blocks(text: str, quotes: list[str]) -> list[Block]:
    """The corpus text as blocks (indented ones are code, "- " ones list items), the quotes marked where they stand."""
    blocks = []
    for raw in text.split("\n\n"):
        if not raw.strip():
            continue
        if all(line.startswith("    ") or not line.strip() for line in raw.split("\n")):
            blocks.append(Block("code", [("\n".join(line[4:] for line in raw.split("\n")), False)]))
            continue
        kind = "item" if raw.startswith("- ") else "para"
        blocks.append(Block(kind, _marked(raw[2:] if kind == "item" else raw, quotes)))
    return blocks


def _marked(text: str, quotes: list[str]) -> list[tuple[str, bool]]:
    spans = sorted({(i, i + len(q)) for q in quotes if q and (i := text.find(q)) >= 0})
    pieces, at = [], 0
    for start, end in spans:
        if start < at:
            continue  # overlapping quotes: the first one marks the text
        pieces += [(text[at:start], False), (text[start:end], True)]
        at = end
    pieces.append((text[at:], False))
    return [(piece, marked) for piece, marked in pieces if piece]
