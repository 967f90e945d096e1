"""Sign-in backoff per username: growing waits instead of a lockout, and the real client behind proxies."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import time_machine
from asgiref.sync import sync_to_async
from django.contrib.auth.backends import ModelBackend
from django.db import connection, transaction
from django.test import AsyncClient, Client
from django.utils import timezone

from project.client_ip import trusted_networks
from project.sign_in_backoff import MEMORY, admit
from tests.integration.test_login_limit import fail, sign_in, signed_in_as
from tests.processes import wait_until

pytestmark = pytest.mark.django_db
WAIT = "Too many failed sign-in attempts for this account"


@pytest.fixture
def clock() -> Iterator[Any]:
    """The time, frozen; tests move it with clock.shift(timedelta)."""
    with time_machine.travel(timezone.now(), tick=False) as traveller:
        yield traveller


def wait_of(response: Any) -> int:
    """The seconds a refused sign-in says to wait, after checking the page and the header agree."""
    assert response.status_code == 429
    seconds = int(response["Retry-After"])
    html = response.content.decode()
    assert WAIT in html
    assert f"Wait {seconds} second{'' if seconds == 1 else 's'}, then try again." in html
    assert 'role="alert"' in html
    return seconds


def test_it_makes_the_username_wait_one_second_after_the_configured_failures(alice, clock, settings):
    assert settings.LONGHAUL_LOGIN_MAX_FAILURES == 5
    browser = Client()
    assert fail(browser, "alice", 4) == [200] * 4
    assert wait_of(sign_in(browser, "alice", "fifth-wrong-password")) == 1


def test_the_wait_doubles_with_each_further_failure(alice, clock):
    browser = Client()
    fail(browser, "alice", 4)
    waits = []
    for _ in range(6):
        waits.append(wait_of(sign_in(browser, "alice", "wrong-password")))
        clock.shift(timedelta(seconds=waits[-1]))
    assert waits == [1, 2, 4, 8, 16, 32]


def test_the_wait_never_exceeds_the_cap_and_the_right_password_then_signs_in(alice, clock, settings):
    assert settings.LONGHAUL_LOGIN_MAX_DELAY_SECONDS == 300
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    fail(attacker, "alice", 4)
    waits = []
    for _ in range(15):
        waits.append(wait_of(sign_in(attacker, "alice", "wrong-password")))
        clock.shift(timedelta(seconds=waits[-1]))
    assert max(waits) == 300
    assert waits[-3:] == [300, 300, 300]

    clock.shift(timedelta(seconds=-1))
    at_home = Client(REMOTE_ADDR="198.51.100.7")
    assert wait_of(sign_in(at_home, "alice", "alice-password-1")) == 1
    clock.shift(timedelta(seconds=1))
    assert sign_in(at_home, "alice", "alice-password-1").status_code == 302
    assert signed_in_as(at_home) == "alice"
    # The sign-in cleared the failures: the next mistakes are free again.
    assert fail(Client(), "alice", 4) == [200] * 4


def test_a_try_during_the_wait_is_refused_without_checking_the_password(alice, clock, monkeypatch):
    browser = Client()
    fail(browser, "alice", 5)
    checks = []
    authenticate = ModelBackend.authenticate

    def counted(self: ModelBackend, *args: Any, **kwargs: Any) -> Any:
        checks.append(kwargs.get("username"))
        return authenticate(self, *args, **kwargs)

    monkeypatch.setattr(ModelBackend, "authenticate", counted)

    assert wait_of(sign_in(browser, "alice", "alice-password-1")) == 1
    assert checks == []
    assert signed_in_as(browser) is None


def test_tries_during_the_wait_neither_count_nor_lengthen_it(alice, clock):
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    fail(attacker, "alice", 6)  # the sixth came during the first wait
    clock.shift(timedelta(milliseconds=500))
    assert [wait_of(sign_in(attacker, "alice", "wrong-password")) for _ in range(20)] == [1] * 20

    clock.shift(timedelta(milliseconds=500))
    # Five failures counted, not 26: this one is the sixth, and waits two seconds.
    assert wait_of(sign_in(attacker, "alice", "wrong-password")) == 2
    clock.shift(timedelta(seconds=2))
    assert sign_in(Client(), "alice", "alice-password-1").status_code == 302


def test_failures_are_forgotten_a_day_after_the_last_wait_ended(alice, clock):
    browser = Client()
    fail(browser, "alice", 8)
    last_wait = wait_of(sign_in(browser, "alice", "wrong-password"))
    clock.shift(timedelta(seconds=last_wait) + MEMORY + timedelta(seconds=1))
    assert fail(browser, "alice", 4) == [200] * 4


def test_the_wait_is_told_in_the_readers_language(alice, clock):
    browser = Client(HTTP_ACCEPT_LANGUAGE="zh-CN,zh;q=0.9")
    fail(browser, "alice", 4)
    response = sign_in(browser, "alice", "wrong-password")
    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    assert "此账号登录失败次数过多。请等待 1 秒后再试。" in response.content.decode()


@pytest.mark.django_db(transaction=True)
async def test_the_wait_page_is_the_same_under_asgi_as_daphne_serves_it(alice):
    # axes' async middleware calls the lockout view with other arguments than its sync one.
    browser = AsyncClient(REMOTE_ADDR="203.0.113.9")
    try:
        with time_machine.travel(timezone.now(), tick=False):
            for _ in range(4):
                assert (await browser.post("/accounts/login/", {"username": "alice", "password": "x"})).status_code == 200
            assert wait_of(await browser.post("/accounts/login/", {"username": "alice", "password": "x"})) == 1
    finally:
        # The views ran on asgiref's thread; its persistent connection would outlive the test database.
        await sync_to_async(lambda: connection.close())()  # the lambda: look the connection up on that thread


def failure_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "project.sign_in_backoff"]


def test_behind_a_trusted_proxy_the_client_is_the_right_most_untrusted_address(alice, settings, caplog):
    settings.LONGHAUL_TRUSTED_PROXIES = trusted_networks("LONGHAUL_TRUSTED_PROXIES", ["10.0.0.0/8"])
    # The client wrote 6.6.6.6 itself; the balancer (10.0.0.2) appended the address it saw.
    behind_balancer = Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="6.6.6.6, 198.51.100.7")
    with caplog.at_level(logging.WARNING, logger="project.sign_in_backoff"):
        fail(behind_balancer, "alice", 1)
    assert failure_log(caplog) == ["sign-in failed for 'alice' from 198.51.100.7; next check allowed in 0 s"]


def test_x_forwarded_for_is_ignored_when_the_peer_is_not_a_trusted_proxy(alice, settings, caplog):
    settings.LONGHAUL_TRUSTED_PROXIES = trusted_networks("LONGHAUL_TRUSTED_PROXIES", ["10.0.0.0/8"])
    direct = Client(REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR="198.51.100.7")
    with caplog.at_level(logging.WARNING, logger="project.sign_in_backoff"):
        fail(direct, "alice", 1)
    assert failure_log(caplog) == ["sign-in failed for 'alice' from 203.0.113.9; next check allowed in 0 s"]


def waiting_on_a_row_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND datname = current_database()")
        return cursor.fetchone()[0] > 0


@pytest.mark.django_db(transaction=True)
def test_two_tries_at_the_moment_the_wait_ends_let_only_one_through(alice, clock):
    if connection.vendor != "postgresql":
        pytest.skip("needs a second connection that waits on a row lock")
    fail(Client(), "alice", 5)
    clock.shift(timedelta(seconds=1))
    now = timezone.now()
    admitted, holding, release = [], threading.Event(), threading.Event()

    def first() -> None:
        try:
            with transaction.atomic():
                admitted.append(("first", admit("alice", now)))
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    def second() -> None:
        try:
            admitted.append(("second", admit("alice", now)))
        finally:
            connection.close()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert holding.wait(30)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    wait_until(waiting_on_a_row_lock, timeout=30)
    release.set()
    for thread in threads:
        thread.join(30)
    # The first was let through (counted as the sixth failure until it succeeds); the second waits for it.
    assert admitted == [("first", 0), ("second", 2)]
