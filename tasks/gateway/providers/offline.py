"""The offline provider: real text processing with no network (the default).

It splits a question into the sub-questions a person would ask (questions.py), picks the
sources' sentences that cover each, and composes a report that answers first, returning
the shapes of shapes.py.
"""

from __future__ import annotations

import asyncio
import math
import re
import sqlite3
from typing import Any

import httpx2

from tasks.gateway import corpus
from tasks.gateway.providers import ModelCall, ModelResult, questions
from tasks.gateway.providers.shapes import estimate_tokens, validate_payload
from tasks.gateway.retry import RetryBudget, Sleep
from tasks.gateway.untrusted import neutralize_name

OFFLINE_MODEL = "offline-extractive-1"



def plan_subquestions(question: str, max_subquestions: int) -> list[str]:
    """Sub-questions a person would ask (questions.py), asking "What is ...?" only about what the corpus names."""
    return questions.subquestions(question, max_subquestions, known=_known, names_for=_names_for)


def _names_for(question: str) -> list[str]:
    try:
        return corpus.documented_names(question)
    except (sqlite3.Error, corpus.CorpusError):
        return []


def _known(words: str) -> str | None:
    try:
        return corpus.names_a_document(words)
    except (sqlite3.Error, corpus.CorpusError):
        return "title"  # no index to ask: keep the phrase rather than lose the question's terms


# Words that hint at an aspect a sub-question asks about, and the words that tend to carry it.
ASPECT_CUES: tuple[tuple[frozenset[str], tuple[str, ...]], ...] = (
    (frozenset(["pitfall", "pitfalls", "caveat", "caveats", "gotcha", "gotchas", "risk", "risks", "problem", "problems", "mistake", "mistakes", "limitation", "limitations", "danger", "dangers"]),
     ("however", "unless", "but", "note", "warning", "caution", "avoid", "never", "careful", "unlike",
      "guarantee", "instead", "only", "must", "deadlock", "leak", "ignored", "lost")),
    (frozenset(["practice", "practical", "example", "examples", "usage", "idiom", "idioms", "pattern", "patterns", "used"]),
     ("example", "typical", "usage", "use", "pattern", "recommended", "for", "instance")),
    (frozenset(["compare", "comparison", "alternative", "alternatives", "versus", "vs", "differ", "difference", "differences"]),
     ("unlike", "instead", "whereas", "alternative", "similar", "compared", "difference", "rather")),
    (frozenset(["work", "works", "working", "mechanism", "internally", "happen", "happens"]),
     ("when", "arranges", "schedules", "raised", "raises", "called", "returns", "then")),
    (frozenset(["what", "definition", "define", "defined", "meaning"]),
     ("is", "are", "represents", "class", "object", "provides")),
)
CUE_WEIGHT = 0.4


def aspect_cues(subquestion: str) -> dict[str, float]:
    """Cue words for the aspects a sub-question asks about (pitfalls, practice, comparison, mechanism)."""
    words = {word.lower() for word in re.findall(r"\w+", subquestion)}
    cues: dict[str, float] = {}
    for triggers, hints in ASPECT_CUES:
        if words & triggers:
            cues.update(dict.fromkeys(hints, CUE_WEIGHT))
    return cues


_HOW_TO = re.compile(r"^\s*how (do|can|should|would|could) (i|you|we|one)\b|^\s*how to\b|\bexamples?\b", re.IGNORECASE)
CODE_LINES = 15
QUOTE_FLOOR = 0.6
# A source carrying less than this share of the best source's evidence is not cited.
SOURCE_FLOOR = 0.4


