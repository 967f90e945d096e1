"""The fallback offline corpus (pydoc's topics and docstrings, where the Python documentation is not
installed): built from what ships with CPython, searched with BM25, read through visit.
The documentation's own corpus is tested in test_python_docs_corpus.py."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path

import httpx2
import pytest
from django.test import override_settings

from tasks.errors import PermanentError
from tasks.gateway import corpus
from tasks.gateway.retry import RetryBudget
from tasks.gateway.tools import ToolCall, run_tool

NO_DOCS = "/nonexistent/python3.11-doc"  # as on a machine without the documentation


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.sqlite3"
    with override_settings(LONGHAUL_DOCS_PATH=NO_DOCS):
        corpus.build(path)
    return path


@pytest.fixture
def offline_corpus(settings, corpus_file) -> Path:
    settings.LONGHAUL_SEARCH_URL = ""
    settings.LONGHAUL_DOCS_PATH = NO_DOCS
    settings.LONGHAUL_CORPUS_PATH = str(corpus_file)
    return corpus_file


async def tool(name: str, **args) -> dict:
    async with httpx2.AsyncClient() as client:
        return await run_tool(ToolCall(name, args), client=client, budget=RetryBudget(0))


async def test_it_finds_several_distinct_documents_on_asyncio_cancellation(offline_corpus):
    results = (await tool("search", query="asyncio cancellation", limit=10))["results"]

    urls = [result["url"] for result in results]
    assert len(set(urls)) == len(urls) >= 3
    for result in results[:3]:
        assert "cancel" in (result["title"] + result["snippet"]).lower()
    assert all(set(result) == {"url", "title", "snippet", "relevance"} for result in results)
    assert results[0]["relevance"] == 1.0 and all(0 < result["relevance"] <= 1 for result in results)


async def test_a_question_reaches_the_documents_that_answer_it(offline_corpus):
    results = (await tool("search", query="How does asyncio cancellation work?", limit=10))["results"]

    urls = [result["url"] for result in results]
    assert "corpus://module/asyncio.Task.cancel" in urls[:5]
    assert sum(url.startswith("corpus://module/asyncio.") for url in urls) >= 6
    assert len({url.rsplit(".", 1)[0] for url in urls}) >= 3  # more than one class or module


async def test_it_finds_the_language_reference_too(offline_corpus):
    results = (await tool("search", query="try finally clause return", limit=10))["results"]

    assert "corpus://topic/try" in [result["url"] for result in results]


async def test_it_returns_an_empty_list_when_nothing_matches(offline_corpus):
    assert (await tool("search", query="xylophonequux zzzqv", limit=5))["results"] == []
    assert (await tool("search", query="how does it work?", limit=5))["results"] == []


async def test_query_syntax_in_a_query_is_just_text(offline_corpus):
    results = (await tool("search", query='asyncio" OR NEAR(cancel* AND -', limit=5))["results"]

    assert results  # no FTS5 syntax error, the words are still searched


@pytest.mark.parametrize("args", [{"query": "", "limit": 5}, {"query": "x", "limit": 0},
                                  {"query": "x", "limit": True}, {"limit": 5}])
async def test_it_refuses_bad_search_arguments(offline_corpus, args):
    with pytest.raises(PermanentError, match="search"):
        await tool("search", **args)


async def test_visit_reads_a_corpus_document(offline_corpus):
    page = await tool("visit", url="corpus://module/asyncio.Task.cancel")

    assert page["title"] == "asyncio.Task.cancel"
    assert "Request that this task cancel itself." in page["text"]
    assert page["final_url"] == page["url"] == "corpus://module/asyncio.Task.cancel"
    assert page["content_hash"] == hashlib.sha256(page["text"].encode()).hexdigest()
    assert page["truncated"] is False
    assert page["content_type"] == "text/plain"
    assert page["origin_url"] == ""  # pydoc's texts have no public page
    assert "pydoc" in page["corpus"]


async def test_visit_reads_a_reference_topic(offline_corpus):
    page = await tool("visit", url="corpus://topic/try")

    assert "finally" in page["text"]
    assert page["title"] == 'The "try" statement'


async def test_visit_refuses_a_corpus_document_that_does_not_exist(offline_corpus):
    with pytest.raises(PermanentError, match="no corpus document"):
        await tool("visit", url="corpus://module/nothing.here")


def read_stamp(path: Path) -> dict[str, str]:
    db = sqlite3.connect(path)
    try:
        return dict(db.execute("SELECT key, value FROM meta").fetchall())
    finally:
        db.close()


def test_it_builds_on_first_use_and_rebuilds_when_the_corpus_version_changes(settings, tmp_path, monkeypatch):
    path = tmp_path / "index" / "corpus.sqlite3"
    settings.LONGHAUL_CORPUS_PATH = str(path)
    settings.LONGHAUL_DOCS_PATH = NO_DOCS
    monkeypatch.setattr(corpus, "_ready", set())

    assert corpus.ensure_index() == path
    first_inode = path.stat().st_ino
    assert read_stamp(path)["corpus_version"] == corpus.CORPUS_VERSION

    monkeypatch.setattr(corpus, "_ready", set())
    corpus.ensure_index()
    assert path.stat().st_ino == first_inode  # current: left alone

    monkeypatch.setattr(corpus, "CORPUS_VERSION", "test-bump")
    monkeypatch.setattr(corpus, "_ready", set())
    corpus.ensure_index()
    assert path.stat().st_ino != first_inode
    assert read_stamp(path)["corpus_version"] == "test-bump"
    assert [p.name for p in path.parent.iterdir()] == ["corpus.sqlite3"]  # no temporary files left


@override_settings(LONGHAUL_DOCS_PATH=NO_DOCS)
def test_concurrent_builds_leave_one_complete_index(tmp_path):
    path = tmp_path / "corpus.sqlite3"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            corpus.build(path)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM documents").fetchone()[0] > 1000
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.sqlite3"]


def test_sentence_spans_are_verbatim_prose():
    text = ("Request that this task cancel itself.  This arranges for a CancelledError, e.g. here, to be thrown.\n"
            "    >>> task.cancel()\n"
            "x = f(a, b)\n"
            "Short one.\n"
            "A final sentence without a full stop but long enough")

    pieces = [text[span.start:span.end] for span in corpus.sentence_spans(text)]

    assert pieces == [
        "Request that this task cancel itself.",
        "This arranges for a CancelledError, e.g. here, to be thrown.",
        "A final sentence without a full stop but long enough",
    ]


def test_it_ranks_sentences_about_the_subject_first():
    texts = [
        "Queues are useful. A task can be cancelled at any await. Cancellation raises CancelledError inside it.",
        "Logging writes records. Handlers format them for output streams.",
    ]

    ranked = corpus.rank_sentences("how does task cancellation work", texts, limit=5)

    quotes = [texts[hit.doc][hit.start:hit.end] for hit in ranked]
    assert quotes[:2] == ["A task can be cancelled at any await.", "Cancellation raises CancelledError inside it."]
    assert all(hit.doc == 0 for hit in ranked)
    assert ranked[0].score >= ranked[1].score > 0
