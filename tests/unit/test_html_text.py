"""The text a reader sees of a page (tasks/gateway/html_text.py): lxml's reading is BeautifulSoup's, which it
replaced on the gateway's hot path and still stands in for it where lxml cannot read a page."""

from __future__ import annotations

import html

from bs4 import BeautifulSoup
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tasks.gateway import html_text
from tasks.gateway.html_text import html_to_text

# Elements of every kind the reader treats apart (dropped, a line of their own, inline), nested as HTML allows
# them to be without the parser closing one implicitly (a <div> inside a <p> closes it, and an <a> or a <form>
# inside another, in a browser as in lxml; Python's html.parser keeps them open, so the two readings of such a
# page differ, and a browser shows lxml's).
CONTAINERS = ("div", "section", "article", "main", "header", "footer", "aside", "blockquote", "nav", "noscript",
              "object")
INLINE = ("span", "b", "i", "em", "code")
LEAVES = ("<br>", "<hr>", "<form><input value='x'>FORM TEXT</form>", "<button>Click</button>")
ATTRIBUTES = ("", " hidden", ' aria-hidden="true"', ' aria-hidden="false"', ' style="display: none"',
              ' style="color: red; visibility:hidden"', ' style="color: red"', ' class="x"')
# Text, escaped, and character references of the kinds parsers have read differently (an HTML5-only name, a
# Windows-1252 number, a non-breaking space).
words = st.lists(st.one_of(st.text(alphabet=st.sampled_from("ab \n\r\t\u00e9&<>\u00a0"), max_size=6).map(html.escape),
                           st.sampled_from(["&hellip;", "&#133;", "&check;", "&nbsp;", "&amp;", "&#x27;"])),
                 max_size=4).map("".join)


def inline(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda tag, attrs, inner, tail: f"<{tag}{attrs}>{''.join(inner)}</{tag}>{tail}",
                     st.sampled_from(INLINE), st.sampled_from(ATTRIBUTES), st.lists(children, max_size=3), words)


def block(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.builds(lambda tag, attrs, inner, tail: f"<{tag}{attrs}>{''.join(inner)}</{tag}>{tail}",
                  st.sampled_from(CONTAINERS), st.sampled_from(ATTRIBUTES), st.lists(children, max_size=4), words),
        st.builds(lambda attrs, inner: f"<p{attrs}>{''.join(inner)}</p>", st.sampled_from(ATTRIBUTES),
                  st.lists(phrasing, max_size=3)),
        st.builds(lambda items: "<ul>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>",
                  st.lists(words, max_size=3)),
        st.builds(lambda text: f"<!-- {text} -->", st.sampled_from(["COMMENT", "a -- b"])),
        st.builds(lambda text: f"<script>var s = '{text}';</script><style>p {{}}</style>", words),
        st.sampled_from(LEAVES),
    )


phrasing = st.recursive(words, inline, max_leaves=6)  # inline elements hold inline elements alone
bodies = st.recursive(phrasing, lambda children: st.one_of(block(children), phrasing), max_leaves=12)
titles = st.one_of(st.just(""), words.map(lambda text: f"<title>{text}</title>"))


def soup_reading(page: str) -> tuple[str, str]:
    """The reading BeautifulSoup gave before lxml replaced it, of the page as HTML reads it (newlines normalized)."""
    title, text = html_text._read_soup(BeautifulSoup(html_text.newlines_normalized(page), "html.parser"))
    return title or next(iter(text.splitlines()), "")[:200], text


@settings(max_examples=300, deadline=None)
@given(title=titles, body=st.lists(bodies, max_size=4))
# Found by this test: a lone CR between two elements, which html.parser kept and libxml2 read as LF.
@example(title="", body=["&lt;<div hidden></div>\r<span></span>&lt;"])
def test_lxml_reads_a_page_as_beautifulsoup_did(title: str, body: list[str]):
    page = f"<!doctype html><html><head>{title}<meta charset='utf-8'></head><body>{''.join(body)}</body></html>"

    assert html_to_text(page.encode("utf-8"), "utf-8") == soup_reading(page), page


def test_a_page_nested_deeper_than_lxml_reads_is_read_by_beautifulsoup_to_its_end():
    # libxml2 stops at its depth limit and keeps what it read: "intro" alone.
    page = "<p>intro</p>" + "<div>" * 3000 + "deep down" + "</div>" * 3000 + "<p>after</p>"

    assert html_to_text(page.encode(), None) == ("intro", "intro\ndeep down\nafter")


def test_a_hidden_page_has_no_text():
    page = b"<html hidden><head><title>Seen in the tab</title></head><body><p>never shown</p></body></html>"

    assert html_to_text(page, "utf-8") == ("Seen in the tab", "")


def test_an_empty_page_has_no_text():
    assert html_to_text(b"", None) == ("", "")
    assert html_to_text(b" \n ", "utf-8") == ("", "")


def test_the_charset_sent_wins_over_the_one_the_page_declares():
    page = '<meta charset="iso-8859-1"><title>caf\u00e9</title><p>na\u00efve</p>'.encode()

    assert html_to_text(page, "utf-8") == ("caf\u00e9", "na\u00efve")


def test_an_xml_declaration_with_an_encoding_is_read():
    page = '<?xml version="1.0" encoding="iso-8859-1"?><html><body><p>na\u00efve</p></body></html>'

    assert html_to_text(page.encode("iso-8859-1"), None) == ("na\u00efve", "na\u00efve")


def test_a_page_beautifulsoup_reads_has_its_newlines_normalized_as_lxml_has():
    fragment = "<p>one<span></span>\r<span></span>two\r\nthree</p>"
    deep = fragment + "<div>" * 3000 + "deep down" + "</div>" * 3000  # past libxml2's depth: BeautifulSoup reads it

    assert html_to_text(fragment.encode(), None)[1] == "one\ntwo\nthree"
    assert html_to_text(deep.encode(), None)[1] == "one\ntwo\nthree\ndeep down"
