"""The bundled offline corpus, in SQLite FTS5: the Python documentation, or pydoc's texts where it is missing.

The index is built once into var/ on first use, in a background thread, from the HTML
that Debian's python3.11-doc installs (tasks/gateway/pydocs.py) or, without it, from
the reference topics and docstrings that ship with CPython (tasks/gateway/docstrings.py),
so the product searches and quotes real text with no network.

Why FTS5's bm25() and not a separate BM25 library: it ships inside Python's sqlite3,
weighs columns natively (title, identifiers, headings, body), matches phrases, stems
with porter, and answers from an on-disk index that several worker processes share
without loading it into memory. The same lexical machinery (query terms, sentence
spans, BM25 over sentences) serves the offline model provider's extract.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import os
import re
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from project.env import envfloat, envstr
from tasks.gateway import configured, pydocs

# Bump when the documents or the schema change: every installation rebuilds its index.
CORPUS_VERSION = "4"
STOPWORDS = frozenset(["a", "about", "above", "after", "again", "against", "all", "also", "am", "an", "and", "any", "are", "aren", "as", "at", "be", "because", "been", "before", "being", "below", "between", "both", "but", "by", "can", "cannot", "could", "did", "didn", "do", "does", "doesn", "doing", "don", "down", "during", "each", "either", "else", "etc", "even", "ever", "every", "few", "for", "from", "further", "get", "gets", "got", "had", "has", "hasn", "have", "having", "he", "her", "here", "hers", "herself", "him", "himself", "his", "how", "however", "i", "if", "in", "into", "is", "isn", "it", "its", "itself", "just", "let", "like", "ll", "me", "might", "more", "most", "much", "must", "my", "myself", "no", "nor", "not", "now", "of", "off", "on", "once", "one", "only", "or", "other", "our", "ours", "ourselves", "out", "over", "own", "per", "please", "re", "really", "same", "shall", "she", "should", "so", "some", "such", "than", "that", "the", "their", "theirs", "them", "themselves", "then", "there", "these", "they", "this", "those", "through", "to", "too", "under", "until", "up", "upon", "us", "ve", "very", "via", "was", "wasn", "we", "were", "weren", "what", "when", "where", "whether", "which", "while", "who", "whom", "whose", "why", "will", "with", "within", "without", "would", "yet", "you", "your", "yours", "yourself", "yourselves"])
# Words that shape a question but name nothing to look for.
QUESTION_FILLER = frozenset(
    ["explain", "describe", "tell", "know", "work", "works", "working", "worked", "happen", "happens", "mean", "means", "thing", "things", "way", "ways", "kind", "kinds", "use", "used", "using", "exactly", "actually", "basically", "versus", "vs", "affect", "affects", "affected", "difference", "differences", "differ", "differs"]
)

_WORD = re.compile(r"\w+", re.UNICODE)
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.", "Mr.", "Dr.", "No.")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[A-Z0-9\"'(\[`*])")
_UNDERLINE = re.compile(r"\s*([*=\-~^\"'`#+])\1{2,}\s*")
_BULLET = re.compile(r"\s*([*\-+\u2022]|\d+[.)])\s+")
_CODE_LINE = re.compile(
    r"\s*(>>>|\.\.\.(\s|$)|\$ )"  # prompts
    r"|.*::="  # grammar productions
    r"|\s*(async\s+def|def|class)\s+\w+\s*[(:]"  # definitions
    r"|\s*(import \w[\w.]*|from [\w.]+ import .+)$"  # imports
)



def corpus_path() -> Path:
    """Where the index lives: LONGHAUL_CORPUS_PATH, else VAR_DIR/corpus.sqlite3."""
    raw = configured("LONGHAUL_CORPUS_PATH", lambda name: envstr(name, ""))
    return Path(raw) if raw else Path(settings.VAR_DIR) / "corpus.sqlite3"


# --- Lexical machinery ----------------------------------------------------------


def query_terms(text: str, *, limit: int = 16) -> list[str]:
    """The words of a query worth matching, lower-cased, in order, without stopwords or repeats."""
    terms: list[str] = []
    for word in _WORD.findall(text.lower()):
        if word in STOPWORDS or word in QUESTION_FILLER or len(word) < 2 or word in terms:
            continue
        terms.append(word)
    return terms[:limit]


def match_expression(terms: Sequence[str]) -> str:
    """An FTS5 MATCH expression that ORs the terms, each quoted so no query syntax leaks through."""
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


@dataclass(frozen=True)
class Span:
    start: int
    end: int


def sentence_spans(text: str, *, min_chars: int = 25, max_chars: int = 600) -> list[Span]:
    """Prose sentences of `text` as spans, so that text[span.start:span.end] is always verbatim."""
    spans: list[Span] = []
    for line in re.finditer(r"[^\n]+", text):
        # Indented lines are code, grammar or examples in reference text: not quotable prose.
        if _CODE_LINE.match(line.group()) or line.group().startswith(("  ", "\t")):
            continue
        start = line.start() + (2 if line.group().startswith("- ") else 0)  # a list item's marker is not text
        for boundary in _SENTENCE_END.finditer(text, start, line.end()):
            if text[max(start, boundary.start() - 6):boundary.start()].endswith(_ABBREVIATIONS):
                continue
            spans.append(Span(start, boundary.start()))
            start = boundary.end()
        spans.append(Span(start, line.end()))
    return [_clip(text, span, max_chars) for span in spans if _is_prose(text[span.start:span.end], min_chars)]


def _is_prose(piece: str, min_chars: int) -> bool:
    """Enough words and few code symbols to read as a sentence."""
    piece = piece.strip()
    words = re.findall(r"[^\W\d_]{2,}", piece)
    symbols = sum(piece.count(c) for c in "=(){}[]<>*_|\\/;")
    return len(piece) >= min_chars and len(words) >= 4 and symbols <= len(piece) / 20 + 1


def _clip(text: str, span: Span, max_chars: int) -> Span:
    """The span without edge whitespace, cut at a word boundary when too long."""
    start, end = span.start, span.end
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if end - start > max_chars:
        cut = text.rfind(" ", start, start + max_chars)
        end = cut if cut > start else start + max_chars
    return Span(start, end)


@dataclass(frozen=True)
class RankedSentence:
    doc: int
    start: int
    end: int
    score: float


# A term found in most of the titles is the theme every source shares ("asyncio" when all
# sources are asyncio docs): it says little about which sentence answers the question.
_THEME_SHARE, _THEME_WEIGHT = 0.75, 0.25
# A sentence next to one that covers the question often finishes its thought ("It means ...").
_NEIGHBOUR_SHARE = 0.35
# A document named after what is asked (the glossary's "generator" for "What is a generator?")
# answers in its first sentence: that is where the documentation defines it.
_TITLE_SHARE, _LEAD_BONUS, _LEAD_COVER = 0.3, 0.8, 0.8


def _stems(db: sqlite3.Connection, table: str, rows: Iterable[tuple[int, str]]) -> dict[int, list[str]]:
    """Porter stems of each row's words, by SQLite's own FTS5 tokenizer (so stems match the index's)."""
    db.execute(f"CREATE VIRTUAL TABLE {table} USING fts5(body, tokenize='porter unicode61')")
    db.execute(f"CREATE VIRTUAL TABLE {table}_words USING fts5vocab({table}, 'instance')")
    db.executemany(f"INSERT INTO {table} (rowid, body) VALUES (?, ?)", rows)
    stems: dict[int, list[str]] = {}
    for term, row in db.execute(f"SELECT term, doc FROM {table}_words ORDER BY doc, offset"):
        stems.setdefault(row, []).append(term)
    return stems


def rank_sentences(query: str, texts: Sequence[str], *, titles: Sequence[str] = (), limit: int,
                   cues: Mapping[str, float] | None = None) -> list[RankedSentence]:
    """The sentences of `texts` that best cover `query`'s terms, best first.

    A sentence scores the share of the query's weight it covers (each stem weighs its IDF
    among these sentences, a theme shared by most titles less), plus a part of its better
    neighbour's coverage, plus a part of its document title's coverage, with a bonus for
    the first sentence of a document whose title covers most of the query (a definition).
    `cues` are extra words with their weights (below 1): hints of an aspect, such as
    "however" for pitfalls, that reorder sentences already about the subject.
    """
    words = query_terms(query)
    spans = [(doc, span) for doc, text in enumerate(texts) for span in sentence_spans(text)]
    if not words or not spans or limit < 1:
        return []
    cue_words = [word for word in (cues or {}) if word not in words]
    db = sqlite3.connect(":memory:")
    try:
        sentences = _stems(db, "s", ((i, texts[doc][span.start:span.end]) for i, (doc, span) in enumerate(spans)))
        query_stems = _stems(db, "q", enumerate(words + cue_words))
        title_stems = _stems(db, "t", enumerate(titles))
    finally:
        db.close()
    present = {row: set(stems) for row, stems in sentences.items()}
    frequency = Counter(stem for stems in present.values() for stem in stems)
    weights: dict[str, float] = {}
    for index, word in enumerate(words):
        for stem in query_stems.get(index, []):
            shared = sum(stem in stems for stems in title_stems.values())
            theme = len(titles) > 1 and shared >= _THEME_SHARE * len(titles)
            idf = math.log(1 + (len(spans) - frequency[stem] + 0.5) / (frequency[stem] + 0.5))
            weights[stem] = max(weights.get(stem, 0.0), idf * (_THEME_WEIGHT if theme else 1.0))
    total = sum(weights.values()) or 1.0
    cue_stems = {stem: float((cues or {})[word]) for index, word in enumerate(cue_words, len(words))
                 for stem in query_stems.get(index, []) if stem not in weights}

    def covered(row: int) -> float:
        return sum(w for stem, w in weights.items() if stem in present.get(row, ())) / total

    title_cover = {doc: sum(w for stem, w in weights.items() if stem in set(title_stems.get(doc, []))) / total
                   for doc in range(len(texts))}
    first_of_doc = {}
    for row, (doc, _span) in enumerate(spans):
        first_of_doc.setdefault(doc, row)
    scores: dict[int, float] = {}
    for row, (doc, _span) in enumerate(spans):
        own = covered(row)
        lead = row == first_of_doc[doc] and title_cover[doc] >= _LEAD_COVER
        if own == 0 and not lead:
            continue
        neighbours = [covered(other) for other in (row - 1, row + 1)
                      if 0 <= other < len(spans) and spans[other][0] == doc]
        score = own + _NEIGHBOUR_SHARE * max(neighbours, default=0.0) + _TITLE_SHARE * title_cover[doc]
        score += _LEAD_BONUS if lead else 0.0
        score += sum(weight for stem, weight in cue_stems.items() if stem in present.get(row, ())) / 4
        scores[row] = score
    best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:limit]
    return [RankedSentence(spans[row][0], spans[row][1].start, spans[row][1].end, round(score, 4))
            for row, score in best]


