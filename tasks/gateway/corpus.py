"""The bundled offline corpus: Python's own reference topics and standard-library docstrings, in SQLite FTS5.

It is built on first use from what ships with CPython, so the product searches and
quotes real text with no network. The same lexical machinery (query terms, sentence
spans, BM25 over sentences) serves the offline model provider's extract.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sqlite3
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from project.env import envstr
from tasks.gateway import configured

# Bump when the documents or the schema change: every installation rebuilds its index.
CORPUS_VERSION = "1"
TOPIC_PREFIX = "corpus://topic/"
MODULE_PREFIX = "corpus://module/"

# Packages before their submodules, so a re-exported object is named by its public path
# (asyncio.Task, not asyncio.tasks.Task); each object is indexed once.
MODULES = (
    "asyncio", "asyncio.tasks", "asyncio.futures", "asyncio.exceptions", "asyncio.timeouts",
    "asyncio.taskgroups", "asyncio.locks", "asyncio.queues", "asyncio.events", "asyncio.base_events",
    "asyncio.streams", "asyncio.subprocess", "asyncio.runners", "asyncio.coroutines", "asyncio.threads",
    "concurrent.futures", "threading", "multiprocessing", "queue", "contextlib", "contextvars",
    "json", "pathlib", "os", "os.path", "shutil", "tempfile", "io", "functools", "itertools",
    "operator", "collections", "collections.abc", "heapq", "bisect", "typing", "dataclasses", "enum",
    "abc", "types", "inspect", "logging", "logging.handlers", "warnings", "traceback", "subprocess",
    "signal", "selectors", "socket", "ssl", "http", "http.client", "http.server", "http.cookies",
    "urllib", "urllib.parse", "urllib.request", "urllib.error", "email.message", "sqlite3", "re",
    "string", "textwrap", "difflib", "datetime", "time", "zoneinfo", "calendar", "unittest",
    "unittest.mock", "doctest", "argparse", "csv", "hashlib", "hmac", "secrets", "random",
    "statistics", "math", "decimal", "fractions", "uuid", "base64", "struct", "pickle", "copy",
    "weakref", "gc", "zipfile", "tarfile", "gzip", "shlex", "glob", "fnmatch", "sched", "importlib",
    "pprint", "timeit", "sys",
)

STOPWORDS = frozenset("""
a about above after again against all also am an and any are aren as at be because been before being
below between both but by can cannot could did didn do does doesn doing don down during each either
else etc even ever every few for from further get gets got had has hasn have having he her here hers
herself him himself his how however i if in into is isn it its itself just let like ll me might more
most much must my myself no nor not now of off on once one only or other our ours ourselves out over
own per please re really same shall she should so some such than that the their theirs them
themselves then there these they this those through to too under until up upon us ve very via was
wasn we were weren what when where whether which while who whom whose why will with within without
would yet you your yours yourself yourselves
""".split())
# Words that shape a question but name nothing to look for.
QUESTION_FILLER = frozenset(
    "explain describe tell know work works working worked happen happens mean means thing things way ways "
    "kind kinds use used using exactly actually basically".split()
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

_build_lock = threading.Lock()
_ready: set[str] = set()


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
        start = line.start()
        for boundary in _SENTENCE_END.finditer(text, line.start(), line.end()):
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


_K1, _B = 1.2, 0.75
# A term found in most of the titles is the theme every source shares ("asyncio" when all
# sources are asyncio docs): it says little about which sentence answers the question.
_THEME_SHARE, _THEME_WEIGHT = 0.75, 0.25


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
    """The sentences of `texts` best matching `query` by BM25 over sentences (porter-stemmed), best first.

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
    weights: dict[str, float] = {}
    for index, word in enumerate(words + cue_words):
        for stem in query_stems.get(index, []):
            if index < len(words):
                shared = sum(stem in stems for stems in title_stems.values())
                theme = len(titles) > 1 and shared >= _THEME_SHARE * len(titles)
                weights[stem] = max(weights.get(stem, 0.0), _THEME_WEIGHT if theme else 1.0)
            else:
                weights.setdefault(stem, float((cues or {})[word]))
    focus = {stem for index in range(len(words)) for stem in query_stems.get(index, [])}
    counts = {row: Counter(stems) for row, stems in sentences.items()}
    average = sum(len(stems) for stems in sentences.values()) / max(1, len(sentences))
    frequency = Counter(stem for counter in counts.values() for stem in counter if stem in weights)
    scores: dict[int, float] = {}
    for row, counter in counts.items():
        if not focus & counter.keys():
            continue  # cues only reorder sentences about the subject
        length_norm = _K1 * (1 - _B + _B * sum(counter.values()) / average)
        score = 0.0
        for stem, weight in weights.items():
            tf = counter.get(stem, 0)
            if tf:
                idf = math.log(1 + (len(spans) - frequency[stem] + 0.5) / (frequency[stem] + 0.5))
                score += weight * idf * tf * (_K1 + 1) / (tf + length_norm)
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