def extract_quotes(subquestion: str, sources: list[dict[str, Any]], max_quotes: int) -> list[dict[str, Any]]:
    """The sentences of the sources that best cover the sub-question, verbatim, best first.

    For a how-to, the best quote followed by a code example in its source brings that
    example along as "code" (verbatim, its indentation taken off).
    """
    texts = [source["text"] for source in sources]
    titles = [source.get("title") or "" for source in sources]
    ranked = corpus.rank_sentences(subquestion, texts, titles=titles, limit=max(0, max_quotes) * 4,
                                   cues=aspect_cues(subquestion))
    # With several sources, no one source may take every slot while others have something.
    per_source_cap = max_quotes if len(sources) == 1 else max(1, math.ceil(max_quotes / 2))
    picked: list[dict[str, Any]] = []
    held_back: list[dict[str, Any]] = []
    seen: set[str] = set()
    for hit in ranked:
        quote = texts[hit.doc][hit.start:hit.end]
        key = " ".join(quote.lower().split())
        if key in seen:
            continue
        seen.add(key)
        entry: dict[str, Any] = {"source_id": sources[hit.doc]["source_id"], "quote": quote, "score": hit.score,
                                 "_doc": hit.doc, "_end": hit.end}
        from_same = sum(1 for item in picked if item["source_id"] == entry["source_id"])
        (picked if from_same < per_source_cap else held_back).append(entry)
    picked = (picked + held_back)[:max_quotes]
    # A sentence far below the best one covers the question too thinly to be worth citing.
    if picked:
        best = max(entry["score"] for entry in picked)
        picked = [entry for entry in picked if entry["score"] >= QUOTE_FLOOR * best]
    if _HOW_TO.search(subquestion):
        for entry in picked:
            code = code_after(texts[entry["_doc"]], entry["_end"])
            if code:
                entry["code"] = code
                break
    for entry in picked:
        del entry["_doc"], entry["_end"]
    return picked


def code_after(text: str, position: int, *, within: int = 2) -> str:
    """The code block that follows `position` within `within` paragraphs, dedented, or ""."""
    blocks = text[position:].split("\n\n")
    for block in blocks[1:within + 1]:
        lines = block.split("\n")
        if block.strip() and all(line.startswith("    ") or not line.strip() for line in lines):
            code = [line[4:] for line in lines][:CODE_LINES]
            return "\n".join(code).strip("\n")
    return ""


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>#|])")
# A sentence that leans on its page's name to be understood ("This class implements ...").
# (An object's description reads "Return ..." or "This class ..." under its name.)
_NEEDS_SUBJECT = re.compile(r"^(?i:this|these|it|its|they|their|such|similar|like|return|returns|see|also|"
                            r"equivalent|same|here|the latter|the former)\b|^[a-z]")