# --- Documents ------------------------------------------------------------------


def reflow(text: str) -> str:
    """Docstring or reference text with wrapped prose paragraphs joined into lines, code left alone."""
    paragraphs: list[str] = []
    for block in re.split(r"\n[ \t]*\n", text.strip("\n")):
        lines = [line.rstrip() for line in block.split("\n") if not _UNDERLINE.fullmatch(line)]
        if not any(line.strip() for line in lines):
            continue
        dedented = inspect.cleandoc("\n".join(lines)).split("\n")
        if any(_CODE_LINE.match(line) for line in dedented) or any(line[:1].isspace() for line in dedented):
            paragraphs.append("\n".join(lines))
            continue
        merged: list[str] = []
        for line in dedented:
            if merged and not _BULLET.match(line):
                merged[-1] += " " + line.strip()
            else:
                merged.append(line.strip())
        paragraphs.append("\n".join(merged))
    return "\n\n".join(paragraphs)


# --- The index ------------------------------------------------------------------

DOCS_PREFIX = "corpus://docs/"
MODULE_PREFIX = "corpus://module/"  # pydoc's module documents (docstrings.py)
PYTHON_DOCS, PYDOC = "python-docs", "pydoc"
# Which corpus answered, as the page and the report say it.
CORPUS_LABELS = {
    PYTHON_DOCS: "the Python 3.11 documentation (python3.11-doc)",
    PYDOC: "pydoc's reference topics and docstrings (the Python documentation is not installed)",
}
# bm25() column weights: a document's name says most, then the names it documents, the
# headings above it, and its prose.
FIELD_WEIGHTS = (10.0, 4.0, 2.5, 1.0)
CANDIDATES = 400
# Below this share of the query's weight (by IDF), and with none of its phrases, a page is off-topic.
COVERAGE_FLOOR = 0.5
RELATIVE_FLOOR = 0.2
PER_PAGE = 3
OTHER_MODULE = 0.4
DEFINITION_FOR_HOW_TO = 0.4
HOW_TO = re.compile(r"\s*how (do|can|should|would|could) (i|you|we|one)\b|\s*how to\b", re.IGNORECASE)

