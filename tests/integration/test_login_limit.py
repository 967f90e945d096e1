"""Sign-in limiting (project/sign_in_backoff.py): failures per username make its next check wait, never lock."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

pytestmark = pytest.mark.django_db
LOCKED = "Too many failed sign-in attempts for this account"


def sign_in(client: Client, username: str, password: str, path: str = "/accounts/login/") -> Any:
    return client.post(path, {"username": username, "password": password})


def signed_in_as(client: Client) -> str | None:
    response = client.get("/api/me")
    return response.json()["username"] if response.status_code == 200 else None


def fail(client: Client, username: str, times: int) -> list[int]:
    return [sign_in(client, username, "wrong-password").status_code for _ in range(times)]


def assert_waiting(response: Any, seconds: int = 1) -> None:
    assert response.status_code == 429
    html = response.content.decode()
    assert LOCKED in html
    assert f"Wait {seconds} second{'' if seconds == 1 else 's'}, then try again." in html
    assert 'role="alert"' in html
    assert int(response["Retry-After"]) == seconds


def test_it_makes_a_username_wait_after_the_configured_number_of_failures(alice, settings):
    assert settings.LONGHAUL_LOGIN_MAX_FAILURES == 5
    browser = Client()
    assert fail(browser, "alice", 4) == [200] * 4
    with time_machine.travel(timezone.now(), tick=False):
        assert_waiting(sign_in(browser, "alice", "fifth-wrong-password"))


def test_failures_below_the_limit_say_the_password_is_wrong_not_locked(alice):
    browser = Client()
    response = sign_in(browser, "alice", "wrong-password")
    assert response.status_code == 200
    assert "don't match" in response.content.decode()
    assert LOCKED not in response.content.decode()


def test_the_right_password_is_refused_during_the_wait(alice):
    browser = Client()
    with time_machine.travel(timezone.now(), tick=False):
        fail(browser, "alice", 5)
        assert_waiting(sign_in(browser, "alice", "alice-password-1"))
        assert signed_in_as(browser) is None


def test_another_user_is_unaffected_and_the_same_user_elsewhere_only_waits(alice, bob):
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    with time_machine.travel(timezone.now(), tick=False) as clock:
        fail(attacker, "alice", 5)
        assert_waiting(sign_in(attacker, "alice", "alice-password-1"))

        colleague = Client(REMOTE_ADDR="203.0.113.9")
        assert sign_in(colleague, "bob", "bob-password-1").status_code == 302
        assert signed_in_as(colleague) == "bob"

        # The backoff is per username, from any address (the accepted trade-off): a wait, never a lockout.
        at_home = Client(REMOTE_ADDR="198.51.100.7")
        assert_waiting(sign_in(at_home, "alice", "alice-password-1"))
        clock.shift(timedelta(seconds=1))
        assert sign_in(at_home, "alice", "alice-password-1").status_code == 302
        assert signed_in_as(at_home) == "alice"


def test_the_wait_ends_after_its_delay(alice):
    browser = Client()
    with time_machine.travel(timezone.now(), tick=False) as clock:
        fail(browser, "alice", 7)  # the sixth and seventh fall in the first wait, uncounted
        clock.shift(timedelta(seconds=1))
        fail(browser, "alice", 1)  # the sixth failure: two seconds
        clock.shift(timedelta(seconds=1))
        assert_waiting(sign_in(browser, "alice", "alice-password-1"), seconds=1)
        clock.shift(timedelta(seconds=1))
        assert sign_in(browser, "alice", "alice-password-1").status_code == 302
        assert signed_in_as(browser) == "alice"


def test_a_successful_sign_in_clears_the_failures(alice):
    browser = Client()
    fail(browser, "alice", 4)
    assert sign_in(browser, "alice", "alice-password-1").status_code == 302
    browser.logout()
    assert fail(browser, "alice", 4) == [200] * 4


def test_the_limit_and_the_longest_wait_come_from_settings(alice, settings):
    settings.LONGHAUL_LOGIN_MAX_FAILURES = 2
    settings.LONGHAUL_LOGIN_MAX_DELAY_SECONDS = 3
    browser = Client()
    with time_machine.travel(timezone.now(), tick=False) as clock:
        assert fail(browser, "alice", 1) == [200]
        waits = []
        for _ in range(4):
            response = sign_in(browser, "alice", "wrong-password")
            waits.append(int(response["Retry-After"]))
            clock.shift(timedelta(seconds=waits[-1]))
        assert waits == [1, 2, 3, 3]
        assert "Wait 3 seconds, then try again." in response.content.decode()


def test_the_admin_sign_in_is_limited_too(alice):
    alice.is_staff = True
    alice.save()
    browser = Client()
    with time_machine.travel(timezone.now(), tick=False):
        fail_codes = [sign_in(browser, "alice", "wrong", path="/admin/login/").status_code for _ in range(5)]
        assert fail_codes == [200] * 4 + [429]
        assert_waiting(sign_in(browser, "alice", "alice-password-1", path="/admin/login/"))
        assert signed_in_as(browser) is None
