"""Request throttling: per-user and per-tenant limits on submissions, answers, messages and new threads.

A refused request answers 429 `throttled` in the one error shape, naming the limit and when to retry,
with Retry-After, and writes nothing. Reads are never throttled. Rates come from the environment.
Each test counts from zero: tests/conftest.py gives every test a cache of its own.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
import redis
import time_machine
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

from chat.models import Message, Run, Thread
from project.env import envrate, parse_rate
from tasks import clock, jobs
from tasks.models import Task, TaskEvent
from tasks.statuses import TaskStatus
from tests.conftest import api_client_for
from tests.factories import submit_sleep

pytestmark = pytest.mark.django_db

ACTIONS = ("SUBMIT", "ANSWER", "MESSAGE", "THREAD")
SLEEP = {"kind": "sleep", "name": "nap", "input": {"steps": 2}}
TEST_REDIS_URL = os.environ.get("LONGHAUL_TEST_REDIS_URL", "redis://127.0.0.1:6379/5")


@pytest.fixture
def limits(settings):
    """Set rates: limits(SUBMIT_USER=(2, 60)); every other one stays at its default."""
    def set_rates(**rates: tuple[int, int] | None) -> None:
        for name, rate in rates.items():
            setattr(settings, f"LONGHAUL_THROTTLE_{name}", rate)
    return set_rates


@pytest.fixture
def bob_api(bob):
    return api_client_for(bob)


def submit(client, key: str | None = None):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return client.post("/api/tasks", SLEEP, format="json", **headers)


def assert_throttled(response, message: str, retry_after: int) -> None:
    assert response.status_code == 429, response.content
    assert response.json() == {"error": message, "code": "throttled"}
    assert response["Retry-After"] == str(retry_after)


def waiting_task(acme, alice) -> Task:
    task = submit_sleep(acme, alice, steps=2, ask_at_step=1, question="Which colour?")
    jobs.advance(task.pk)
    task.refresh_from_db()
    assert task.status == TaskStatus.WAITING_INPUT
    return task


# --- task submissions -------------------------------------------------------------

def test_it_refuses_a_user_over_the_submit_limit_and_writes_nothing(alice_api, limits):
    limits(SUBMIT_USER=(2, 60))
    assert submit(alice_api).status_code == 201
    assert submit(alice_api).status_code == 201
    refused = submit(alice_api, key="third")
    assert_throttled(refused, "at most 2 task submissions a minute per user; try again in 60 seconds", 60)
    assert Task.objects.count() == 2


def test_the_tenant_limit_counts_every_user_of_the_tenant_and_no_other_tenant(alice_api, bob_api, charlie_api,
                                                                              limits):
    limits(SUBMIT_TENANT=(2, 3600))
    assert submit(alice_api).status_code == 201
    assert submit(bob_api).status_code == 201
    refused = submit(bob_api)
    assert_throttled(refused, "at most 2 task submissions an hour per tenant; try again in 3600 seconds", 3600)
    assert submit(charlie_api).status_code == 201, "globex has an allowance of its own"
    assert Task.objects.count() == 3


def test_a_refused_request_counts_against_no_limit(alice_api, bob_api, limits):
    limits(SUBMIT_USER=(1, 60), SUBMIT_TENANT=(2, 60))
    assert submit(alice_api).status_code == 201
    for _ in range(5):
        assert submit(alice_api).status_code == 429
    assert submit(bob_api).status_code == 201, "alice's refused tries spent none of acme's allowance"


def test_it_lets_requests_through_again_as_the_window_moves_on(alice_api, limits):
    limits(SUBMIT_USER=(2, 60))
    start = clock.now()
    with time_machine.travel(start, tick=False) as traveller:
        assert submit(alice_api).status_code == 201
        traveller.move_to(start + timedelta(seconds=20))
        assert submit(alice_api).status_code == 201
        traveller.move_to(start + timedelta(seconds=30.4))
        # Room comes when the first of the two leaves the window, at 60 s: 29.6 s away, said as 30.
        assert_throttled(submit(alice_api), "at most 2 task submissions a minute per user; try again in 30 seconds",
                         30)
        traveller.move_to(start + timedelta(seconds=59.9))
        assert_throttled(submit(alice_api), "at most 2 task submissions a minute per user; try again in 1 second",
                         1)
        traveller.move_to(start + timedelta(seconds=60.1))
        assert submit(alice_api).status_code == 201
        assert submit(alice_api).status_code == 429, "the one at 20 s still counts"
    assert Task.objects.count() == 3


def test_a_replayed_submission_is_throttled_like_a_new_one(alice_api, limits):
    limits(SUBMIT_USER=(1, 60))
    assert submit(alice_api, key="same").status_code == 201
    assert submit(alice_api, key="same").status_code == 429


def test_an_off_rate_never_refuses(alice_api, limits):
    limits(SUBMIT_USER=None, SUBMIT_TENANT=None)
    for _ in range(5):
        assert submit(alice_api).status_code == 201


# --- answers, messages, threads -----------------------------------------------------

def test_it_refuses_too_many_answers_and_leaves_the_task_waiting(alice_api, acme, alice, settings, limits):
    settings.LONGHAUL_STEP_SLICE_MS = 0
    limits(ANSWER_USER=(1, 60))
    first, second = waiting_task(acme, alice), waiting_task(acme, alice)
    assert alice_api.post(f"/api/tasks/{first.public_id}/answer", {"answer": "blue"}, format="json").status_code == 202
    events_before = TaskEvent.objects.filter(task=second).count()
    refused = alice_api.post(f"/api/tasks/{second.public_id}/answer", {"answer": "red"}, format="json")
    assert_throttled(refused, "at most 1 answer a minute per user; try again in 60 seconds", 60)
    second.refresh_from_db()
    assert second.status == TaskStatus.WAITING_INPUT
    assert TaskEvent.objects.filter(task=second).count() == events_before


def test_it_refuses_too_many_new_threads_and_creates_none(alice_api, bob_api, limits):
    limits(THREAD_TENANT=(2, 60))
    assert alice_api.post("/api/threads", {"title": "one"}, format="json").status_code == 201
    assert bob_api.post("/api/threads", {"title": "two"}, format="json").status_code == 201
    refused = alice_api.post("/api/threads", {"title": "three"}, format="json")
    assert_throttled(refused, "at most 2 new threads a minute per tenant; try again in 60 seconds", 60)
    assert sorted(Thread.objects.values_list("title", flat=True)) == ["one", "two"]


def test_it_refuses_too_many_messages_and_posts_none(alice_api, acme, alice, limits):
    limits(MESSAGE_USER=(1, 60))
    first, second = (Thread.objects.create(tenant=acme, owner=alice, title=t) for t in ("a", "b"))
    assert alice_api.post(f"/api/threads/{first.public_id}/messages", {"content": "hello"},
                          format="json").status_code == 202
    refused = alice_api.post(f"/api/threads/{second.public_id}/messages", {"content": "hello again"}, format="json")
    assert_throttled(refused, "at most 1 message a minute per user; try again in 60 seconds", 60)
    assert not Message.objects.filter(thread=second).exists()
    assert not Run.objects.filter(thread=second).exists()


def test_the_chat_pages_session_is_throttled_like_a_token(acme, alice, limits):
    """The page posts through the same API with the session cookie (static/js/api.js)."""
    limits(MESSAGE_USER=(1, 60))
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    browser = Client()
    browser.force_login(alice)
    url = f"/api/threads/{thread.public_id}/messages"
    assert browser.post(url, {"content": "hello"}, content_type="application/json").status_code == 202
    refused = browser.post(url, {"content": "hello again"}, content_type="application/json")
    assert_throttled(refused, "at most 1 message a minute per user; try again in 60 seconds", 60)
    assert [m.content for m in Message.objects.filter(thread=thread)].count("hello again") == 0


def test_reads_are_not_throttled(alice_api, acme, alice, limits):
    limits(**{f"{action}_{per}": (1, 60) for action in ACTIONS for per in ("USER", "TENANT")})
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    task = submit_sleep(acme, alice)
    for _ in range(3):
        for path in ("/api/tasks", f"/api/tasks/{task.public_id}", "/api/threads",
                     f"/api/threads/{thread.public_id}/messages", f"/api/threads/{thread.public_id}/tasks"):
            assert alice_api.get(path).status_code == 200, path


# --- the cache ----------------------------------------------------------------------

def test_it_counts_in_redis_when_redis_is_the_cache(alice_api, settings, limits):
    try:
        redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis does not answer at {TEST_REDIS_URL} ({exc})")
    prefix = f"longhaul-test-{uuid.uuid4()}"
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": TEST_REDIS_URL, "KEY_PREFIX": prefix}}
    limits(SUBMIT_USER=(1, 60))
    try:
        assert submit(alice_api).status_code == 201
        assert submit(alice_api).status_code == 429
        keys = redis.Redis.from_url(TEST_REDIS_URL).keys(f"{prefix}:*")
        assert len(keys) == 2, "one count for alice, one for acme"
    finally:
        connection = redis.Redis.from_url(TEST_REDIS_URL)
        for key in connection.keys(f"{prefix}:*"):
            connection.delete(key)


def test_writes_go_on_unthrottled_while_the_cache_is_unreachable(alice_api, settings, limits, caplog):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": "redis://127.0.0.1:1/0",
                                   "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1}}}
    limits(SUBMIT_USER=(1, 60))
    with caplog.at_level(logging.WARNING, logger="project.throttles"):
        assert submit(alice_api).status_code == 201
        assert submit(alice_api).status_code == 201
    assert "throttle submit not checked" in caplog.text


# --- settings -----------------------------------------------------------------------

@pytest.mark.parametrize(("text", "rate"), [
    ("60/min", (60, 60)), ("5/s", (5, 1)), (" 2 / hour ", (2, 3600)), ("1/day", (1, 86400)),
    ("10/SEC", (10, 1)), ("3/m", (3, 60)), ("off", None), ("OFF", None),
])
def test_a_rate_is_parsed_as_requests_and_seconds(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["", "60", "0/min", "-1/min", "60/fortnight", "60/min/s", "1.5/min", "٣/min",
                                  "lots", "/min"])
def test_a_bad_rate_is_refused(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_a_bad_rate_setting_names_its_variable(monkeypatch):
    monkeypatch.setenv("LONGHAUL_THROTTLE_SUBMIT_USER", "lots")
    with pytest.raises(ImproperlyConfigured, match="LONGHAUL_THROTTLE_SUBMIT_USER"):
        envrate("LONGHAUL_THROTTLE_SUBMIT_USER", "60/min")
    monkeypatch.setenv("LONGHAUL_THROTTLE_SUBMIT_USER", "")
    assert envrate("LONGHAUL_THROTTLE_SUBMIT_USER", "60/min") == (60, 60)


def test_every_default_lets_a_tenant_do_more_than_one_user(settings):
    for action in ACTIONS:
        user, tenant = (getattr(settings, f"LONGHAUL_THROTTLE_{action}_{per}") for per in ("USER", "TENANT"))
        assert user is not None and tenant is not None, action
        assert user[1] == tenant[1] and tenant[0] > user[0], action


def settings_in_a_new_process(**env: str) -> subprocess.CompletedProcess:
    code = "from django.conf import settings; print(settings.CACHES['default']['BACKEND'])"
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=False,
                          timeout=60)


def test_a_bad_rate_stops_the_process_at_start_naming_the_variable():
    started = settings_in_a_new_process(LONGHAUL_THROTTLE_MESSAGE_TENANT="fast")
    assert started.returncode != 0
    assert "LONGHAUL_THROTTLE_MESSAGE_TENANT must be a rate such as 60/min" in started.stderr


def test_the_counts_are_shared_through_redis_when_there_is_one_and_kept_in_memory_otherwise():
    with_redis = settings_in_a_new_process(REDIS_URL="redis://127.0.0.1:6379/0")
    assert with_redis.stdout.strip() == "django.core.cache.backends.redis.RedisCache", with_redis.stderr
    alone = settings_in_a_new_process(REDIS_URL="")
    assert alone.stdout.strip() == "django.core.cache.backends.locmem.LocMemCache", alone.stderr
