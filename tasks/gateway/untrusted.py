"""Untrusted text (tool results, web pages, remote servers, task names) made safe to place in a prompt.

The frame is `<untrusted origin="...">` ... `</untrusted>`. Inside it no tag can open or
close anything, because every `<` that starts something tag-like is replaced by `‹`;
fullwidth and other compatibility look-alikes are folded first (NFKC), so they are
caught too. Role markers at the start of a line are marked as quoted.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys
import unicodedata

OPEN = '<untrusted origin="{origin}">'
CLOSE = "</untrusted>"

# `<` followed by what could begin a tag, a comment, a processing instruction or a
# chat-template token (`<|im_start|>`), allowing whitespace the model might ignore.
_TAG_START = re.compile(r"<(?=\s*[/!?|]?\s*[A-Za-z|])")
_BRACKET_ROLE = re.compile(r"\[(/?\s*(?:INST|SYS|SYSTEM|ASSISTANT|USER)\s*)\]", re.IGNORECASE)
_LINE_ROLE = re.compile(
    r"^([ \t>#*_-]*)(system|assistant|user|developer|human|tool)(\s*:)", re.IGNORECASE | re.MULTILINE
)
_BLANK_RUN = re.compile(r"\n{4,}")
_SPACE_RUN = re.compile(r"\s+")


def _strip_invisible(text: str, *, keep_newlines: bool) -> str:
    """Drop control, format (zero-width, bidi override), surrogate and private-use characters; tabs and line
    breaks are kept, or made spaces."""
    text = _invisible().sub("", text)
    return text if keep_newlines else text.translate(_AS_SPACES)


_AS_SPACES = str.maketrans("\n\t", "  ")
INVISIBLE_CATEGORIES = ("Cc", "Cf", "Cs", "Co")


@functools.cache
def _invisible() -> re.Pattern[str]:
    """One character class of every invisible character but the tab and the line feed, from this Python's
    Unicode data: the gateway's event loop frames a page's text in C (a 12,000-character source in 0.17 ms,
    where a loop over its characters took 1 ms). Built on first use, in 60 ms: planes 4 to 13 hold no
    character (a test checks every code point), the others are looked at one code point at a time."""
    ranges: list[tuple[int, int]] = []
    for code in itertools.chain(range(0x40000), range(0xE0000, sys.maxunicode + 1)):
        if code in (9, 10) or unicodedata.category(chr(code)) not in INVISIBLE_CATEGORIES:
            continue
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1] = (ranges[-1][0], code)
        else:
            ranges.append((code, code))
    return re.compile("[" + "".join(f"{re.escape(chr(first))}-{re.escape(chr(last))}" for first, last in ranges) + "]")


def _defuse(text: str) -> str:
    """Make tags, template tokens and role markers inert."""
    text = _TAG_START.sub("\u2039", text)
    text = _BRACKET_ROLE.sub("\u27e6\\1\u27e7", text)
    return _LINE_ROLE.sub(r"\1(quoted) \2\3", text)


def neutralize(text: str) -> str:
    """Untrusted text with invisible characters dropped and markup defused, line breaks kept."""
    text = unicodedata.normalize("NFKC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = _strip_invisible(text, keep_newlines=True)
    return _BLANK_RUN.sub("\n\n\n", _defuse(text))


def neutralize_name(name: str, *, limit: int = 80) -> str:
    """A short untrusted label on one line: tags and quotes defused, length capped."""
    text = unicodedata.normalize("NFKC", name)
    text = _SPACE_RUN.sub(" ", _strip_invisible(text, keep_newlines=False)).strip()
    # A name may land inside an attribute or a heading, so no angle brackets or double quotes at all.
    text = text.replace("<", "\u2039").replace(">", "\u203a").replace('"', "'")
    text = _BRACKET_ROLE.sub("\u27e6\\1\u27e7", text)
    if len(text) > limit:
        text = text[: max(1, limit - 1)].rstrip() + "\u2026"
    return text


def frame(text: str, *, origin: str, limit: int = 20_000) -> str:
    """Untrusted text neutralized, truncated to `limit` characters, and wrapped in a block naming its origin."""
    body = neutralize(text)
    if len(body) > limit:
        dropped = len(body) - limit
        body = body[:limit].rstrip() + f"\n[\u2026 truncated: {dropped} more characters not shown]"
    return f"{OPEN.format(origin=neutralize_name(origin))}\n{body}\n{CLOSE}"