log = logging.getLogger(__name__)
_build_lock = threading.Lock()
_ready: set[str] = set()
_builds: dict[str, threading.Thread] = {}
_build_errors: dict[str, tuple[float, BaseException]] = {}
REBUILD_AFTER_S = 300.0
STALE_BUILD_S = 3600.0  # a build takes seconds; a temporary file this old has no writer


class CorpusError(Exception):
    """The offline index cannot answer now."""


class CorpusBuilding(CorpusError):
    """The index is still being built in the background."""


class CorpusUnavailable(CorpusError):
    """Building the index failed; it is tried again after REBUILD_AFTER_S."""


@dataclass(frozen=True)
class Document:
    url: str
    title: str
    headings: str
    identifiers: str
    body: str


def docs_root() -> Path:
    raw = configured("LONGHAUL_DOCS_PATH", lambda name: envstr(name, ""))
    return Path(raw) if raw else pydocs.DEFAULT_ROOT


def corpus_name() -> str:
    """The corpus this machine can build: the Python documentation when installed, else pydoc's."""
    return PYTHON_DOCS if pydocs.available(docs_root()) else PYDOC


def identifier_words(body: str) -> str:
    """The words inside the compound identifiers of a text (CancelledError -> cancelled error), once each."""
    found = dict.fromkeys(re.findall(r"\b(?:[A-Za-z]+[a-z0-9][A-Z]\w*|[A-Za-z]\w*_\w+)\b", body))
    words = (re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).replace("_", " ") for name in found)
    return " ".join(dict.fromkeys(" ".join(words).lower().split()))