def topic_documents() -> Iterator[tuple[str, str, str]]:
    """(url, title, text) of each language reference topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return
    for name in sorted(topics):
        raw = topics[name]
        lines = raw.split("\n", 2)
        title = name
        if len(lines) > 1 and _UNDERLINE.fullmatch(lines[1]) and lines[0].strip():
            title = lines[0].strip()
        yield TOPIC_PREFIX + name, title, reflow(raw)


def _signature(name: str, obj: Any) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    # Default values can print memory addresses ("<weakref at 0x7f...>"): the index must not vary by run.
    signature = re.sub(r" at 0x[0-9a-fA-F]+", "", signature)
    return name + (signature if len(signature) <= 300 else signature[:299] + "…)")


def _own_doc(obj: Any) -> str:
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _public_members(module: Any) -> list[tuple[str, Any]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    members = []
    for name in sorted(set(names)):
        obj = getattr(module, name, None)
        if obj is None or inspect.ismodule(obj):
            continue
        home = getattr(obj, "__module__", "") or ""
        # Without __all__, skip names a module merely imported from elsewhere.
        if not hasattr(module, "__all__") and home.lstrip("_").split(".")[0] != module.__name__.split(".")[0]:
            continue
        if inspect.isclass(obj) or callable(obj):
            members.append((name, obj))
    return members


def _class_members(cls: type) -> Iterator[tuple[str, Any]]:
    for name, attr in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        target = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        if callable(target) or isinstance(attr, property):
            yield name, target


def module_documents() -> Iterator[tuple[str, str, str]]:
    """(url, title, text) of each standard-library module and its documented public classes and functions."""
    seen: set[int] = set()

    def document(dotted: str, obj: Any, *, signature: bool) -> tuple[str, str, str] | None:
        if id(obj) in seen:
            return None
        seen.add(id(obj))
        doc = _own_doc(obj)
        if len(doc) < 15:
            return None
        head = _signature(dotted, obj) if signature else dotted
        return MODULE_PREFIX + dotted, dotted, f"{head}\n\n{reflow(doc)}"

    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a build without ssl, sqlite3, ...: index what there is
            continue
        entry = document(module_name, module, signature=False)
        if entry:
            yield entry
        for name, obj in _public_members(module):
            dotted = f"{module_name}.{name}"
            first_time = id(obj) not in seen
            entry = document(dotted, obj, signature=not inspect.isclass(obj))
            if entry:
                yield entry
            if inspect.isclass(obj) and first_time:
                for member_name, member in _class_members(obj):
                    entry = document(f"{dotted}.{member_name}", member, signature=False)
                    if entry:
                        yield entry


def documents() -> Iterator[tuple[str, str, str]]:
    """Every document of the corpus."""
    yield from topic_documents()
    yield from module_documents()


# --- The index ------------------------------------------------------------------


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


def _stamp() -> dict[str, str]:
    return {"corpus_version": CORPUS_VERSION, "python": ".".join(map(str, sys.version_info[:3]))}


def _is_current(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            found = dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
    except sqlite3.Error:
        return False
    return all(found.get(key) == value for key, value in _stamp().items())


def build(path: Path) -> None:
    """Build the index into a temporary file beside `path`, then rename it into place atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        db = sqlite3.connect(tmp_name)
        try:
            db.executescript("""
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE documents (id INTEGER PRIMARY KEY, url TEXT NOT NULL UNIQUE, title TEXT NOT NULL,
                                        keywords TEXT NOT NULL, identifiers TEXT NOT NULL, body TEXT NOT NULL);
                CREATE VIRTUAL TABLE documents_fts USING fts5(
                    keywords, body, identifiers, content='documents', content_rowid='id',
                    tokenize='porter unicode61');
            """)
            seen_bodies: set[str] = set()
            for url, title, body in documents():
                # Future.cancelled and Task.cancelled share one docstring: the second copy adds nothing.
                content = body.split("\n\n", 1)[-1] if url.startswith(MODULE_PREFIX) else body
                if content in seen_bodies:
                    continue
                seen_bodies.add(content)
                row = (url, title, keywords(url, title), identifier_words(body), body)
                cursor = db.execute("INSERT INTO documents (url, title, keywords, identifiers, body)"
                                    " VALUES (?, ?, ?, ?, ?)", row)
                db.execute("INSERT INTO documents_fts (rowid, keywords, body, identifiers) VALUES (?, ?, ?, ?)",
                           (cursor.lastrowid, row[2], row[4], row[3]))
            db.execute("INSERT INTO documents_fts (documents_fts) VALUES ('optimize')")
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", _stamp().items())
            db.commit()
        finally:
            db.close()
        # Processes racing on a first use each build their own file; whichever rename
        # lands last wins, and readers of the other keep a complete file open.
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def ensure_index() -> Path:
    """The path of a current index, building it first when missing or stale."""
    path = corpus_path()
    key = str(path)
    if key in _ready:
        return path
    with _build_lock:
        if key not in _ready:
            if not _is_current(path):
                build(path)
            _ready.add(key)
    return path


def _connect() -> sqlite3.Connection:
    return sqlite3.connect(f"file:{ensure_index()}?mode=ro", uri=True)


def search(query: str, *, limit: int = 10) -> list[dict[str, str]]:
    """The documents best matching `query` (BM25, titles weighted up), as search results."""
    terms = query_terms(query)
    if not terms or limit < 1:
        return []
    db = _connect()
    try:
        rows = db.execute(
            """
            SELECT d.url, d.title, snippet(documents_fts, 1, '', '', ' … ', 32)
            FROM documents_fts JOIN documents d ON d.id = documents_fts.rowid
            WHERE documents_fts MATCH ?
            -- Names weigh most; a one-line docstring gives less to read than a page, so it yields a little.
            ORDER BY bm25(documents_fts, 8.0, 1.0, 0.5) * (0.6 + 0.4 * min(1.0, length(d.body) / 600.0)), d.id
            LIMIT ?
            """,
            (match_expression(terms), limit),
        ).fetchall()
    finally:
        db.close()
    return [{"url": url, "title": title, "snippet": " ".join(snippet.split())} for url, title, snippet in rows]


def read(url: str) -> dict[str, str] | None:
    """The title and text of one corpus document, or None if there is no such document."""
    db = _connect()
    try:
        row = db.execute("SELECT title, body FROM documents WHERE url = ?", (url,)).fetchone()
    finally:
        db.close()
    return None if row is None else {"title": row[0], "text": row[1]}

