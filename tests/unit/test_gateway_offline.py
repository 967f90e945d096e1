"""The offline provider: real text processing on real text, deterministic, no network."""

from __future__ import annotations

import re

import httpx2
import pytest

from tasks.errors import PermanentError
from tasks.gateway.providers import ModelCall, questions
from tasks.gateway.providers.offline import OfflineProvider, markdown_text, plan_subquestions
from tasks.gateway.retry import RetryBudget
from tests.fakes import RecordingSleep

pytestmark = pytest.mark.smoke

QUESTION = "How does asyncio cancellation work and what are the pitfalls?"
TASK_CANCEL = (
    "Request that this task cancel itself.\n\n"
    "This arranges for a CancelledError to be thrown into the wrapped coroutine on the next cycle through "
    "the event loop. The coroutine then has a chance to clean up or even deny the request using "
    "try/except/finally.\n\n"
    "Unlike Future.cancel, this does not guarantee that the task will be cancelled: the exception might be "
    "caught and acted upon, delaying cancellation of the task or preventing cancellation completely."
)
QUEUE_DOC = (
    "Create a queue object with a given maximum size. If maxsize is <= 0, the queue size is infinite. "
    "Items are retrieved in the order they were added to the queue."
)
WAIT_FOR = (
    "Wait for the single Future or coroutine to complete, with timeout. "
    "When a timeout occurs, it cancels the task and raises TimeoutError. "
    "To avoid the task cancellation, wrap it in shield()."
)
# Citations are unescaped [n]; a bracket inside quoted text is escaped as \[.
CITATION = re.compile(r"(?<!\\)\[(\d+)\]")


async def run(purpose: str, payload: dict, provider: OfflineProvider | None = None):
    async with httpx2.AsyncClient() as client:
        return await (provider or OfflineProvider()).run(ModelCall(purpose, payload), client=client,
                                                         budget=RetryBudget(0))


async def test_plan_splits_the_question_into_standalone_subquestions():
    result = await run("plan", {"question": QUESTION, "constraints": "", "max_subquestions": 4})

    subquestions = result.output["subquestions"]
    assert 2 <= len(subquestions) <= 4
    assert subquestions[0] == "How does asyncio cancellation work?"
    assert subquestions[1] == "What are the pitfalls of asyncio cancellation?"
    assert len({s.lower() for s in subquestions}) == len(subquestions)
    assert result.model == "offline-extractive-1"
    assert result.usage["prompt_tokens"] > 0 and result.usage["completion_tokens"] > 0


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_plan_respects_the_maximum(limit):
    subquestions = plan_subquestions(QUESTION, limit)

    assert 1 <= len(subquestions) <= limit


def test_plan_resolves_pronouns_to_the_topic():
    subquestions = plan_subquestions("Why does json.loads fail on NaN, and how do I fix it?", 3)

    assert subquestions[:2] == ["Why does json.loads fail on NaN?", "How do I fix json.loads?"]


def test_a_how_to_keeps_its_intent_and_asks_about_the_documented_name_that_answers_it():
    # The example: the template planner asked "What is context manager using?".
    subquestions = plan_subquestions("how do I write a context manager using a generator function", 3)

    assert subquestions[0] == "How do I write a context manager using a generator function?"
    assert "What does contextlib.contextmanager do?" in subquestions
    assert not any("using?" in s for s in subquestions)


def test_a_comparison_asks_what_each_side_is():
    subquestions = plan_subquestions("What is the difference between threading.Lock and threading.RLock?", 3)

    assert subquestions == ["What is the difference between threading.Lock and threading.RLock?",
                            "What is threading.Lock?", "What is threading.RLock?"]


def test_a_question_with_two_clauses_keeps_both_and_gives_the_second_its_subject():
    subquestions = plan_subquestions(
        "What is the global interpreter lock and how does it affect threads versus multiprocessing?", 3)

    assert subquestions[:2] == ["What is the global interpreter lock?",
                                "How does the global interpreter lock affect threads versus multiprocessing?"]


