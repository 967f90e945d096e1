"""What a question asks, for the offline planner: its intent, the things it names, and sub-questions a person would ask.

No model here: a small reading of English questions about Python. The question's own
clauses come first, made to stand alone ("how does it affect threads" gets its subject
back); then, by intent, the questions a careful reader asks next: what each compared
thing is (comparison), what the things a how-to works with are (how-to), how a defined
thing is used (definition). Every sub-question is built from a whole template and the
question's own phrases with their articles, so none reads like "What is context manager using?".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tasks.gateway import corpus

Intent = Literal["comparison", "how-to", "definition", "behaviour"]

_WH = ("how", "what", "why", "when", "where", "which", "who", "whom", "whose", "whether")
_AUX = ("is", "are", "was", "were", "do", "does", "did", "can", "could", "should", "would", "will", "shall",
        "may", "might", "must", "has", "have", "had")
_DETERMINERS = frozenset(["a", "an", "the", "its", "my", "our", "their", "your", "his", "her", "this", "that", "these", "those", "each", "every", "some", "any"])
# Words that end a noun phrase: verbs a question about code tends to use, and joiners.
_VERBS = frozenset(["use", "work", "works", "happen", "happens", "mean", "means", "behave", "behaves", "handle", "handles", "implement", "avoid", "prefer", "choose", "make", "get", "gets", "set", "run", "runs", "create", "build", "debug", "compare", "differ", "differs", "fail", "fails", "affect", "affects", "know", "explain", "describe", "tell", "show", "stay", "stays", "find", "write", "read", "start", "stop", "cancel", "configure", "decide", "need", "want", "give", "keep", "keeps", "define", "convert", "replace", "parse", "insert", "split", "sort", "format", "loop", "join", "remember", "remembers", "return", "returns", "control", "controls", "clean", "contain", "contains", "annotate", "save", "cache", "call", "calls", "pass", "raise", "raises", "catch", "annotate", "done"])
_BREAKS = frozenset(["and", "or", "versus", "vs", "but", "with", "without", "than", "from", "into", "onto", "over", "under", "between", "as", "so", "if", "then", "when", "while"])
_PRONOUNS = frozenset(["it", "this", "that", "they", "them", "one", "ones"])
# Too general to ask "What is a ...?" about.
_GENERIC = frozenset(["function", "functions", "list", "lists", "value", "values", "call", "calls", "python", "code", "object", "objects", "item", "items", "thing", "things", "way", "file", "files", "data", "type", "types", "class", "classes", "method", "methods", "program", "programs", "module", "modules", "example", "examples", "result", "results", "number", "numbers", "name", "names", "time", "times", "line", "lines", "difference", "differences", "problem", "problems", "question", "answer", "case", "cases", "bottom", "top", "end", "start", "input", "inputs", "output", "outputs", "field", "fields", "member", "members", "statement", "statements", "argument", "arguments", "block", "blocks", "record", "records"])
_TOKEN = re.compile(r"[A-Za-z_][\w.'\u2019-]*\w|[A-Za-z_]\w*|\w+")
_CLAUSE_END = re.compile(r"[?!;]+|(?<!\.)\.(?!\.)(?=\s|$)|:\s+(?=(?:" + "|".join(_WH) + r")\b)", re.IGNORECASE)
_IMPERATIVES = ("explain", "describe", "compare", "show", "tell", "list", "summarize", "give")
_END = r"(?:[?,;:]|\.(?:\s|$)|$)"
_CLAUSE_JOIN = re.compile(
    r",?\s+(?:and|but|also|plus)\s+(?=(?:" + "|".join(_WH + _AUX) + r")\b)|,\s*(?=(?:" + "|".join(_WH) + r")\b)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Phrase:
    """A thing a question names, as written ("global interpreter lock") and with its article ("the ...")."""

    words: str
    article: str  # "", "a", "an", "the", ...

    @property
    def spoken(self) -> str:
        return f"{self.article} {self.words}" if self.article else self.words

    @property
    def is_name(self) -> bool:
        """An identifier (threading.RLock, __slots__, json.loads) rather than English."""
        return bool(re.search(r"[._]|[a-z][A-Z]", self.words))

    @property
    def plural(self) -> bool:
        last = self.words.split()[-1].lower()
        return not self.is_name and last.endswith("s") and not last.endswith(("ss", "us", "is", "ys")) \
            and len(last) > 3


def clauses(question: str) -> list[str]:
    """The separate questions inside one: split at question marks, semicolons and joined clauses."""
    found = []
    for sentence in _CLAUSE_END.split(question):
        for part in _CLAUSE_JOIN.split(sentence):
            part = " ".join(part.split()).strip(" ,")
            if corpus.query_terms(part) or (part and part.split()[0].lower() in _WH):
                found.append(part)
    return found


def phrases(text: str) -> list[Phrase]:
    """The noun phrases of `text`, in order: runs of words that are not question words, verbs or joiners.

    A word followed by an article is a verb or a preposition ("using a generator"), so it
    ends a phrase too.
    """
    tokens = _TOKEN.findall(text)
    found: list[Phrase] = []
    run: list[str] = []
    article = ""
    for index, token in enumerate([*tokens, ""]):
        word = token.lower()
        following = tokens[index + 1].lower() if index + 1 < len(tokens) else ""
        ends = (not token or word in corpus.STOPWORDS or word in _VERBS or word in _BREAKS or word in _WH
                or word in _AUX or word in _DETERMINERS or word in _PRONOUNS or following in _DETERMINERS
                or word in corpus.QUESTION_FILLER)
        if not ends and Phrase(token, "").is_name:
            if run:  # a name stands alone: "__name__" and "__main__" are two things
                found.append(Phrase(" ".join(run), article))
            found.append(Phrase(token, ""))
            run, article = [], ""
            continue
        if not ends:
            run.append(token)
            continue
        if run:
            found.append(Phrase(" ".join(run), article))
            run = []
        article = word if word in _DETERMINERS else ""
    return found


def key_phrases(text: str) -> list[Phrase]:
    """The phrases worth asking about: names and multi-word terms first, then specific single words."""
    seen: set[str] = set()
    chosen: list[Phrase] = []
    for phrase in sorted(phrases(text), key=lambda p: (not p.is_name and " " not in p.words,)):
        key = phrase.words.lower()
        if key in seen or key in _GENERIC or len(key) < 3:
            continue
        seen.add(key)
        chosen.append(phrase)
    return chosen


def intent(question: str) -> Intent:
    lowered = " " + " ".join(question.lower().split()) + " "
    if re.search(r" (versus|vs\.?|differences? between|differ from|different from|compared? (to|with)) ", lowered) \
            or re.match(r" (should|which|do) .* (or) ", lowered):
        return "comparison"
    if re.match(r" (how (do|can|should|would|could) (i|you|we|one)|how to) ", lowered):
        return "how-to"
    if re.match(r" what (is|are|does .* mean) ", lowered):
        return "definition"
    return "behaviour"


def compared(question: str) -> list[Phrase]:
    """The two things a comparison sets side by side, when it names them."""
    lowered = question.lower()
    for pattern in (rf"between (.+?) and (.+?){_END}", rf"(\S.*?) (?:versus|vs\.?) (.+?){_END}",
                    rf"(?:use|choose|prefer|pick) (.+?) or (.+?)(?: to | for | when |{_END})",
                    rf"(?:is|are|does|do) (.+?) differ(?:ent)? from (.+?){_END}"):
        match = re.search(pattern, lowered)
        if match:
            sides = [question[match.start(g):match.end(g)] for g in (1, 2)]
            found = [key_phrases(side)[-1:] or phrases(side)[-1:] for side in sides]
            if all(found):
                return [found[0][0], found[1][0]]
    return []


# What a clause can ask about something without naming it: "what are the pitfalls".
_ASPECTS = frozenset(["pitfalls", "caveats", "limitations", "alternatives", "advantages", "disadvantages", "benefits", "drawbacks", "risks", "differences", "examples", "uses", "gotchas"])
_POSSESSIVES = frozenset(["its", "my", "our", "their", "your", "his", "her", "this", "that", "these", "those", "each", "every", "some", "any"])


def _agree(template: str, phrase: Phrase, *, countable: bool = False) -> str:
    """The template about the phrase, with "is"/"are" agreeing and a general article ("its default" -> "a default")."""
    plural = phrase.plural
    article = phrase.article
    if article in _POSSESSIVES or (not article and countable and not phrase.is_name):
        article = "" if plural else ("an" if phrase.words[:1].lower() in "aeiou" else "a")
    spoken = Phrase(phrase.words, article).spoken
    return template.format(thing=spoken, **{"is": "are" if plural else "is", "does": "do" if plural else "does"})


def _standalone(clause: str, topic: Phrase | None, sides: list[Phrase]) -> str | None:
    """A clause made to stand alone (a pronoun gets the topic, a question its question mark); None for a fragment."""
    words = clause.split()
    interrogative = words[0].lower() in _WH + _AUX
    if not interrogative and words[0].lower() not in _IMPERATIVES:
        return None  # "Pickle versus json": the intent's own sub-questions say it better
    if len(sides) == 2 and words[0].lower() == "which" and sides[0].words.lower() not in clause.lower():
        words[1:1] = ["of", sides[0].spoken, "and", sides[1].spoken]
    elif topic is not None and topic.words.lower() not in clause.lower():
        pronoun = next((i for i, w in enumerate(words) if i > 0 and w.lower() in _PRONOUNS), None)
        article = "the" if topic.article not in ("", "a", "an", "the") else topic.article
        if pronoun is not None:
            words[pronoun] = Phrase(topic.words, article).spoken
        elif interrogative and {p.words.lower() for p in phrases(clause)} <= _ASPECTS:  # "the pitfalls" of what?
            words[-1] = words[-1].rstrip("?") + " of " + Phrase(topic.words, article).spoken
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + "?" if interrogative and not text.endswith("?") else text


def _signature(text: str) -> set[str]:
    return {w.lower() for w in _TOKEN.findall(text)} - corpus.STOPWORDS - set(_AUX)


def _is_duplicate(candidate: str, chosen: list[str]) -> bool:
    mine = _signature(candidate)
    return any(mine and len(mine & _signature(other)) / len(mine | _signature(other)) >= 0.6 for other in chosen)


def subquestions(question: str, limit: int, *, known: Callable[[str], str | None] = lambda words: "title",
                 names_for: Callable[[str], list[str]] = lambda question: []) -> list[str]:
    """Up to `limit` sub-questions: the question's own clauses made standalone, then those its intent calls for.

    `known(words)` says what in the documentation is named so: "term" (a glossary entry),
    "module", "object", "title" (another page) or None; a plain single word must be a term
    or a module ("fast" names nothing), so that "What is ...?" is asked only about things a
    page can answer. `names_for(question)` gives the documented names that answer it best
    (`contextlib.contextmanager` for a context manager made from a generator): a how-to
    asks what they do, which keeps the report on the pages that answer.
    """
    limit = max(1, limit)
    asked = intent(question)
    candidates = key_phrases(question)
    kinds = {p.words: known(p.words) for p in candidates}
    named = [p for p in candidates
             if kinds[p.words] and (p.is_name or " " in p.words or kinds[p.words] in ("term", "module"))]
    topic = named[0] if named else (candidates[0] if candidates else None)
    chosen: list[str] = []

    def add(candidate: str | None) -> None:
        if candidate and len(chosen) < limit and not _is_duplicate(candidate, chosen):
            chosen.append(candidate)

    def define(phrase: Phrase) -> None:
        add(_agree("What {is} {thing}?", phrase, countable=kinds.get(phrase.words) == "term"))

    sides = compared(question) if asked == "comparison" else []
    for part in clauses(question):
        add(_standalone(part, topic, sides))
    if len(sides) == 2 and not chosen:
        add(f"How does {sides[0].spoken} compare with {sides[1].spoken}?")
    for side in sides:
        define(side)
    if asked in ("how-to", "behaviour"):
        for name in names_for(question)[:2]:
            if name.lower() not in " ".join(chosen).lower():
                add(f"What does {name} do?")
    if asked in ("definition", "comparison"):  # a how-to wants the page that shows how, not a definition
        for phrase in named:
            define(phrase)
    if asked == "definition" and named and len(chosen) < 2:
        add(_agree("How {is} {thing} used?", named[0], countable=kinds.get(named[0].words) == "term"))
    return chosen or [" ".join(question.split())]
