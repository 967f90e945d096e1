"""The Python documentation that Debian ships (python3.11-doc), read section by section from its HTML.

Each page of the tutorial, the library and language references, the how-tos, the FAQ and
the glossary becomes a few documents: one per section (its own prose, not its
subsections'), one per documented object (`contextlib.contextmanager`: its signature and
description) and one per glossary term. Titles, the headings above a document, the names
it documents and its code are kept apart from its prose, so that the index can weigh them
separately and quotes are never taken from code.

Body text is plain: paragraphs separated by a blank line, list items as "- " lines, code
blocks indented by four spaces (what corpus.sentence_spans skips as code and the source
page shows as code).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

DEFAULT_ROOT = Path("/usr/share/doc/python3.11/html")
ORIGIN = "https://docs.python.org/3.11/"
# What a Python programmer reads and cites; the C API, distutils and "what's new" are left out.
PARTS = ("tutorial", "library", "reference", "howto", "faq")
EXTRA_PAGES = ("glossary.html",)
# Index pages, the grammar and the regression-test helpers match every query and answer none;
# imp and optparse are superseded by importlib and argparse.
SKIPPED_PAGES = ("index.html", "grammar.html", "test.html", "asyncio-api-index.html", "asyncio-llapi-index.html",
                 "imp.html", "optparse.html", "asynchat.html", "asyncore.html", "smtpd.html")

_VOID = frozenset(["area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"])
_BLOCKS = frozenset(["p", "li", "dt", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "td", "th", "caption", "figcaption"])
_HEADINGS = frozenset(["h1", "h2", "h3", "h4", "h5", "h6"])
_OBJECT_DL = re.compile(r"\bpy\b")


@dataclass
class Section:
    """One document of the corpus: a section, a documented object or a glossary term."""

    path: str  # "library/contextlib.html"
    anchor: str  # "contextlib.contextmanager", "utilities", "term-decorator"
    kind: str  # "section" | "object" | "term"
    title: str = ""
    headings: list[str] = field(default_factory=list)  # the page's title and the headings above this one
    names: list[str] = field(default_factory=list)  # identifiers it documents or shows as code
    blocks: list[str] = field(default_factory=list)  # prose paragraphs, "- " items and indented code

    @property
    def body(self) -> str:
        return "\n\n".join(self.blocks)

    @property
    def prose(self) -> str:
        return "\n\n".join(block for block in self.blocks if not block.startswith("    "))


def available(root: Path = DEFAULT_ROOT) -> bool:
    return (root / "library" / "index.html").is_file()


def pages(root: Path = DEFAULT_ROOT) -> list[Path]:
    """The HTML pages to index, in a stable order."""
    found = [root / name for name in EXTRA_PAGES if (root / name).is_file()]
    for part in PARTS:
        found += sorted(p for p in (root / part).glob("*.html") if p.name not in SKIPPED_PAGES)
    return found


def origin_url(path: str, anchor: str = "") -> str:
    """Where a document lives on docs.python.org."""
    return ORIGIN + path + (f"#{anchor}" if anchor else "")


def sections(page: Path, root: Path = DEFAULT_ROOT) -> list[Section]:
    """The documents of one page, in page order; empty ones are left out."""
    parser = _PageParser(page.relative_to(root).as_posix())
    parser.feed(page.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return [s for s in parser.done if s.title and (s.prose.strip() or s.kind == "object")]


def all_sections(root: Path = DEFAULT_ROOT) -> Iterator[Section]:
    for page in pages(root):
        yield from sections(page, root)


class _PageParser(HTMLParser):
    """A walk over one Sphinx page's main body, keeping a stack of the documents being read."""

    def __init__(self, path: str) -> None:
        super().__init__(convert_charrefs=True)
        self.path = path
        self.done: list[Section] = []
        self.open: list[Section] = []
        self.page_title = ""
        self._tags: list[tuple[str, str]] = []  # (tag, what closing it ends)
        self._main_depth = -1  # len(self._tags) at the main body's div, -1 outside it
        self._skip_depth = -1
        self._text: list[str] = []  # the block being read
        self._target = ""  # "" (a body block) | "title" | "signature"
        self._in_pre = 0
        self._code: list[str] = []
        self._in_dl_object = 0
        self._bullet = False  # the next block read is a list item

    # --- the tag stack ------------------------------------------------------------

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag in _VOID:
            if tag == "br":
                self._text.append("\n" if self._in_pre else " ")
            return
        action = ""
        if self._main_depth < 0 or self._skip_depth >= 0:  # outside the body, or inside what is skipped
            if self._main_depth < 0 and tag == "div" and a.get("role") == "main":
                self._main_depth = len(self._tags)
                action = "main"
            self._tags.append((tag, action))
            return
        classes = a.get("class", "").split()
        if self._skip_depth < 0 and (
            tag in ("nav", "script", "style") or (tag == "a" and "headerlink" in classes)
            or (tag == "div" and ("contents" in classes or "toctree-wrapper" in classes))
            or (tag == "span" and "linenos" in classes)
        ):
            self._skip_depth = len(self._tags)
            action = "skip"
        elif tag == "section" and a.get("id"):
            self._flush()
            self._push(Section(self.path, a["id"], "section"))
            action = "section"
        elif tag == "dl" and _OBJECT_DL.search(a.get("class", "")):
            action = "dl-object"
            self._in_dl_object += 1
        elif tag == "dt" and self._in_dl_object and self._last_closed in ("dt-doc", "dt-more") \
                and self.open and self.open[-1].kind == "object":
            # Several signatures over one description (os.spawnl, os.spawnle, ...; window.addch's
            # two forms, the second without an id): one document.
            self._flush()
            if a.get("id"):
                self.open[-1].names.append(a["id"])
            self._target = "signature"
            action = "dt-more"
        elif tag == "dt" and a.get("id") and (self._in_dl_object or a["id"].startswith("term-")):
            self._flush()
            kind = "term" if a["id"].startswith("term-") and not self._in_dl_object else "object"
            section = Section(self.path, a["id"], kind, title=a["id"] if kind == "object" else "")
            if kind == "object":
                section.names.append(a["id"])
            self._push(section)
            self._target = "title" if kind == "term" else "signature"
            action = "dt-doc"
        elif tag == "dd" and self._tags and self._last_closed in ("dt-doc", "dt-more"):
            action = "dd-doc"
        elif tag in _HEADINGS:
            self._flush()
            self._target = "title"
            action = "heading"
        elif tag == "pre":
            self._flush()
            self._in_pre += 1
            action = "pre"
        elif tag in _BLOCKS:
            self._flush()
            self._bullet = self._bullet or tag == "li"
            action = "block"
        self._tags.append((tag, action))
        self._last_closed = ""

    _last_closed = ""

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID or not any(t == tag for t, _ in self._tags):
            return
        while self._tags:
            opened, action = self._tags.pop()
            self._close(action)
            if opened == tag:
                return

    def _close(self, action: str) -> None:
        depth = len(self._tags)
        if action == "skip" and depth == self._skip_depth:
            self._skip_depth = -1
        elif action == "main":
            self._flush()
            while self.open:
                self._pop()
            self._main_depth = -1
        elif action == "section":
            self._flush()
            self._pop()
        elif action == "dl-object":
            self._in_dl_object -= 1
        elif action == "dt-doc":
            text = self._take()
            section = self.open[-1] if self.open else None
            if section is not None:
                if section.kind == "term":
                    section.title = text
                elif text:
                    section.blocks.append(text)  # the signature opens an object's text
            self._target = ""
        elif action == "dt-more":
            text = self._take()
            if text and self.open:
                self.open[-1].blocks.append(text)
            self._target = ""
        elif action == "dd-doc":
            self._flush()
            self._pop()
        elif action == "heading":
            text = self._take()
            self._target = ""
            if self.open and not self.open[-1].title:
                self.open[-1].title = text
                if not self.page_title:
                    self.page_title = text
        elif action == "pre":
            self._in_pre -= 1
            code = "".join(self._text).strip("\n")
            self._text = []
            if code.strip() and self.open:
                self.open[-1].blocks.append("\n".join("    " + line.rstrip() for line in code.split("\n")))
        elif action == "block":
            self._flush()
        self._last_closed = action

    def handle_data(self, data: str) -> None:
        if self._main_depth >= 0 and self._skip_depth < 0:
            self._text.append(data)

    # --- documents ----------------------------------------------------------------

    def _push(self, section: Section) -> None:
        above = [s.title for s in self.open if s.title]
        section.headings = ([self.page_title] if self.page_title and self.page_title not in above[:1] else []) + above
        self.open.append(section)

    def _pop(self) -> None:
        if self.open:
            section = self.open.pop()
            section.names += _code_names(section.body)
            section.names = list(dict.fromkeys(section.names))
            self.done.append(section)

    def _take(self) -> str:
        text = " ".join("".join(self._text).split())
        self._text = []
        return text

    def _flush(self) -> None:
        if self._in_pre:
            return
        text = self._take()
        if text and self.open and self._target == "":
            self.open[-1].blocks.append(f"- {text}" if self._bullet else text)
            self._bullet = False


_NAME = re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b|\b[a-z]+_\w+\b|\b__\w+__\b")


def _code_names(body: str) -> list[str]:
    """Dotted and snake_case names a text mentions, in order, once each."""
    return list(dict.fromkeys(_NAME.findall(body)))[:40]