def keywords(url: str, title: str) -> str:
    """The words of a document's name, CamelCase and snake_case split, so CancelledError matches "cancelled"."""
    name = url.rsplit("/", 1)[-1]
    split = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", f"{title} {name}")
    return f"{title} {name} " + re.sub(r"[._\-]+", " ", split)


def _docs_documents(root: Path) -> Iterator[Document]:
    pages = pydocs.pages(root)
    step = max(1, len(pages) // 10)
    for number, page in enumerate(pages, 1):
        for section in pydocs.sections(page, root):
            names = " ".join(section.names)
            yield Document(
                url=f"{DOCS_PREFIX}{section.path}#{section.anchor}",
                title=section.title,
                headings=" \u203a ".join(section.headings),
                identifiers=f"{names} {identifier_words(names)}" if names else "",
                body=section.body,
            )
        if number % step == 0 or number == len(pages):
            log.info("corpus: read %d of %d pages of the Python documentation", number, len(pages))


def _pydoc_documents() -> Iterator[Document]:
    from tasks.gateway import docstrings

    seen_bodies: set[str] = set()
    for url, title, body in docstrings.documents():
        # Future.cancelled and Task.cancelled share one docstring: the second copy adds nothing.
        content = body.split("\n\n", 1)[-1] if url.startswith(MODULE_PREFIX) else body
        if content in seen_bodies:
            continue
        seen_bodies.add(content)
        yield Document(url, title, "", f"{keywords(url, title)} {identifier_words(body)}", body)


def _stamp() -> dict[str, str]:
    name = corpus_name()
    return {"corpus_version": CORPUS_VERSION, "python": ".".join(map(str, sys.version_info[:3])),
            "corpus": name, "source": str(docs_root()) if name == PYTHON_DOCS else "stdlib"}


def _read_meta(path: Path) -> dict[str, str]:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
    except sqlite3.Error:
        return {}


def _is_current(path: Path) -> bool:
    if not path.exists():
        return False
    found = _read_meta(path)
    return all(found.get(key) == value for key, value in _stamp().items())


def build(path: Path) -> None:
    """Build the index into a temporary file beside `path`, then rename it into place atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A process that died while building left its temporary file: remove those no build still writes.
    for stale in path.parent.glob(f"{path.name}.*.tmp"):
        if time.time() - stale.stat().st_mtime > STALE_BUILD_S:
            stale.unlink(missing_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    stamp = _stamp()
    started = time.monotonic()
    try:
        db = sqlite3.connect(tmp_name)
        try:
            db.executescript("""
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE documents (id INTEGER PRIMARY KEY, url TEXT NOT NULL UNIQUE, title TEXT NOT NULL,
                                        headings TEXT NOT NULL, identifiers TEXT NOT NULL, body TEXT NOT NULL);
                CREATE VIRTUAL TABLE documents_fts USING fts5(
                    title, identifiers, headings, body, content='documents', content_rowid='id',
                    tokenize="porter unicode61 tokenchars '_'");
            """)
            documents = _docs_documents(docs_root()) if stamp["corpus"] == PYTHON_DOCS else _pydoc_documents()
            for doc in documents:
                row = (doc.url, doc.title, doc.headings, doc.identifiers, doc.body)
                cursor = db.execute("INSERT OR IGNORE INTO documents (url, title, headings, identifiers, body)"
                                    " VALUES (?, ?, ?, ?, ?)", row)
                if cursor.rowcount:
                    db.execute("INSERT INTO documents_fts (rowid, title, identifiers, headings, body)"
                               " VALUES (?, ?, ?, ?, ?)", (cursor.lastrowid, *row[1:]))
            db.execute("INSERT INTO documents_fts (documents_fts) VALUES ('optimize')")
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", stamp.items())
            count = db.execute("SELECT count(*) FROM documents").fetchone()[0]
            db.commit()
        finally:
            db.close()
        # Processes racing on a first use each build their own file; whichever rename
        # lands last wins, and readers of the other keep a complete file open.
        os.replace(tmp_name, path)
        log.info("corpus: %d documents from %s indexed into %s in %.1f s", count, CORPUS_LABELS[stamp["corpus"]],
                 path, time.monotonic() - started)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _build_in_background(path: Path) -> None:
    try:
        build(path)
    except BaseException as exc:  # handed to whoever waits for it
        log.exception("corpus: building %s failed", path)
        _build_errors[str(path)] = (time.monotonic(), exc)


def ensure_index(*, wait_s: float | None = None) -> Path:
    """The path of a current index; when missing or stale, it is built in a background thread first.

    The caller waits up to `wait_s` (LONGHAUL_CORPUS_BUILD_WAIT_SECONDS) for the build and
    gets CorpusBuilding if it is still running then; later callers join the same build. A
    failed build raises CorpusUnavailable, and is not tried again for REBUILD_AFTER_S.
    """
    if wait_s is None:
        wait_s = float(configured("LONGHAUL_CORPUS_BUILD_WAIT_SECONDS",
                                  lambda name: envfloat(name, 60.0, minimum=0.0, maximum=3600.0)))
    path = corpus_path()
    key = str(path)
    if key in _ready:
        return path
    with _build_lock:
        if key in _ready:
            return path
        if _is_current(path):
            _ready.add(key)
            return path
        failed = _build_errors.get(key)
        if failed is not None and time.monotonic() - failed[0] < REBUILD_AFTER_S:
            raise CorpusUnavailable(f"building the offline corpus failed: {failed[1]}")
        thread = _builds.get(key)
        if thread is None or not thread.is_alive():
            _build_errors.pop(key, None)
            log.info("corpus: building the offline index from %s in the background", CORPUS_LABELS[corpus_name()])
            thread = threading.Thread(target=_build_in_background, args=(path,), name="corpus-build", daemon=True)
            _builds[key] = thread
            thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        raise CorpusBuilding(f"the offline corpus is still being built into {path}")
    with _build_lock:
        if not _is_current(path):
            failed = _build_errors.get(key)
            raise CorpusUnavailable(f"building the offline corpus failed: {failed[1] if failed else 'no index'}")
        _ready.add(key)
    return path


def _connect() -> sqlite3.Connection:
    return sqlite3.connect(f"file:{ensure_index()}?mode=ro", uri=True)


def describe() -> dict[str, str]:
    """Which corpus answers here: {"corpus": name, "label": words for people}."""
    name = _read_meta(ensure_index()).get("corpus", PYDOC)
    return {"corpus": name, "label": CORPUS_LABELS.get(name, name)}


def origin_url(url: str) -> str:
    """The public address of a corpus document (docs.python.org), or "" for pydoc's."""
    return pydocs.origin_url(*url[len(DOCS_PREFIX):].split("#", 1)) if url.startswith(DOCS_PREFIX) else ""


# --- Search ---------------------------------------------------------------------


@dataclass
class _Candidate:
    rowid: int
    url: str
    title: str
    body: str
    bm25: float
    score: float = 0.0


def _document_frequency(db: sqlite3.Connection, expression: str) -> int:
    return db.execute("SELECT count(*) FROM documents_fts WHERE documents_fts MATCH ?", (expression,)).fetchone()[0]


def _matching(db: sqlite3.Connection, expression: str, rowids: AbstractSet[int]) -> set[int]:
    """Which of `rowids` match. Every match, kept here if among them: FTS5 takes no list of rowids into its
    index, so `AND rowid IN (...)` tested each match against the 400 candidates' bound list in SQLite, and
    cost 5 to 20 times as much (11 ms a statement, most of a search's time)."""
    return {row for (row,) in db.execute("SELECT rowid FROM documents_fts WHERE documents_fts MATCH ?", (expression,))
            if row in rowids}


def _snippet(db: sqlite3.Connection, expression: str, rowid: int) -> str:
    """A result's passage around the words matched (one row, found through its rowid: FTS5 takes `rowid =`)."""
    row = db.execute("SELECT snippet(documents_fts, 3, '', '', ' \u2026 ', 32) FROM documents_fts "
                     "WHERE documents_fts MATCH ? AND rowid = ?", (expression, rowid)).fetchone()
    return " ".join((row[0] if row else "").split())


def _quoted(*words: str) -> str:
    return '"' + " ".join(words).replace('"', '""') + '"'


def _compounds(db: sqlite3.Connection, terms: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Adjacent query terms the index knows as one word ("context manager" -> contextmanager)."""
    found: dict[str, tuple[str, str]] = {}
    for first, second in itertools.pairwise(terms):
        joined = first + second
        if _document_frequency(db, f"title : {_quoted(joined)} OR identifiers : {_quoted(joined)}"):
            found[joined] = (first, second)
    return found


def search(query: str, *, limit: int = 10) -> list[dict[str, Any]]:
    """The documents best answering `query`, best first, as search results.

    BM25 over the fields with FIELD_WEIGHTS picks candidates; each is then scored by how
    much of the query's weight it covers (by IDF: a rare term counts more than "lock") and
    by the query's phrases it contains ("global interpreter lock" as words in a row, more
    so in its title or headings). A candidate below the coverage floor with none of the
    phrases is off-topic and dropped, and so is one scoring below RELATIVE_FLOOR of the
    best; near-duplicates and more than PER_PAGE sections of one page are dropped too.
    Each result's "relevance" is its score over the best one's (1.0 for the first).
    """
    terms = query_terms(query)
    if not terms or limit < 1:
        return []
    db = _connect()
    try:
        return _search(db, query, terms, limit=limit)
    finally:
        db.close()


def _search(db: sqlite3.Connection, query: str, terms: list[str], *, limit: int) -> list[dict[str, Any]]:
    """search() on one connection to the index, open until the results' snippets are read."""
    compounds = _compounds(db, terms)
    modules = _modules_named(db, query)
    weights = ", ".join(str(w) for w in FIELD_WEIGHTS)
    expression = match_expression([*terms, *compounds])
    rows = db.execute(
        f"""
        SELECT d.id, d.url, d.title, d.body, bm25(documents_fts, {weights})
        FROM documents_fts JOIN documents d ON d.id = documents_fts.rowid
        WHERE documents_fts MATCH ? ORDER BY 5, d.id LIMIT ?
        """,  # the weights are constants
        (expression, CANDIDATES),
    ).fetchall()
    candidates = [_Candidate(*row) for row in rows]
    if not candidates:
        return []
    rowids = {c.rowid for c in candidates}
    total = db.execute("SELECT count(*) FROM documents").fetchone()[0]
    idf = {t: math.log(1 + (total - (df := _document_frequency(db, _quoted(t))) + 0.5) / (df + 0.5))
           for t in terms}
    covers = {t: _matching(db, _quoted(t), rowids) for t in terms}
    for joined, (first, second) in compounds.items():
        hits = _matching(db, _quoted(joined), rowids)
        covers[first] |= hits
        covers[second] |= hits
    phrases = [terms[i:i + n] for n in (3, 2) for i in range(len(terms) - n + 1)]
    in_text = {tuple(p): _matching(db, _quoted(*p), rowids) for p in phrases}
    in_name = {tuple(p): _matching(db, "{title headings identifiers} : " + _quoted(*p), rowids) for p in phrases}
    weight = sum(idf.values()) or 1.0
    names = [t for t in terms if "_" in t]
    how_to = HOW_TO.match(query) is not None
    kept: list[_Candidate] = []
    for c in candidates:
        coverage = sum(idf[t] for t in terms if c.rowid in covers[t]) / weight
        phrase_hits = sum(c.rowid in hits for hits in in_text.values())
        squeezed = c.title.lower().replace("_", "")
        named = any(c.rowid in hits for hits in in_name.values()) or any(joined in squeezed for joined in compounds)
        # Its whole name is asked about ("threading.RLock", "global interpreter lock"), not a part of it.
        exact = _is_named_by(c.title, query, compounds)
        if names:
            # The query names an identifier (__slots__, lru_cache): a page is on-topic if and only if it has it.
            if not any(c.rowid in covers[t] for t in names):
                continue
        elif coverage < COVERAGE_FLOOR and not phrase_hits:
            continue
        substance = 0.6 + 0.4 * min(1.0, len(c.body) / 600.0)
        if how_to and "glossary.html#" in c.url:
            substance *= DEFINITION_FOR_HOW_TO  # a definition does not show how
        if modules and _other_module(c.url, modules):
            # The question names its modules (datetime, threading.RLock): another module's page is a detour.
            substance *= OTHER_MODULE
        c.score = -c.bm25 * (0.25 + coverage ** 2) * (1 + 0.5 * min(phrase_hits, 2) + (1.0 if named else 0.0)) \
            * substance * (3.0 if exact else 1.0)
        kept.append(c)
    kept.sort(key=lambda c: (-c.score, c.rowid))
    results: list[dict[str, Any]] = []
    accepted: list[_Candidate] = []
    per_page: Counter[str] = Counter()
    for c in kept:
        if results and c.score < RELATIVE_FLOOR * kept[0].score:
            break
        page = c.url.split("#", 1)[0]
        if per_page[page] >= PER_PAGE or any(_near_duplicate(c, other) for other in accepted):
            continue
        per_page[page] += 1
        accepted.append(c)
        results.append({"url": c.url, "title": c.title, "snippet": _snippet(db, expression, c.rowid),
                        "relevance": round(c.score / kept[0].score, 3)})
        if len(results) >= limit:
            break
    return results


def _modules_named(db: sqlite3.Connection, query: str) -> set[str]:
    """The documented modules a query names: dotted names' modules (threading.RLock) and bare module names (json)."""
    found: set[str] = set()
    for match in re.finditer(r"[A-Za-z_][\w.]*\w", query):
        token = match.group()
        following = _WORD.match(query[match.end():].lstrip().lower())
        if "." not in token and following and following.group() not in STOPWORDS | QUESTION_FILLER:
            continue  # a word inside a phrase ("local time zone") is English, not the module
        parts = token.lower().split(".")
        for end in range(len(parts), 0, -1):
            module = ".".join(parts[:end])
            if db.execute("SELECT 1 FROM documents WHERE url = ?",
                          (f"{DOCS_PREFIX}library/{module}.html#module-{module}",)).fetchone():
                found.add(module)
                break
    return found


def _other_module(url: str, modules: set[str]) -> bool:
    """A page of the library reference about a module the query does not name (nor a submodule of one it names)."""
    match = re.match(re.escape(DOCS_PREFIX) + r"library/([\w.]+)\.html", url)
    if match is None:
        return False
    page = match[1].lower()
    return not any(page == m or page.startswith(m + ".") for m in modules)


def _singular(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _is_named_by(title: str, query: str, compounds: Iterable[str] = ()) -> bool:
    """The words of a short title are a run of the query's words, in order (plurals aside).

    "threading.RLock" in "... threading.Lock and threading.RLock?", "global interpreter lock",
    "contextmanager" for "context manager"; not "Return types" for "returns the same type".
    """
    name = re.sub(r"^[\d.]+\s", "", title).split(" \u2014 ", 1)[0]  # "logging — Logging facility ..." is "logging"
    words = [_singular(w) for w in _WORD.findall(name.lower())]
    asked = [_singular(w) for w in _WORD.findall(query.lower())]
    if not 0 < len(words) <= 4:
        return False
    if len(words) == 1 and words[0] in compounds:
        return True
    return any(asked[i:i + len(words)] == words for i in range(len(asked) - len(words) + 1))


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i:i + 4]) for i in range(max(1, len(words) - 3))}