@pytest.mark.parametrize(("question", "intent"), [
    ("Pickle versus json: which should I use to save Python objects?", "comparison"),
    ("How do I compare two directories?", "how-to"),
    ("What is a descriptor?", "definition"),
    ("Why does a mutable default argument remember values?", "behaviour"),
])
def test_the_planner_reads_the_intent(question, intent):
    assert questions.intent(question) == intent


def test_a_fragment_is_not_a_subquestion_and_which_gets_what_it_chooses_between():
    subquestions = questions.subquestions("Pickle versus json: which should I use to save Python objects?", 3,
                                          known=lambda words: "module")

    assert subquestions == ["Which of Pickle and json should I use to save Python objects?",
                            "What is Pickle?", "What is json?"]


def test_the_planner_asks_what_something_is_only_when_a_page_is_named_so():
    def known(words: str) -> str | None:
        return {"context manager": "term", "generator function": None}.get(words)

    subquestions = questions.subquestions("What is a context manager and a generator function?", 4, known=known)

    assert "What is a context manager?" in subquestions
    assert not any(s.startswith("What is a generator function") for s in subquestions[1:])


async def test_extract_returns_verbatim_sentences_best_first():
    sources = [
        {"source_id": "s1", "title": "asyncio.Task.cancel", "text": TASK_CANCEL},
        {"source_id": "s2", "title": "queue.Queue", "text": QUEUE_DOC},
        {"source_id": "s3", "title": "asyncio.wait_for", "text": WAIT_FOR},
    ]

    result = await run("extract", {"subquestion": "What are the pitfalls of asyncio cancellation?",
                                   "sources": sources, "max_quotes": 3})

    quotes = result.output["quotes"]
    texts = {source["source_id"]: source["text"] for source in sources}
    assert 1 <= len(quotes) <= 3
    assert all(quote["quote"] in texts[quote["source_id"]] for quote in quotes)
    assert all(quote["source_id"] != "s2" for quote in quotes)  # nothing about cancellation there
    assert quotes[0]["quote"].startswith("Unlike Future.cancel, this does not guarantee")
    scores = [quote["score"] for quote in quotes]
    assert scores == sorted(scores, reverse=True)


async def test_extract_finds_nothing_in_unrelated_text():
    sources = [{"source_id": "s2", "title": "queue.Queue", "text": QUEUE_DOC}]

    result = await run("extract", {"subquestion": "How does TLS certificate pinning work?",
                                   "sources": sources, "max_quotes": 3})

    assert result.output == {"quotes": []}


def evidence() -> list[dict]:
    return [
        {"n": 3, "subquestion_index": 0, "title": "asyncio.Task.cancel",
         "quote": "This arranges for a CancelledError to be thrown into the wrapped coroutine."},
        {"n": 7, "subquestion_index": 1, "title": "asyncio.Task.cancel",
         "quote": "Unlike Future.cancel, this does not guarantee that the task will be cancelled."},
        {"n": 9, "subquestion_index": 1, "title": "asyncio.wait_for",
         "quote": "To avoid the task cancellation, wrap it in shield(). See items[0] and note [12]."},
    ]


