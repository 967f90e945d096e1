"""Every word a person reads is marked for translation, and the Chinese catalogs translate all of them.

Two checks. The templates: what a page shows (text, and the aria-label, title, placeholder
and alt attributes) comes from {% translate %} or {% blocktranslate %}, from a variable, or
sits inside an element marked translate="no". The catalogs: makemessages, run on a copy of
the sources, finds nothing the committed locale/zh_Hans catalogs lack, nothing fuzzy, and
nothing they hold that the sources no longer use; each translation keeps its placeholders.
"""

from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.core.management import call_command
from django.template.base import Lexer, TokenType
from django.test import override_settings

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"
LOCALE = ROOT / "locale"
DOMAINS = ("django", "djangojs")

# The product's name is the same in every language.
BRAND = "Longhaul"
# Attributes people read or hear (screen readers announce aria-label and title).
READ_ATTRIBUTES = frozenset({"aria-label", "title", "placeholder", "alt"})
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"})
# Stands for whatever a tag or a variable puts in the page: it is marked, or it is data.
FILLED = "\ue000"
TRANSLATION_TAGS = ("translate", "trans")
BLOCK_TRANSLATION_TAGS = {"blocktranslate": "endblocktranslate", "blocktrans": "endblocktrans"}
# Blocks that fill an attribute nobody reads ({% block body_class %}auth{% endblock %}).
UNREAD_BLOCKS = frozenset({"body_class"})


# --- the templates --------------------------------------------------------------------------


def skeleton(source: str) -> str:
    """The template's HTML with every tag and variable replaced by FILLED, comments and blocktranslate dropped."""
    out = []
    until = None  # the closing tag of a block being skipped
    for token in Lexer(source).tokenize():
        name = token.contents.split()[0] if token.token_type == TokenType.BLOCK and token.contents else ""
        if until:
            if name == until:
                until = None
            continue
        if token.token_type == TokenType.TEXT:
            out.append(token.contents)
        elif name == "comment":
            until = "endcomment"
        elif name == "block" and token.split_contents()[1] in UNREAD_BLOCKS:
            until = "endblock"
        elif name in BLOCK_TRANSLATION_TAGS:
            until = BLOCK_TRANSLATION_TAGS[name]
            out.append(FILLED)
        elif token.token_type in (TokenType.VAR, TokenType.BLOCK):
            out.append(FILLED)
    return "".join(out)


class ReadableText(HTMLParser):
    """Collects what a person reads: text nodes and READ_ATTRIBUTES, outside script, style and translate="no"."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self.open: list[tuple[str, bool]] = []  # (tag, whether it starts an untranslated region)

    @property
    def skipping(self) -> bool:
        return any(untranslated for _, untranslated in self.open)

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        untranslated = values.get("translate") == "no" or tag in ("script", "style")
        if not self.skipping and not untranslated:
            self.found += [value for name, value in attrs if name in READ_ATTRIBUTES and value]
        if tag not in VOID:
            self.open.append((tag, untranslated))

    def handle_startendtag(self, tag, attrs):
        if not self.skipping:
            self.found += [value for name, value in attrs if name in READ_ATTRIBUTES and value]

    def handle_endtag(self, tag):
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i][0] == tag:
                del self.open[i:]
                break

    def handle_data(self, data):
        if not self.skipping:
            self.found.append(data)


def unmarked_strings(source: str) -> list[str]:
    """Words of this template a person would read untranslated."""
    parser = ReadableText()
    parser.feed(skeleton(source))
    parser.close()
    texts = (" ".join(text.replace(FILLED, " ").replace(BRAND, " ").split()) for text in parser.found)
    return [text for text in texts if re.search(r"[^\W\d_]", text)]


def test_the_checker_flags_unmarked_text_and_attributes_but_not_marked_ones():
    source = """{% load i18n %}{# a comment #}
    <h1>Welcome back</h1>
    <button aria-label="Close panel">{% translate "Close" %}</button>
    <p>{% blocktranslate %}Hello {{ name }}{% endblocktranslate %} · {{ name }}</p>
    <span title="{% translate 'Workspace' %}">{{ tenant }}</span>
    <pre translate="no">manage.py adduser</pre><script>const x = "words";</script>
    {% comment %}Not shown{% endcomment %}<title>{% translate "Sign in" %} · Longhaul</title>
    """
    assert unmarked_strings(source) == ["Welcome back", "Close panel"]


@pytest.mark.parametrize("template", sorted(p.relative_to(TEMPLATES).as_posix() for p in TEMPLATES.rglob("*.html")))
def test_every_string_a_template_shows_is_marked_for_translation(template):
    assert unmarked_strings((TEMPLATES / template).read_text()) == [], (
        f"templates/{template} shows words outside {{% translate %}}/{{% blocktranslate %}}"
    )


# --- the catalogs ---------------------------------------------------------------------------


def read_po(path: Path) -> dict[tuple[str, str], dict]:
    """The entries of a .po file by (msgctxt, msgid), each with its fields and flags; obsolete ones (#~) left out."""
    entries = {}
    for block in path.read_text().split("\n\n"):
        entry: dict = {"flags": set()}
        field = None
        for line in block.splitlines():
            if line.startswith("#,"):
                entry["flags"] |= {flag.strip() for flag in line[2:].split(",")}
            elif line.startswith("#"):
                continue
            elif match := re.match(r'^(\w+(?:\[\d+\])?) "(.*)"$', line):
                field = match[1]
                entry[field] = _unquote(match[2])
            elif line.startswith('"') and field:
                entry[field] += _unquote(line[1:-1])
        if entry.get("msgid"):
            entries[(entry.get("msgctxt", ""), entry["msgid"])] = entry
    return entries


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m[1], m[1]), text)