def _near_duplicate(a: _Candidate, b: _Candidate) -> bool:
    """The same text under two names (Lock.acquire and RLock.acquire often are), or the same title."""
    if a.title.lower() == b.title.lower():
        return True
    first, second = _shingles(a.body.split("\n\n", 1)[-1]), _shingles(b.body.split("\n\n", 1)[-1])
    return bool(first and second) and len(first & second) / len(first | second) >= 0.7


def names_a_document(words: str) -> str | None:
    """What names these words: "term" (a glossary entry), "module", "object" or "title" (another page), or None.

    The words must be a whole title (plurals aside): a glossary term's ("context manager"),
    a module's before its dash ("json — ..."), an object's last part ("os.path"), or a
    section's ("Generators"). "typed fields" names nothing though a section is titled
    "Descriptor-typed fields".
    """
    terms = [w for w in _WORD.findall(words.lower()) if w]
    if not terms:
        return None
    word = words.lower().strip()
    db = _connect()
    try:
        rows = [url for (url,) in db.execute(
            "SELECT url FROM documents WHERE lower(title) IN (?, ?, ?) OR lower(title) LIKE ? ESCAPE '\\' "
            "OR lower(title) LIKE ? ESCAPE '\\' LIMIT 50",
            (word, word + "s", _singular(word), _like(word) + " \u2014 %", "%." + _like(word)))]
        if any("glossary.html#term-" in url for url in rows):
            return "term"
        if any("#module-" in url or url.startswith(MODULE_PREFIX) for url in rows):
            return "module"
        if any(url.split("#", 1)[1].count(".") or "." in word for url in rows if "#" in url):
            return "object"
        return "title" if rows else None
    finally:
        db.close()