def markdown_text(text: str) -> str:
    """Plain text safe inside Markdown: one line, markup characters escaped (so no stray [n] citations)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def _sentence(item: dict[str, Any], *, limit: int = 400) -> str:
    """One quoted sentence as a statement with its citation; one that needs a subject is introduced by its page."""
    text = " ".join(item["quote"].split())
    if len(text) > limit:
        cut = text.rfind(" ", 0, limit)
        text = text[: cut if cut > 0 else limit].rstrip(",;:") + "\u2026"
    sentence = markdown_text(text)
    title = neutralize_name(item.get("title") or "")
    if _NEEDS_SUBJECT.search(text) and _is_identifier(title):
        sentence = f"`{title}`: {sentence}"
    if not text.endswith((".", "!", "?", "\u2026")):
        sentence += "."
    return f"{sentence} [{item['n']}]"


def _is_identifier(title: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_][\w.]*", title)) and ("." in title or "_" in title)


def _code_block(code: str) -> str:
    fence = "````" if "```" in code else "```"
    return f"{fence}python\n{code}\n{fence}"


def draft_report(question: str, subquestions: list[str], evidence: list[dict[str, Any]], scope: str | None,
                 *, per_section: int = 2, answer_sentences: int = 4, max_sources: int = 3) -> str:
    """A Markdown report that answers first: a direct answer of two to four cited sentences, then one section
    per sub-question with the rest of its evidence (no sentence used twice), code examples as code.

    Every sentence is taken verbatim from a cited page; the report says so once, at its end.
    """
    items: list[dict[str, Any]] = []
    used: set[str] = set()
    # The sources that carry the most evidence from the best-ranked pages are the ones cited;
    # a source quoted once, thinly, among many would only add a page to check.
    weight: dict[Any, float] = {}
    for item in evidence:
        found = item.get("relevance", 1.0)  # how the search ranked the page, against its best result
        found = float(found) if isinstance(found, (int, float)) and not isinstance(found, bool) else 1.0
        weight[item["n"]] = weight.get(item["n"], 0.0) + float(item.get("score") or 1.0) * found
    ranked = sorted(weight, key=lambda n: -weight[n])[:max_sources]
    cited = {n for n in ranked if weight[n] >= SOURCE_FLOOR * weight[ranked[0]]}
    for item in evidence:
        if item["n"] not in cited:
            continue
        key = " ".join(item["quote"].lower().split())
        index = item.get("subquestion_index")
        if key in used or not isinstance(index, int) or not 0 <= index < len(subquestions):
            continue
        used.add(key)
        items.append(item)
    by_section: list[list[dict[str, Any]]] = [[i for i in items if i["subquestion_index"] == s]
                                              for s in range(len(subquestions))]
    # The answer: the best sentence for each sub-question in turn, then the next best, up to four.
    answer: list[dict[str, Any]] = []
    for depth in range(per_section):
        for section in by_section:
            if depth < len(section) and len(answer) < answer_sentences:
                answer.append(section[depth])
        if len(answer) >= 2:
            break
    parts = [" ".join(_sentence(item) for item in answer) if answer else
             "The sources read do not answer this question directly."]
    if scope:
        parts.append(f"*Scope:* {markdown_text(scope)}")
    code_shown = False
    for subquestion, section in zip(subquestions, by_section, strict=True):
        parts.append(f"## {markdown_text(subquestion)}")
        rest = [item for item in section if item not in answer][:per_section]
        if rest:
            parts.append(" ".join(_sentence(item) for item in rest))
        elif section:
            cited = ", ".join(f"[{n}]" for n in dict.fromkeys(item["n"] for item in section if item in answer))
            parts.append(f"The answer above covers this {cited}.")
        else:
            parts.append("None of the sources read answers this directly; it remains an open question.")
        example = next((item for item in section if item.get("code")), None)
        if example is not None and not code_shown:
            parts.append(f"An example from [{example['n']}]:")
            parts.append(_code_block(example["code"]))
            code_shown = True
    parts.append("*Every sentence above is quoted word for word from the cited page.*")
    return "\n\n".join(parts) + "\n"


class OfflineProvider:
    """Real text processing with no network: splits questions, ranks sentences by BM25, composes cited prose."""

    name = "offline"
    model = OFFLINE_MODEL

    def __init__(self, *, latency_ms: int = 0, sleep: Sleep = asyncio.sleep) -> None:
        self.latency_ms = latency_ms
        self._sleep = sleep

    async def run(self, call: ModelCall, *, client: httpx2.AsyncClient, budget: RetryBudget) -> ModelResult:
        validate_payload(call)
        if self.latency_ms:
            await self._sleep(self.latency_ms / 1000)
        # Ranking and composing are CPU work (SQLite releases the GIL): keep the event loop free.
        output = await asyncio.to_thread(self._compute, call)
        usage = {"prompt_tokens": estimate_tokens(call.payload), "completion_tokens": estimate_tokens(output)}
        return ModelResult(output=output, usage=usage, model=self.model)

    def _compute(self, call: ModelCall) -> dict[str, Any]:
        payload = call.payload
        if call.purpose == "plan":
            return {"subquestions": plan_subquestions(payload["question"], payload["max_subquestions"])}
        if call.purpose == "extract":
            return {"quotes": extract_quotes(payload["subquestion"], payload["sources"], payload["max_quotes"])}
        if call.purpose == "draft":
            return {"markdown": draft_report(payload["question"], list(payload["subquestions"]),
                                             payload["evidence"], payload.get("scope"))}
        return {"content": "", "tool_calls": []}  # the chat agent's offline behaviour comes with its issue
