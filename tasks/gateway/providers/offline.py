"""The offline provider: real text processing with no network (the default).

It splits a question into sub-questions, ranks the sources' sentences by BM25 against
each, and composes a report of cited quotations, returning the shapes of shapes.py.
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import httpx

from tasks.gateway import corpus
from tasks.gateway.providers import ModelCall, ModelResult
from tasks.gateway.providers.shapes import estimate_tokens, validate_payload
from tasks.gateway.retry import RetryBudget, Sleep
from tasks.gateway.untrusted import neutralize_name

OFFLINE_MODEL = "offline-extractive-1"

_WH = ("how", "what", "why", "when", "where", "which", "who", "whom", "whose", "whether")
_AUX = ("is", "are", "was", "were", "do", "does", "did", "can", "could", "should", "would", "will", "shall",
        "may", "might", "must", "has", "have", "had")
_LEADING = frozenset(_WH + _AUX + ("i", "we", "you", "one", "it", "they", "the", "a", "an", "there", "to", "in",
                                   "of", "for", "about", "on", "with", "and", "or", "but", "also", "so"))
_VERBS = frozenset("""
use work works happen happens mean means behave behaves handle handles implement avoid prefer choose make
get set run create build debug test compare differ fail fails affect affects know explain describe list
tell show find write read start stop cancel configure decide need want
""".split())
_PRONOUNS = ("it", "this", "that", "they", "them", "these", "those", "each", "both")
_CLAUSE_END = re.compile(r"[?!;]+|\.(?=\s|$)")
_CLAUSE_JOIN = re.compile(
    r",?\s+(?:and|but|or|also|plus)\s+(?=(?:" + "|".join(_WH + _AUX) + r")\b)|,\s*(?=(?:" + "|".join(_WH) + r")\b)",
    re.IGNORECASE,
)
_TOKEN = re.compile(r"[\w][\w.+#-]*[\w+#]|\w")
ANGLES = (
    "What {is} {topic}?",
    "How {does} {topic} work?",
    "What are the pitfalls and caveats of {topic}?",
    "How {is} {topic} used in practice?",
    "How {does} {topic} compare with the alternatives?",
)


def question_clauses(question: str) -> list[str]:
    """The separate questions inside one: split at question marks, semicolons and joined clauses."""
    clauses = []
    for sentence in _CLAUSE_END.split(question):
        for part in _CLAUSE_JOIN.split(sentence):
            part = " ".join(part.split()).strip(" ,")
            # "when should I use each" names nothing itself but still asks something.
            if corpus.query_terms(part) or (part and part.split()[0].lower() in _WH):
                clauses.append(part)
    return clauses


def key_phrase(text: str) -> str:
    """The longest run of content words in `text` ("threads and processes" counts as one): the thing asked about."""
    tokens = _TOKEN.findall(text)
    best: list[str] = []
    run: list[str] = []
    for index, token in enumerate([*tokens, ""]):
        word = token.lower()
        if token and word not in corpus.STOPWORDS and word not in _LEADING and word not in _VERBS:
            run.append(token)
            continue
        following = tokens[index + 1].lower() if index + 1 < len(tokens) else ""
        if run and word in ("and", "or") and following and following not in corpus.STOPWORDS | _LEADING | _VERBS:
            run.append(token)
            continue
        if len(run) > len(best):
            best = run
        run = []
    return " ".join(best)


def _is_plural(topic: str) -> bool:
    """A rough number agreement for the angle templates: "threads are", "asyncio is"."""
    last = topic.split()[-1].lower() if topic else ""
    return " and " in topic or (last.endswith("s") and not last.endswith(("ss", "us", "is", "ys")) and len(last) > 3)


def _signature(text: str) -> set[str]:
    """What a sub-question asks, for spotting near-duplicates: its question word and content words."""
    words = {w.lower() for w in _TOKEN.findall(text)}
    return {w for w in words if w in _WH or (w not in corpus.STOPWORDS and w not in _AUX)}


def _is_duplicate(candidate: str, chosen: list[str]) -> bool:
    mine = _signature(candidate)
    for other in chosen:
        theirs = _signature(other)
        if mine and len(mine & theirs) / len(mine | theirs) >= 0.6:
            return True
    return False


def _as_subquestion(clause: str, topic: str) -> str:
    """A clause made to stand alone: a pronoun or a bare aspect ("what are the pitfalls") gets the topic."""
    text = clause[0].upper() + clause[1:]
    interrogative = text.split()[0].lower() in _WH + _AUX
    topic_words = {w.lower() for w in topic.split()}
    own_words = {w.lower() for w in _TOKEN.findall(text)}
    if topic and not topic_words & own_words:
        words = text.split()
        pronoun = next((i for i, w in enumerate(words) if i > 0 and w.lower() in _PRONOUNS), None)
        if pronoun is not None:
            words[pronoun] = topic
            text = " ".join(words)
        elif words[-1].lower() in _VERBS:
            text = f"{text} {topic}"
        else:
            text = f"{text} of {topic}"
    return text + "?" if interrogative else text


def plan_subquestions(question: str, max_subquestions: int) -> list[str]:
    """Sub-questions of a question: its own clauses made standalone, then generic angles on its topic."""
    limit = max(1, max_subquestions)
    clauses = question_clauses(question)
    topic = next((phrase for phrase in map(key_phrase, clauses) if phrase), "") or key_phrase(question)
    chosen: list[str] = []
    for clause in clauses:
        candidate = _as_subquestion(clause, topic)
        if not _is_duplicate(candidate, chosen):
            chosen.append(candidate)
    target = min(limit, max(len(chosen), 3))
    for angle in ANGLES if topic else ():
        if len(chosen) >= target:
            break
        plural = _is_plural(topic)
        candidate = angle.format(topic=topic, **{"is": "are" if plural else "is", "does": "do" if plural else "does"})
        if not _is_duplicate(candidate, chosen):
            chosen.append(candidate)
    return chosen[:limit] or [" ".join(question.split()) or "What is known about this?"]


# Words that hint at an aspect a sub-question asks about, and the words that tend to carry it.
ASPECT_CUES: tuple[tuple[frozenset[str], tuple[str, ...]], ...] = (
    (frozenset("pitfall pitfalls caveat caveats gotcha gotchas risk risks problem problems mistake mistakes "
               "limitation limitations danger dangers".split()),
     ("however", "unless", "but", "note", "warning", "caution", "avoid", "never", "careful", "unlike",
      "guarantee", "instead", "only", "must", "deadlock", "leak", "ignored", "lost")),
    (frozenset("practice practical example examples usage idiom idioms pattern patterns used".split()),
     ("example", "typical", "usage", "use", "pattern", "recommended", "for", "instance")),
    (frozenset("compare comparison alternative alternatives versus vs differ difference differences".split()),
     ("unlike", "instead", "whereas", "alternative", "similar", "compared", "difference", "rather")),
    (frozenset("work works working mechanism internally happen happens".split()),
     ("when", "arranges", "schedules", "raised", "raises", "called", "returns", "then")),
    (frozenset("what definition define defined meaning".split()),
     ("is", "are", "represents", "class", "object", "provides")),
)
CUE_WEIGHT = 0.4


def aspect_cues(subquestion: str) -> dict[str, float]:
    """Cue words for the aspects a sub-question asks about (pitfalls, practice, comparison, mechanism)."""
    words = {word.lower() for word in _TOKEN.findall(subquestion)}
    cues: dict[str, float] = {}
    for triggers, hints in ASPECT_CUES:
        if words & triggers:
            cues.update(dict.fromkeys(hints, CUE_WEIGHT))
    return cues


def extract_quotes(subquestion: str, sources: list[dict[str, Any]], max_quotes: int) -> list[dict[str, Any]]:
    """The sentences of the sources best answering the sub-question, verbatim, best first."""
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
        entry = {"source_id": sources[hit.doc]["source_id"], "quote": quote, "score": hit.score}
        from_same = sum(1 for item in picked if item["source_id"] == entry["source_id"])
        (picked if from_same < per_source_cap else held_back).append(entry)
    picked.extend(held_back)
    return picked[:max_quotes]


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>#|])")
_LEADS = ("According to {title}, {quote}", "{title} adds: {quote}", "{title} also notes: {quote}",
          "Further, {title} states: {quote}")


def markdown_text(text: str) -> str:
    """Plain text safe inside Markdown: one line, markup characters escaped (so no stray [n] citations)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def _quotation(quote: str, *, limit: int = 360) -> str:
    text = " ".join(quote.split())
    if len(text) > limit:
        cut = text.rfind(" ", 0, limit)
        text = text[: cut if cut > 0 else limit].rstrip(",;:") + "\u2026"
    return f"\u201c{markdown_text(text)}\u201d"