def documented_names(question: str, *, limit: int = 2, floor: float = 0.7) -> list[str]:
    """The documented objects among a question's best results whose own name echoes a word of it.

    "contextlib.contextmanager" for a context manager, "functools.lru_cache" for caching;
    not "importlib.machinery.FileFinder", which a question about caching finds for its
    prose, not its name.
    """
    asked = {word for word in _WORD.findall(question.lower()) if len(word) >= 3 and word not in STOPWORDS}
    names = []
    for result in search(question, limit=4):
        name = result["title"].split(" \u2014 ", 1)[0]
        if result.get("relevance", 0) < floor or not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            continue
        # An object, not a whole module: "What does unittest do?" is too broad to answer a how-to.
        if "." in name and "#module-" not in result["url"] and _echoes(name.rsplit(".", 1)[-1], asked):
            names.append(name)
    return list(dict.fromkeys(names))[:limit]


def _echoes(name: str, asked: set[str]) -> bool:
    """Whether a word of the name (CamelCase and snake_case split, compounds kept) shares its stem with one asked."""
    split = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).replace("_", " ").lower().split()
    words = {w for w in [*split, name.lower().replace("_", "")] if len(w) >= 3}
    joined = {a + b for a in asked for b in asked if a != b}
    return any(w[:4] == a[:4] and min(len(w), len(a)) >= 4 or w == a for w in words for a in asked | joined)


def _like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def read(url: str) -> dict[str, str] | None:
    """The title, headings and text of one corpus document, or None if there is no such document."""
    db = _connect()
    try:
        row = db.execute("SELECT title, headings, body FROM documents WHERE url = ?", (url,)).fetchone()
    finally:
        db.close()
    return None if row is None else {"title": row[0], "headings": row[1], "text": row[2]}
