"""The deep-research driver: a question in, a cited Markdown report out.

Phases, each a checkpointed step that decides from the checkpoint and the outcomes
of the calls the previous step requested, then asks for the next calls:
plan (model) -> search (tool, per sub-question; an empty search is rephrased, which is
not a retry) -> read (tool: visit) -> extract (model, per sub-question) -> draft (model)
-> done. Steps never wait on the network: gateway jobs run the calls.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.conf import settings
from django.urls import reverse
from django.utils.dateparse import parse_datetime

from tasks import clock
from tasks.context import StepContext
from tasks.drivers import Continue, Finish, OpRequest, Outcome, PartialResult, Pins
from tasks.errors import BudgetExhausted, InvalidInput, PermanentError
from tasks.events import NewEvent
from tasks.gateway.providers.offline import markdown_text

SCHEMA_VERSION = 1
MAX_QUESTION = 2000
RESULTS_PER_QUERY = 5
CANDIDATES_PER_SUBQUESTION = 3
# A search result scoring under this share of the best one for its query is not read.
RELEVANCE_FLOOR = 0.5
MAX_CODE_CHARS = 2000
MAX_SEARCH_ROUNDS = 3
SOURCE_TEXT_LIMIT = 12_000
QUOTES_PER_SUBQUESTION = 4
STOPWORDS = frozenset(["a", "an", "and", "are", "as", "at", "be", "by", "does", "do", "for", "from", "how", "in", "is", "it", "of", "on", "or", "the", "to", "what", "when", "which", "why", "with", "work", "works"])


def _source_max_age() -> timedelta:
    return timedelta(seconds=getattr(settings, "LONGHAUL_SOURCE_MAX_AGE_SECONDS", 24 * 3600))


class ResearchDriver:
    kind: ClassVar[str] = "research"
    schema_version: ClassVar[int] = SCHEMA_VERSION
    debug_only: ClassVar[bool] = False

    def pins(self) -> Pins:
        from tasks.gateway.providers import PROMPT_VERSION, model_label
        from tasks.gateway.tools import TOOL_PROTOCOL

        return Pins(model_name=model_label(), prompt_version=PROMPT_VERSION, tool_protocol=TOOL_PROTOCOL)

    # --- input ---------------------------------------------------------------------

    def validate_input(self, raw: Any, *, tenant: Any = None, internal: bool = False) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise InvalidInput("input must be an object", field="input")
        unknown = sorted(set(raw) - {"question", "constraints", "max_sources", "depth"})
        if unknown:
            raise InvalidInput(f"input has unknown fields: {', '.join(unknown)}", field=f"input.{unknown[0]}")
        question = raw.get("question")
        if not isinstance(question, str) or not 3 <= len(question.strip()) <= MAX_QUESTION:
            raise InvalidInput(f"input.question must be text of 3 to {MAX_QUESTION} characters",
                               field="input.question")
        constraints = raw.get("constraints", "")
        if not isinstance(constraints, str) or len(constraints) > MAX_QUESTION:
            raise InvalidInput(f"input.constraints must be text of at most {MAX_QUESTION} characters",
                               field="input.constraints")
        return {
            "question": question.strip(),
            "constraints": constraints.strip(),
            "max_sources": _bounded_int(raw, "max_sources", 8, 1, 30),
            "depth": _bounded_int(raw, "depth", 1, 1, 3),
        }

    def initial_state(self, task_input: dict[str, Any]) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "phase": "plan",
            "question": task_input["question"],
            "constraints": task_input["constraints"],
            "subquestions": [],
            "searches": [],      # per sub-question: {"queries": [...], "urls": [...]}
            "candidates": [],    # [{"url", "title", "subquestions": [i, ...]}]
            "sources": [],       # [{"n", "url", "title", "fetched_at", "content_hash", "subquestions"}]
            "evidence": [],      # [{"id", "n", "subquestion_index", "quote"}]
            "pending": [],       # what each requested call of the last step was for
            "usage": {"model_calls": 0, "tool_calls": 0, "tokens": 0},
        }

    # --- steps ---------------------------------------------------------------------

    def step(self, state: dict[str, Any], ctx: StepContext) -> Outcome:
        state = {**state}
        outcomes = ctx.requested_outcomes()
        state["usage"] = {**state["usage"], "tokens": state["usage"]["tokens"] + sum(
            int(o.usage.get("prompt_tokens", 0)) + int(o.usage.get("completion_tokens", 0)) for o in outcomes)}
        handler = {
            "plan": self._plan,
            "planning": self._after_plan,
            "searching": self._after_search,
            "reading": self._after_read,
            "extracting": self._after_extract,
            "drafting": self._after_draft,
        }[state["phase"]]
        return handler(state, outcomes, ctx)

    def _plan(self, state: dict, outcomes: list, ctx: StepContext) -> Outcome:
        max_sub = ctx.input["depth"] + 2
        state["task"] = str(ctx.task.public_id)  # the report links each source to its page in Longhaul
        request = OpRequest("model", "plan", {"question": state["question"], "constraints": state["constraints"],
                                               "max_subquestions": max_sub})
        return self._ask(state, ctx, "planning", [request], [{"type": "plan"}], [NewEvent("planning", {})])

    def _after_plan(self, state: dict, outcomes: list, ctx: StepContext) -> Outcome:
        [plan] = outcomes
        if not plan.ok:
            raise PermanentError(f"planning failed: {plan.error_message}")
        subquestions = [s.strip() for s in plan.result.get("subquestions", []) if isinstance(s, str) and s.strip()]
        if not subquestions:
            subquestions = [state["question"]]
        state["subquestions"] = subquestions[: ctx.input["depth"] + 2]
        state["searches"] = [{"queries": [], "urls": []} for _ in state["subquestions"]]
        events = [NewEvent("plan_ready", {"subquestions": len(state["subquestions"])})]
        requests, pending = [], []
        for i, sub in enumerate(state["subquestions"]):
            query = _query_for(sub, state["constraints"])
            state["searches"][i]["queries"].append(query)
            requests.append(OpRequest("tool", "search", {"query": query, "limit": RESULTS_PER_QUERY}))
            pending.append({"type": "search", "subquestion": i})
            events.append(NewEvent("searching", {"subquestion": i + 1, "query": query}))
        return self._ask(state, ctx, "searching", requests, pending, events)

    def _after_search(self, state: dict, outcomes: list, ctx: StepContext) -> Outcome:
        events: list[NewEvent] = []
        requests, pending = [], []
        for meta, outcome in zip(state["pending"], outcomes, strict=True):
            i = meta["subquestion"]
            results = outcome.result.get("results", []) if outcome.ok else []
            fresh = [r for r in results if isinstance(r, dict) and r.get("url") and _relevance(r) >= RELEVANCE_FLOOR]
            state["searches"][i]["urls"].extend(r["url"] for r in fresh[:CANDIDATES_PER_SUBQUESTION])
            for r in fresh[:CANDIDATES_PER_SUBQUESTION]:
                _add_candidate(state, r["url"], str(r.get("title") or r["url"]), i, _relevance(r))
            rounds = len(state["searches"][i]["queries"])
            if not fresh and rounds < MAX_SEARCH_ROUNDS:
                # Nothing found: ask differently (a new query, not a retry of the same one).
                query = _rephrase(state["subquestions"][i], rounds)
                if query and query not in state["searches"][i]["queries"]:
                    state["searches"][i]["queries"].append(query)
                    requests.append(OpRequest("tool", "search", {"query": query, "limit": RESULTS_PER_QUERY}))
                    pending.append({"type": "search", "subquestion": i})
                    events.append(NewEvent("searching", {"subquestion": i + 1, "query": query, "rephrased": True}))
        if requests:
            return self._ask(state, ctx, "searching", requests, pending, events)
        state["candidates"] = state["candidates"][: ctx.input["max_sources"]]
        if not state["candidates"]:
            raise PermanentError("the searches found no sources for this question")
        return self._read(state, ctx, state["candidates"], events)

    def _read(self, state: dict, ctx: StepContext, candidates: list[dict], events: list[NewEvent]) -> Outcome:
        requests = [OpRequest("tool", "visit", {"url": c["url"]}) for c in candidates]
        pending = [{"type": "visit", "url": c["url"]} for c in candidates]
        return self._ask(state, ctx, "reading", requests, pending, events)

    def _after_read(self, state: dict, outcomes: list, ctx: StepContext) -> Outcome:
        events: list[NewEvent] = []
        texts: dict[int, str] = {}
        by_url = {c["url"]: c for c in state["candidates"]}
        for meta, outcome in zip(state["pending"], outcomes, strict=True):
            if not outcome.ok or not outcome.result.get("text"):
                events.append(NewEvent("source_skipped", {"url": meta["url"], "error_class": outcome.error_class}))
                continue
            page = outcome.result
            existing = next((s for s in state["sources"] if s["url"] == meta["url"]), None)
            source = existing or {"n": len(state["sources"]) + 1, "url": meta["url"],
                                  "subquestions": by_url[meta["url"]]["subquestions"],
                                  "relevance": by_url[meta["url"]].get("relevance", 1.0)}
            source.update(title=str(page.get("title") or by_url[meta["url"]]["title"])[:300],
                          fetched_at=page.get("fetched_at") or clock.now().isoformat(),
                          content_hash=page.get("content_hash", ""),
                          origin_url=str(page.get("origin_url") or "")[:2000])
            if page.get("corpus"):
                state["corpus"] = str(page["corpus"])[:200]
            if existing is None:
                state["sources"].append(source)
            texts[source["n"]] = str(page["text"])[:SOURCE_TEXT_LIMIT]
            events.append(NewEvent("source_read", {"n": source["n"], "title": source["title"], "url": source["url"]}))
        if not state["sources"]:
            raise PermanentError("none of the sources could be read")
        stale = _stale_sources(state, texts, now=clock.now())
        if stale:
            # Fetched too long ago (the task was paused, say): read them again before quoting them.
            return self._read(state, ctx, [{"url": s["url"]} for s in stale], events)
        requests, pending = [], []
        for i, sub in enumerate(state["subquestions"]):
            sources = [s for s in state["sources"] if i in s["subquestions"] and s["n"] in texts] or \
                [s for s in state["sources"] if s["n"] in texts]
            requests.append(OpRequest("model", "extract", {
                "subquestion": sub, "max_quotes": QUOTES_PER_SUBQUESTION,
                "sources": [{"source_id": str(s["n"]), "title": s["title"], "text": texts[s["n"]]} for s in sources],
            }))
            pending.append({"type": "extract", "subquestion": i})
        return self._ask(state, ctx, "extracting", requests, pending, events)

    def _after_extract(self, state: dict, outcomes: list, ctx: StepContext) -> Outcome:
        events: list[NewEvent] = []
        known = {str(s["n"]) for s in state["sources"]}
        for meta, outcome in zip(state["pending"], outcomes, strict=True):
            if not outcome.ok:
                continue
            added = 0
            for quote in outcome.result.get("quotes", []):
                if str(quote.get("source_id")) not in known or not quote.get("quote"):
                    continue
                item = {"id": f"e{len(state['evidence']) + 1}", "n": int(quote["source_id"]),
                        "subquestion_index": meta["subquestion"], "quote": quote["quote"]}
                if isinstance(quote.get("score"), (int, float)):
                    item["score"] = float(quote["score"])
                if isinstance(quote.get("code"), str) and quote["code"].strip():
                    item["code"] = quote["code"][:MAX_CODE_CHARS]
                state["evidence"].append(item)
                added += 1
            events.append(NewEvent("evidence_added", {"subquestion": meta["subquestion"] + 1, "count": added}))
        if not state["evidence"]:
            raise PermanentError(f"no evidence found in {len(state['sources'])} sources")
        titles = {s["n"]: s["title"] for s in state["sources"]}
        relevance = {s["n"]: s.get("relevance", 1.0) for s in state["sources"]}
        request = OpRequest("model", "draft", {
            "question": state["question"], "subquestions": state["subquestions"], "scope": None,
            "evidence": [{"n": e["n"], "subquestion_index": e["subquestion_index"], "quote": e["quote"],
                          "title": titles[e["n"]], "relevance": relevance[e["n"]],
                          **{k: e[k] for k in ("score", "code") if k in e}}
                         for e in state["evidence"]],
        })
        events.append(NewEvent("drafting", {"evidence": len(state["evidence"])}))
        return self._ask(state, ctx, "drafting", [request], [{"type": "draft"}], events)

    def _after_draft(self, state: dict, outcomes: list, ctx: StepContext) -> Outcome:
        [draft] = outcomes
        body = draft.result.get("markdown") if draft.ok else None
        covered = sorted({e["subquestion_index"] for e in state["evidence"]})
        scope = "complete" if len(covered) == len(state["subquestions"]) else _scope(covered, state["subquestions"])
        if not body:  # the model call failed: the evidence still makes an honest extractive report
            body = compose_extractive(state, scope=None)
        state["phase"] = "done"
        state["pending"] = []
        return Finish(state, _result(state, body, scope), [NewEvent("result_ready", {"sources": len(state["sources"])})])

    # --- partial results -----------------------------------------------------------

    def partial_result(self, state: dict[str, Any]) -> PartialResult | None:
        if not state.get("evidence"):
            return None
        covered = sorted({e["subquestion_index"] for e in state["evidence"]})
        scope = _scope(covered, state["subquestions"])
        return PartialResult(_result(state, compose_extractive(state, scope=scope), scope), scope)

    # --- helpers -------------------------------------------------------------------

    def _ask(self, state: dict, ctx: StepContext, phase: str, requests: list[OpRequest], pending: list[dict],
             events: list[NewEvent]) -> Continue:
        """Request calls within the task's budgets, remembering what each is for."""
        usage = dict(state["usage"])
        budget = ctx.budget
        usage["model_calls"] += sum(r.kind == "model" for r in requests)
        usage["tool_calls"] += sum(r.kind == "tool" for r in requests)
        for used, limit, what in ((usage["model_calls"], budget.max_model_calls, "model-call"),
                                  (usage["tool_calls"], budget.max_tool_calls, "tool-call"),
                                  (usage["tokens"], budget.max_tokens, "token")):
            if used > limit:
                raise BudgetExhausted(f"{what} budget of {limit} used", state={**state, "pending": []})
        return Continue({**state, "phase": phase, "pending": pending, "usage": usage}, events, requests)