def translations(entry: dict) -> list[str]:
    return [value for key, value in entry.items() if key.startswith("msgstr")]


PLACEHOLDER = re.compile(r"%\(\w+\)[sd]|<[^>]+>")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """The catalogs as makemessages writes them from the sources now, merged into a copy of the committed ones."""
    copy = tmp_path_factory.mktemp("sources")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.mo")
    for part in ("chat", "project", "tasks", "templates", "static", "locale"):
        shutil.copytree(ROOT / part, copy / part, ignore=skip)
    here = os.getcwd()
    os.chdir(copy)
    try:
        with override_settings(LOCALE_PATHS=[str(copy / "locale")]):
            for domain in DOMAINS:
                call_command("makemessages", locale=["en", "zh_Hans"], domain=domain, add_location="file",
                             no_obsolete=True, verbosity=0)
    finally:
        os.chdir(here)
    return copy / "locale"


@pytest.mark.parametrize("domain", DOMAINS)
def test_the_chinese_catalog_translates_every_marked_string_and_nothing_stale(regenerated, domain):
    fresh = read_po(regenerated / "zh_Hans" / "LC_MESSAGES" / f"{domain}.po")
    committed = read_po(LOCALE / "zh_Hans" / "LC_MESSAGES" / f"{domain}.po")
    untranslated = [msgid for (_, msgid), entry in fresh.items() if not all(translations(entry))]
    fuzzy = [msgid for (_, msgid), entry in fresh.items() if "fuzzy" in entry.get("flags", ())]
    stale = sorted(msgid for (_, msgid) in set(committed) - set(fresh))
    assert fresh, "makemessages found nothing: the check itself is broken"
    assert untranslated == [], f"locale/zh_Hans/LC_MESSAGES/{domain}.po lacks these (run makemessages, translate)"
    assert fuzzy == [], "fuzzy translations are not used: check and unmark them"
    assert stale == [], "no longer in the sources: run makemessages with --no-obsolete"
    english = read_po(LOCALE / "en" / "LC_MESSAGES" / f"{domain}.po")
    assert set(english) == set(fresh), f"locale/en/LC_MESSAGES/{domain}.po is not current: run makemessages"


@pytest.mark.parametrize("domain", DOMAINS)
def test_each_chinese_translation_keeps_its_placeholders_and_markup(domain):
    for (_, msgid), entry in read_po(LOCALE / "zh_Hans" / "LC_MESSAGES" / f"{domain}.po").items():
        wanted = sorted(PLACEHOLDER.findall(msgid))
        for text in translations(entry):
            assert sorted(PLACEHOLDER.findall(text)) == wanted, (msgid, text)
