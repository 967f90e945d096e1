"""The pages in English and Simplified Chinese: the browser's language, the switch, and the assistant's words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from chat.models import LanguagePreference, Message, Thread
from tasks import jobs
from tasks.models import Task
from tests.factories import submit_sleep
from tests.integration.chatting import run_queued

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]

CHINESE = "zh-CN,zh;q=0.9,en;q=0.5"
ENGLISH = "en-US,en;q=0.9"


@pytest.fixture(autouse=True, scope="module")
def _compiled_catalogs() -> None:
    """The Chinese pages need the compiled catalogs, which `make test` builds (.mo files are not committed)."""
    for domain in ("django", "djangojs"):
        po = ROOT / "locale" / "zh_Hans" / "LC_MESSAGES" / f"{domain}.po"
        mo = po.with_suffix(".mo")
        if not mo.exists() or mo.stat().st_mtime < po.stat().st_mtime:
            pytest.fail(f"{mo.relative_to(ROOT)} is missing or stale: run `make test`, or bin/ensure-gettext and "
                        "`.venv/bin/python manage.py compilemessages --ignore='.*' --ignore=var`")


def browser(accept_language: str) -> Client:
    return Client(HTTP_ACCEPT_LANGUAGE=accept_language)


def signed_in(user, accept_language: str = ENGLISH) -> Client:
    client = browser(accept_language)
    client.force_login(user)
    return client


def choose(client: Client, language: str, next_url: str = "/") -> None:
    response = client.post("/accounts/language/", {"language": language, "next": next_url})
    assert response.status_code == 302
    assert response["Location"] == next_url


def test_it_shows_the_sign_in_page_in_the_browsers_language(db):
    chinese = browser(CHINESE).get("/accounts/login/")
    assert '<html lang="zh-hans">' in chinese.text
    assert "登录你的工作区" in chinese.text
    assert "Sign in to your workspace" not in chinese.text
    assert chinese["Content-Language"] == "zh-hans"
    english = browser(ENGLISH).get("/accounts/login/")
    assert '<html lang="en">' in english.text
    assert "Sign in to your workspace" in english.text
    french = browser("fr-FR,fr;q=0.9").get("/accounts/login/")
    assert "Sign in to your workspace" in french.text, "a language Longhaul lacks falls back to English"


def test_it_shows_the_chat_page_in_the_browsers_language_and_remembers_it_for_the_assistant(alice):
    page = signed_in(alice, CHINESE).get("/")
    assert "后台任务" in page.text and "新对话" in page.text
    assert "Background tasks" not in page.text
    preference = LanguagePreference.objects.get(user=alice)
    assert (preference.chosen, preference.last_shown) == ("", "zh-hans")
    signed_in(alice, ENGLISH).get("/")
    assert LanguagePreference.objects.get(user=alice).last_shown == "en", "nothing chosen: the browser leads"


def test_the_switch_remembers_a_signed_in_persons_choice_in_every_browser(alice):
    laptop = signed_in(alice, ENGLISH)
    assert "Background tasks" in laptop.get("/").text
    choose(laptop, "zh-hans")
    assert LanguagePreference.objects.get(user=alice).chosen == "zh-hans"
    assert "后台任务" in laptop.get("/").text

    phone = signed_in(alice, ENGLISH)  # another browser, which asks for English
    page = phone.get("/")
    assert "后台任务" in page.text
    assert page.cookies[settings.LANGUAGE_COOKIE_NAME].value == "zh-hans", "signed out, the page stays Chinese"

    choose(phone, "en")
    assert "Background tasks" in laptop.get("/").text


def test_the_switch_works_signed_out_and_refuses_a_language_longhaul_lacks(alice):
    visitor = browser(ENGLISH)
    choose(visitor, "zh-hans", "/accounts/login/")
    assert "登录你的工作区" in visitor.get("/accounts/login/").text
    assert not LanguagePreference.objects.exists()

    client = signed_in(alice)
    client.post("/accounts/language/", {"language": "klingon", "next": "/"})
    assert not LanguagePreference.objects.filter(chosen="klingon").exists()
    assert "Background tasks" in client.get("/").text


def test_the_header_offers_the_other_language_in_its_own_words(alice):
    english = signed_in(alice).get("/").text
    assert 'name="language" value="zh-hans" lang="zh-hans"' in english
    assert "简体中文" in english
    chinese = signed_in(alice, CHINESE).get("/").text
    assert 'name="language" value="en" lang="en"' in chinese
    assert "English" in chinese


def test_the_script_catalog_follows_the_pages_language(alice):
    needs_your_answer = json.dumps("需要你的回答")  # the catalog writes JSON, with \u escapes
    chinese = signed_in(alice, CHINESE).get("/jsi18n/")
    assert chinese.status_code == 200
    assert f'"Needs your answer": {needs_your_answer}' in chinese.content.decode()
    english = signed_in(alice, ENGLISH).get("/jsi18n/")
    assert needs_your_answer not in english.content.decode()


def test_the_assistant_answers_in_its_readers_language_but_never_translates_their_words(alice_api, alice):
    LanguagePreference.objects.create(user=alice, chosen="zh-hans")
    thread_id = alice_api.post("/api/threads", {"title": "异步"}, format="json").json()["id"]
    alice_api.post(f"/api/threads/{thread_id}/messages", {"content": "research how asyncio cancellation works"},
                   format="json")
    run_queued()
    reply = Message.objects.filter(thread__public_id=thread_id, role="assistant").last().content
    assert reply.startswith("我正在后台研究“how asyncio cancellation works”")
    task = Task.objects.get()
    assert task.name == "研究 · how asyncio cancellation works"
    assert task.input["question"] == "how asyncio cancellation works", "the question is the user's own words"

    alice_api.post(f"/api/threads/{thread_id}/messages", {"content": "what is running?"}, format="json")
    run_queued()
    listing = Message.objects.filter(thread__public_id=thread_id, role="assistant").last().content
    assert listing.startswith("正在运行：")
    assert "研究 · how asyncio cancellation works" in listing


def test_a_notification_is_told_in_the_owners_language(acme, alice, settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    LanguagePreference.objects.create(user=alice, last_shown="zh-hans")  # Chinese pages, nothing chosen
    thread = Thread.objects.create(tenant=acme, owner=alice, title="work")
    task = submit_sleep(acme, alice, steps=2, ask_at_step=1, question="Which mirror, EU or US?", thread_id=thread.pk)
    for _ in range(5):
        jobs.advance(task.pk)
    run_queued()
    [message] = Message.objects.filter(thread=thread, role="assistant").values_list("content", flat=True)
    assert f"**{task.name}** 需要你的回答：Which mirror, EU or US?" in message
    assert "answer " in message, "the command to type stays the one the assistant understands"