def _bounded_int(raw: dict, name: str, default: int, low: int, high: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"input.{name} must be an integer between {low} and {high}", field=f"input.{name}")
    return value


def _words(text: str) -> list[str]:
    return [w for w in re.findall(r"[A-Za-z0-9_.]+", text.lower()) if w not in STOPWORDS]


def _query_for(subquestion: str, constraints: str) -> str:
    return subquestion if not constraints else f"{subquestion} {constraints}"[:300]


def _rephrase(subquestion: str, round_number: int) -> str:
    """A broader query: the sub-question's key words, fewer each round."""
    words = sorted(set(_words(subquestion)), key=lambda w: (-len(w), w))
    keep = max(1, 4 - round_number)
    return " ".join(words[:keep])


def _add_candidate(state: dict, url: str, title: str, subquestion: int, relevance: float = 1.0) -> None:
    """A page to read, with the sub-questions that found it and its best relevance among their searches."""
    for candidate in state["candidates"]:
        if candidate["url"] == url:
            if subquestion not in candidate["subquestions"]:
                candidate["subquestions"].append(subquestion)
            candidate["relevance"] = max(candidate.get("relevance", 1.0), relevance)
            return
    state["candidates"].append({"url": url, "title": title, "subquestions": [subquestion], "relevance": relevance})


