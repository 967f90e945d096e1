"""The text a reader sees of an HTML page: what the visit tool returns of one.

Pages are read by lxml (libxml2's HTML parser, in C). Every visit of every task runs on a gateway job holding a
turn (one, by default), in threads that share its event loop's interpreter lock; BeautifulSoup with Python's
html.parser spent 110 ms of that lock on a 147 KB page (the Python docs' asyncio-task.html, here); this module
4.2 ms, of which lxml's parse 2 ms.
BeautifulSoup still reads the bytes' encoding (UnicodeDammit: the declared charset, a <meta> one, a BOM, then
UTF-8 and Windows-1252) and the rare page lxml cannot read whole (nested deeper than libxml2's 2,048 levels: it
stops there and keeps what it read), at its old cost.

The two read a well-formed page alike (tests/unit/test_html_text.py). Where a page leans on the parser to close
an element (a <div> inside a <p>), lxml closes it where a browser does and html.parser did not: what a
reader sees is lxml's reading.
"""

from __future__ import annotations

from typing import Any

import lxml.etree
import lxml.html
from bs4 import BeautifulSoup, Comment
from bs4.dammit import UnicodeDammit

# Elements that hold no readable page text, or text a reader never sees.
DROP_TAGS = ("script", "style", "nav", "noscript", "template", "svg", "canvas", "iframe", "object", "embed",
             "form", "button", "select", "head", "title")
# Elements that start a line of their own.
BLOCK_TAGS = ("p", "div", "section", "article", "main", "header", "footer", "aside", "li", "ul", "ol", "dl",
              "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "table", "tr", "td", "th",
              "figcaption", "br", "hr")


def html_to_text(content: bytes, charset: str | None) -> tuple[str, str]:
    """(title, text) of an HTML page: scripts, styles, navigation and hidden elements dropped."""
    markup = UnicodeDammit(content, [charset] if charset else [], is_html=True).unicode_markup
    if markup is None or not markup.strip():
        return "", ""
    markup = newlines_normalized(markup)
    # A parser a page (its error log is the page's), reading UnicodeDammit's text as UTF-8 bytes.
    parser = lxml.html.HTMLParser(encoding="utf-8", huge_tree=True)
    try:
        root = lxml.html.document_fromstring(markup.encode("utf-8"), parser=parser)
    except (lxml.etree.LxmlError, ValueError):
        root = None
    whole = not any(error.level == lxml.etree.ErrorLevels.FATAL for error in parser.error_log)
    read = _read_tree(root) if root is not None and whole else None
    if read is None:
        read = _read_soup(BeautifulSoup(markup, "html.parser"))
    title, text = read
    return title or next(iter(text.splitlines()), "")[:200], text


def newlines_normalized(markup: str) -> str:
    """CR LF and a lone CR made LF, as HTML reads a page before parsing it (its input stream's preprocessing).
    libxml2 does so itself, html.parser does not: BeautifulSoup read a lone CR between two elements as a space
    and lxml as a new line."""
    return markup.replace("\r\n", "\n").replace("\r", "\n")


def _read_tree(root: Any) -> tuple[str, str]:
    """(title, text) from lxml's tree."""
    # Text a reader never sees is where injected instructions like to hide. (A dropped element's tail, the
    # text after it, stays.)
    lxml.etree.strip_elements(root, lxml.etree.Comment, lxml.etree.ProcessingInstruction, with_tail=False)
    title_tag = root.find(".//title")
    title = " ".join(" ".join(title_tag.itertext()).split()) if title_tag is not None else ""
    if _hidden(root):  # the whole page (the root has no parent to be dropped from)
        return title, ""
    # The elements that could be hidden are found in C first: with _hidden over every element, the Python docs'
    # asyncio-task.html (3,458 elements) took 5.1 ms here, 4.2 ms so.
    may_hide = root.xpath("//*[@hidden or @aria-hidden or @style]")
    for tag in [*root.iter(*DROP_TAGS), *(tag for tag in may_hide if _hidden(tag))]:
        if tag.getparent() is not None:
            tag.drop_tree()
    for tag in root.iter(*BLOCK_TAGS):
        tag.text = "\n" + (tag.text or "")
        tag.tail = "\n" + (tag.tail or "")
    return title, _lines(root.text_content())


def _read_soup(soup: BeautifulSoup) -> tuple[str, str]:
    """(title, text) as BeautifulSoup reads them: for the pages lxml cannot."""
    title_tag = soup.find("title")
    title = " ".join(title_tag.get_text(" ").split()) if title_tag else ""
    for tag in soup.find_all(DROP_TAGS) + soup.find_all(_hidden):
        if not tag.decomposed:
            tag.decompose()
    for comment in soup.find_all(string=lambda s: isinstance(s, Comment)):
        comment.extract()
    for tag in soup.find_all(BLOCK_TAGS):
        tag.insert_before("\n")
        tag.insert_after("\n")
    return title, _lines(soup.get_text())


def _hidden(tag: Any) -> bool:
    """Whether a reader never sees the element (either library's)."""
    style = (tag.get("style") or "").replace(" ", "").lower()
    hidden = tag.has_attr("hidden") if hasattr(tag, "has_attr") else tag.get("hidden") is not None
    return hidden or tag.get("aria-hidden") == "true" or "display:none" in style or "visibility:hidden" in style


def _lines(text: str) -> str:
    """Each line's runs of whitespace made one space; empty lines dropped."""
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)
