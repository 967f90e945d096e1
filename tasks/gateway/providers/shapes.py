"""What each purpose's payload holds and what its output looks like; both providers keep to these.

A payload the driver built wrongly is a PermanentError (no retry fixes a bug); an output
a model got wrong is a MalformedOutput, which the provider may ask again about.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from project.parsers import strict_loads
from tasks.errors import PermanentError
from tasks.gateway.providers import PURPOSES, ModelCall
from tasks.gateway.untrusted import neutralize_name


def _require(payload: dict[str, Any], key: str, kind: type | tuple[type, ...], purpose: str) -> Any:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        # The driver built the payload: a bad one is a bug that no retry will fix.
        raise PermanentError(f"{purpose} payload: {key} is missing or of the wrong type")
    return value


class MalformedOutput(Exception):
    """The model answered, but not with the shape the purpose needs."""


def locate_quote(quote: str, text: str) -> str | None:
    """The verbatim span of `text` that `quote` reproduces, forgiving re-spaced whitespace and defused `<`."""
    quote = quote.strip()
    if len(quote) < 8:
        return None
    if quote in text:
        return quote
    words = quote.split()
    pattern = r"\s+".join(re.escape(word).replace("\u2039", "[<\u2039]") for word in words)
    found = re.search(pattern, text)
    return found.group() if found else None


def check_plan(raw: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """plan -> {"subquestions": [str, ...]}: 1..max_subquestions distinct non-empty questions."""
    items = raw.get("subquestions")
    if not isinstance(items, list):
        raise MalformedOutput("subquestions is not a list")
    seen: list[str] = []
    for item in items:
        text = " ".join(item.split()) if isinstance(item, str) else ""
        if text and text.lower() not in (s.lower() for s in seen):
            seen.append(text[:500])
    if not seen:
        raise MalformedOutput("no sub-questions")
    return {"subquestions": seen[: max(1, payload["max_subquestions"])]}


def check_extract(raw: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """extract -> {"quotes": [{"source_id", "quote", "score"}]}: every quote a verbatim substring of its source."""
    items = raw.get("quotes")
    if not isinstance(items, list):
        raise MalformedOutput("quotes is not a list")
    texts = {source["source_id"]: source["text"] for source in payload["sources"]}
    # The prompt showed each id neutralized; a model echoing that form still means the source.
    ids = {neutralize_name(source_id, limit=200): source_id for source_id in texts} | {s: s for s in texts}
    quotes: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("quote"), str):
            continue
        source_id = ids.get(item.get("source_id"))  # type: ignore[arg-type]
        verbatim = locate_quote(item["quote"], texts[source_id]) if source_id is not None else None
        if verbatim is None or any(q["quote"] == verbatim for q in quotes):
            continue  # a paraphrase or an invention: never let it pass as a quotation
        score = item.get("score")
        score = float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else 0.0
        quotes.append({"source_id": source_id, "quote": verbatim,
                       "score": score if math.isfinite(score) else 0.0})
    return {"quotes": quotes[: payload["max_quotes"]]}


_CITATION = re.compile(r"(?<!\\)\[(\d+(?:\s*,\s*\d+)*)\]")
_SOURCE_SECTION = re.compile(r"\n#{1,6}\s*(sources|references|bibliography|works cited)\s*\n.*\Z",
                             re.IGNORECASE | re.DOTALL)


def check_draft(raw: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """draft -> {"markdown": str}: citations limited to the evidence numbers given, no source list."""
    markdown = raw.get("markdown")
    if not isinstance(markdown, str) or not markdown.strip():
        raise MalformedOutput("markdown is missing")
    allowed = {item["n"] for item in payload["evidence"]}

    def keep_known(match: re.Match[str]) -> str:
        numbers = [int(n) for n in re.findall(r"\d+", match.group(1))]
        return "".join(f"[{n}]" for n in numbers if n in allowed)

    markdown = _SOURCE_SECTION.sub("", "\n" + markdown.strip()).strip()
    return {"markdown": _CITATION.sub(keep_known, markdown)}


def check_chat(message: dict[str, Any]) -> dict[str, Any]:
    """chat -> {"content": str, "tool_calls": [{"id", "name", "arguments": dict}]}."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MalformedOutput("a tool call has no function name")
        arguments = function.get("arguments") or "{}"
        try:
            arguments = strict_loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError as exc:  # JSONDecodeError, or a number jsonb cannot store
            raise MalformedOutput("tool call arguments are not JSON") from exc
        if not isinstance(arguments, dict):
            raise MalformedOutput("tool call arguments are not an object")
        calls.append({"id": str(call.get("id") or ""), "name": function["name"], "arguments": arguments})
    content = message.get("content")
    return {"content": content if isinstance(content, str) else "", "tool_calls": calls}


def validate_payload(call: ModelCall) -> None:
    """Refuse a payload without what its purpose needs (PermanentError: the caller built it wrongly)."""
    payload = call.payload
    if call.purpose not in PURPOSES:
        raise PermanentError(f"unknown model call purpose {call.purpose!r}")
    if call.purpose == "plan":
        _require(payload, "question", str, "plan")
        _require(payload, "max_subquestions", int, "plan")
    elif call.purpose == "extract":
        _require(payload, "subquestion", str, "extract")
        _require(payload, "max_quotes", int, "extract")
        for source in _require(payload, "sources", list, "extract"):
            if not isinstance(source, dict) or not all(isinstance(source.get(k), str) for k in ("source_id", "text")):
                raise PermanentError("extract payload: each source needs a source_id and a text")
    elif call.purpose == "draft":
        _require(payload, "question", str, "draft")
        _require(payload, "subquestions", list, "draft")
        for item in _require(payload, "evidence", list, "draft"):
            if not (isinstance(item, dict) and isinstance(item.get("n"), int) and isinstance(item.get("quote"), str)):
                raise PermanentError("draft payload: each evidence item needs an integer n and a quote")
    else:
        _require(payload, "messages", list, "chat")


def estimate_tokens(value: Any) -> int:
    """A rough token count (about four characters a token) for providers that do not report usage."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return math.ceil(len(text) / 4)