def _stale_sources(state: dict, texts: dict[int, str], *, now: datetime) -> list[dict]:
    limit = now - _source_max_age()
    stale = []
    for source in state["sources"]:
        fetched = parse_datetime(source.get("fetched_at") or "")
        if fetched is not None and fetched < limit:
            stale.append(source)
            texts.pop(source["n"], None)
    return stale


def _scope(covered: list[int], subquestions: list[str]) -> str:
    total = len(subquestions)
    if not covered:
        return f"covers none of {total} sub-questions"
    ranges = _ranges([i + 1 for i in covered])
    return f"covers sub-questions {ranges} of {total}"


def _ranges(numbers: list[int]) -> str:
    parts, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}" if start == n else f"{start}–{n}")
            start = None
    return ", ".join(parts)


def compose_extractive(state: dict, *, scope: str | None) -> str:
    """A report made only of quoted evidence, each with its citation."""
    lines = [f"# {state['question']}", ""]
    if scope:
        lines += [f"*Partial report: {scope}.*", ""]
    for i, sub in enumerate(state["subquestions"]):
        quotes = [e for e in state["evidence"] if e["subquestion_index"] == i]
        if not quotes:
            continue
        lines += [f"## {sub}", ""]
        lines += [f"> {e['quote'].strip()} [{e['n']}]" + "\n" for e in quotes]
    return "\n".join(lines).strip()