def _paragraph(items: list[dict[str, Any]]) -> str:
    sentences = []
    previous_title = None
    for position, item in enumerate(items):
        title = markdown_text(neutralize_name(item.get("title") or "a source"))
        lead = _LEADS[position % len(_LEADS)]
        if title == previous_title:
            lead = "The same source adds: {quote}"
        previous_title = title
        sentence = lead.format(title=title, quote=_quotation(item["quote"])) + f" [{item['n']}]"
        if not item["quote"].rstrip().endswith((".", "!", "?")):
            sentence += "."
        sentences.append(sentence)
    return " ".join(sentences)


def draft_report(question: str, subquestions: list[str], evidence: list[dict[str, Any]], scope: str | None,
                 *, per_section: int = 4) -> str:
    """A Markdown report: a short introduction and one section per sub-question, every claim quoted and cited."""
    sections: list[list[dict[str, Any]]] = [[] for _ in subquestions]
    for item in evidence:
        index = item.get("subquestion_index")
        if not isinstance(index, int) or not 0 <= index < len(sections) or len(sections[index]) >= per_section:
            continue
        if all(" ".join(other["quote"].split()) != " ".join(item["quote"].split()) for other in sections[index]):
            sections[index].append(item)
    titles = {item.get("title") for item in evidence}
    intro = (
        f"This report looks into the question {_quotation(question, limit=300)} in {len(subquestions)} parts, "
        f"one per sub-question. It rests on {len(evidence)} quoted passages from {len(titles)} sources; "
        "every statement below is a quotation, cited by source number."
    )
    lead = next((items[0] for items in sections if items), None)
    if lead is not None:
        intro += f" In brief: {_quotation(lead['quote'], limit=240)} [{lead['n']}]"
    parts = [intro]
    if scope:
        parts.append(f"*Scope:* {markdown_text(scope)}")
    for subquestion, items in zip(subquestions, sections, strict=True):
        parts.append(f"## {markdown_text(subquestion)}")
        parts.append(_paragraph(items) if items else
                     "None of the sources read answers this directly; it remains an open question.")
    return "\n\n".join(parts) + "\n"


class OfflineProvider:
    """Real text processing with no network: splits questions, ranks sentences by BM25, composes cited prose."""

    name = "offline"
    model = OFFLINE_MODEL

    def __init__(self, *, latency_ms: int = 0, sleep: Sleep = asyncio.sleep) -> None:
        self.latency_ms = latency_ms
        self._sleep = sleep

    async def run(self, call: ModelCall, *, client: httpx.AsyncClient, budget: RetryBudget) -> ModelResult:
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