async def test_the_draft_answers_first_with_cited_sentences_then_a_section_per_subquestion():
    subquestions = ["How does asyncio cancellation work?", "What are the pitfalls of asyncio cancellation?",
                    "How is asyncio cancellation used in practice?"]

    result = await run("draft", {"question": QUESTION, "subquestions": subquestions,
                                 "evidence": evidence(), "scope": "Partial: the tool budget ran out."})

    markdown = result.output["markdown"]
    answer = markdown.split("\n\n", 1)[0]
    assert not answer.startswith("#")
    sentences = re.findall(r"[^.!?]+[.!?] \[\d+\]", answer)
    assert 2 <= len(sentences) <= 4, answer  # each sentence of the answer carries its citation
    # A sentence that leans on its page's name ("This arranges ...") is introduced by it.
    assert answer.startswith("`asyncio.Task.cancel`: This arranges for a CancelledError to be thrown into the "
                             "wrapped coroutine. [3] Unlike Future.cancel,")
    assert {int(n) for n in CITATION.findall(markdown)} == {3, 7, 9}
    for subquestion in subquestions:
        assert f"## {subquestion}" in markdown
    assert "remains an open question" in markdown  # the third has no evidence, and says so
    assert "Partial: the tool budget ran out." in markdown
    assert not re.search(r"^#+\s*(sources|references)", markdown, re.IGNORECASE | re.MULTILINE)


async def test_no_quote_is_used_twice_in_one_report():
    items = [*evidence(), {**evidence()[0], "subquestion_index": 1}, {**evidence()[1], "subquestion_index": 0}]

    markdown = (await run("draft", {"question": QUESTION, "subquestions": ["A?", "B?"], "evidence": items,
                                    "scope": None})).output["markdown"]

    for item in evidence():
        text = markdown_text(item["quote"].rstrip("."))
        assert markdown.count(text) == 1, text


async def test_a_how_to_quote_brings_its_code_example_and_the_report_shows_it_as_code():
    text = ("Use the decorator to define a factory function for with statement context managers.\n\n"
            "    @contextmanager\n    def managed(x):\n        yield x\n\n"
            "The function being decorated must return a generator-iterator when called.")
    sources = [{"source_id": "1", "title": "contextlib.contextmanager", "text": text}]

    quotes = (await run("extract", {"subquestion": "How do I write a context manager with a decorator?",
                                    "sources": sources, "max_quotes": 2})).output["quotes"]
    with_code = [q for q in quotes if q.get("code")]
    assert with_code and with_code[0]["code"] == "@contextmanager\ndef managed(x):\n    yield x"

    evidence_items = [{"n": 1, "subquestion_index": 0, "title": "contextlib.contextmanager", **q} for q in quotes]
    markdown = (await run("draft", {"question": "How?", "subquestions": ["How?"], "evidence": evidence_items,
                                    "scope": None})).output["markdown"]
    assert "```python\n@contextmanager\ndef managed(x):\n    yield x\n```" in markdown


async def test_every_purpose_is_deterministic():
    payloads = {
        "plan": {"question": QUESTION, "constraints": "", "max_subquestions": 5},
        "extract": {"subquestion": "How does cancellation work?", "max_quotes": 4,
                    "sources": [{"source_id": "a", "title": "t", "text": TASK_CANCEL + " " + WAIT_FOR}]},
        "draft": {"question": QUESTION, "subquestions": ["A?", "B?"], "evidence": evidence(), "scope": None},
    }
    for purpose, payload in payloads.items():
        first, second = await run(purpose, payload), await run(purpose, payload)
        assert first == second, purpose


async def test_chat_is_an_empty_answer_for_now():
    result = await run("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": []})

    assert result.output == {"content": "", "tool_calls": []}


async def test_it_waits_the_configured_latency_through_the_injected_sleep():
    sleep = RecordingSleep()

    await run("plan", {"question": QUESTION, "max_subquestions": 2}, OfflineProvider(latency_ms=250, sleep=sleep))

    assert sleep.delays == [0.25]


@pytest.mark.parametrize(("purpose", "payload"), [
    ("plan", {"question": 42, "max_subquestions": 3}),
    ("extract", {"subquestion": "x", "max_quotes": 2, "sources": [{"title": "no id or text"}]}),
    ("draft", {"question": "q", "subquestions": [], "evidence": [{"n": "1", "quote": "q"}]}),
    ("summon", {}),
])
async def test_it_refuses_a_malformed_payload_as_permanent(purpose, payload):
    with pytest.raises(PermanentError):
        await run(purpose, payload)