def _relevance(result: dict) -> float:
    value = result.get("relevance", 1.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0


def source_link(task_id: str, n: int) -> str:
    """The page in Longhaul that shows a cited source's section."""
    return reverse("cited-source", kwargs={"task_id": task_id, "n": n})


def _result(state: dict, body: str, scope: str) -> dict[str, Any]:
    # Only sources the report cites are listed: a reader checks what the text leans on.
    cited_in_text = {int(n) for n in re.findall(r"(?<!\\)\[(\d+)\]", body)}
    cited = sorted({e["n"] for e in state["evidence"]} & cited_in_text) or sorted({e["n"] for e in state["evidence"]})
    sources = [{k: s.get(k, "") for k in ("n", "title", "url", "origin_url", "fetched_at", "content_hash")}
               for s in state["sources"] if s["n"] in cited]
    lines = []
    for s in sources:
        title = markdown_text(s["title"])  # safe as a link label
        local = source_link(state["task"], s["n"]) if state.get("task") and s["url"].startswith("corpus://") else ""
        public = s["origin_url"] or (s["url"] if s["url"].startswith(("http://", "https://")) else "")
        entry = f"[{s['n']}] [{title}]({local})" if local else f"[{s['n']}] {title}"
        lines.append(f"{entry} — {public}" if public else entry)
    corpus_line = f"*Read offline from {state['corpus']}.*\n\n" if state.get("corpus") else ""
    return {
        "report": f"{body}\n\n## Sources\n\n{corpus_line}" + "\n".join(lines) + "\n",
        "sources": sources,
        "evidence": state["evidence"],
        "subquestions": state["subquestions"],
        "scope": scope,
        "corpus": state.get("corpus", ""),
        "usage": state["usage"],
    }

