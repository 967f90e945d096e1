"""Sign-in rate limiting (django-axes): failures per username and IP lock that pair out for a while."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

pytestmark = pytest.mark.django_db
LOCKED = "Too many failed sign-in attempts"


def sign_in(client: Client, username: str, password: str, path: str = "/accounts/login/") -> Any:
    return client.post(path, {"username": username, "password": password})


def signed_in_as(client: Client) -> str | None:
    response = client.get("/api/me")
    return response.json()["username"] if response.status_code == 200 else None


def fail(client: Client, username: str, times: int) -> list[int]:
    return [sign_in(client, username, "wrong-password").status_code for _ in range(times)]


def assert_locked_out(response: Any, minutes: int = 15) -> None:
    assert response.status_code == 429
    html = response.content.decode()
    assert LOCKED in html
    assert f"try again in {minutes} minutes" in html
    assert 'role="alert"' in html
    assert int(response["Retry-After"]) == minutes * 60


def test_it_locks_a_username_out_after_the_configured_number_of_failures(alice, settings):
    assert settings.LONGHAUL_LOGIN_MAX_FAILURES == 5
    browser = Client()
    assert fail(browser, "alice", 4) == [200] * 4
    assert_locked_out(sign_in(browser, "alice", "fifth-wrong-password"))


def test_failures_below_the_limit_say_the_password_is_wrong_not_locked(alice):
    browser = Client()
    response = sign_in(browser, "alice", "wrong-password")
    assert response.status_code == 200
    assert "don't match" in response.content.decode()
    assert LOCKED not in response.content.decode()


def test_the_right_password_is_refused_while_locked_out(alice):
    browser = Client()
    fail(browser, "alice", 5)
    assert_locked_out(sign_in(browser, "alice", "alice-password-1"))
    assert signed_in_as(browser) is None


def test_another_user_and_the_same_user_elsewhere_are_unaffected(alice, bob):
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    fail(attacker, "alice", 5)
    assert_locked_out(sign_in(attacker, "alice", "alice-password-1"))

    colleague = Client(REMOTE_ADDR="203.0.113.9")
    assert sign_in(colleague, "bob", "bob-password-1").status_code == 302
    assert signed_in_as(colleague) == "bob"

    at_home = Client(REMOTE_ADDR="198.51.100.7")
    assert sign_in(at_home, "alice", "alice-password-1").status_code == 302
    assert signed_in_as(at_home) == "alice"


def test_the_lockout_ends_after_the_period(alice, settings):
    browser = Client()
    fail(browser, "alice", 5)
    period = timedelta(seconds=settings.LONGHAUL_LOGIN_LOCKOUT_SECONDS)
    with time_machine.travel(timezone.now() + period - timedelta(seconds=30), tick=False):
        assert_locked_out(sign_in(browser, "alice", "alice-password-1"))
    with time_machine.travel(timezone.now() + period + timedelta(seconds=1), tick=False):
        assert sign_in(browser, "alice", "alice-password-1").status_code == 302
        assert signed_in_as(browser) == "alice"


def test_a_successful_sign_in_clears_the_failures(alice):
    browser = Client()
    fail(browser, "alice", 4)
    assert sign_in(browser, "alice", "alice-password-1").status_code == 302
    browser.logout()
    assert fail(browser, "alice", 4) == [200] * 4


def test_the_limit_and_period_come_from_settings(alice, settings):
    settings.AXES_FAILURE_LIMIT = 2
    settings.AXES_COOLOFF_TIME = timedelta(minutes=1)
    settings.LONGHAUL_LOGIN_LOCKOUT_SECONDS = 60
    browser = Client()
    assert fail(browser, "alice", 1) == [200]
    response = sign_in(browser, "alice", "wrong-password")
    assert response.status_code == 429
    assert "try again in 1 minute." in response.content.decode()


def test_the_admin_sign_in_is_limited_too(alice):
    alice.is_staff = True
    alice.save()
    browser = Client()
    fail_codes = [sign_in(browser, "alice", "wrong", path="/admin/login/").status_code for _ in range(5)]
    assert fail_codes[:4] == [200] * 4
    assert_locked_out(sign_in(browser, "alice", "alice-password-1", path="/admin/login/"))
    assert signed_in_as(browser) is None
