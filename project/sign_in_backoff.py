"""Sign-in backoff per username: after a few failures each further try waits longer; never a lockout.

A django-axes handler (AXES_HANDLER). Axes' backend asks it before any password is checked, on the sign-in
page and the admin's alike, and axes' middleware turns a refusal into project.views.sign_in_locked_out.

An attempt is counted when it is let through, before its password is checked, and a successful sign-in
clears the count. Counting first makes the limit hold under parallel requests: one conditional UPDATE
lets a single attempt through per delay, however many arrive at once. A refused attempt is neither
checked nor counted, so hammering during a delay does not lengthen it. The state is one row per username
in the database, shared by every web process.
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta
from typing import Any

from axes.handlers.base import AxesHandler
from axes.helpers import get_client_username
from django.conf import settings
from django.db.models import Case, DateTimeField, F, Value, When
from django.http import HttpRequest

from tasks.models import SignInBackoff

log = logging.getLogger(__name__)

# Failures are forgotten this long after a username's last wait ended, so an old streak of typos does not
# make today's first mistake wait minutes. Far above the longest delay, so the doubling is never cut short.
MEMORY = timedelta(days=1)
USERNAME_LENGTH = SignInBackoff._meta.get_field("username").max_length


def delay_seconds(failures: int, *, free: int, cap: int) -> int:
    """The wait after a username's `failures`-th failure: none before `free`, then 1 s doubling up to `cap`."""
    if failures < free:
        return 0
    return min(cap, 2 ** min(failures - free, cap.bit_length()))


def admit(username: str, now: datetime) -> int:
    """Count an attempt for `username` and let it through (0), or the whole seconds it must still wait."""
    free, cap = settings.LONGHAUL_LOGIN_MAX_FAILURES, settings.LONGHAUL_LOGIN_MAX_DELAY_SECONDS
    forget_quiet_usernames(now)
    for _ in range(2):  # twice: a sign-in may delete the row between our statements
        SignInBackoff.objects.bulk_create([SignInBackoff(username=username, retry_at=now)], ignore_conflicts=True)
        admitted = SignInBackoff.objects.filter(username=username, retry_at__lte=now).update(
            failures=F("failures") + 1, retry_at=_retry_at_if_this_fails(now, free=free, cap=cap))
        if admitted:
            return 0
        retry_at = SignInBackoff.objects.filter(username=username).values_list("retry_at", flat=True).first()
        if retry_at is not None:
            return _whole_seconds(retry_at - now)
    return 1  # lost to a sign-in twice over: a second's wait is the honest answer


def wait_seconds(username: str, now: datetime) -> int:
    """Whole seconds before `username`'s password may be checked again; 0 when it may be now."""
    retry_at = SignInBackoff.objects.filter(username=username).values_list("retry_at", flat=True).first()
    return _whole_seconds(retry_at - now) if retry_at is not None and retry_at > now else 0


def forget(username: str) -> None:
    SignInBackoff.objects.filter(username=username).delete()


def forget_quiet_usernames(now: datetime) -> None:
    """Drop rows whose wait ended MEMORY ago; usernames an attacker made up would otherwise stay for good."""
    SignInBackoff.objects.filter(retry_at__lt=now - MEMORY).delete()


def _retry_at_if_this_fails(now: datetime, *, free: int, cap: int) -> Case:
    """retry_at for the attempt being counted, chosen by the failures before it (an UPDATE sees old values)."""
    at = [When(failures__lt=free - 1, then=Value(now))]
    failures = free
    while (delay := delay_seconds(failures, free=free, cap=cap)) < cap:
        at.append(When(failures=failures - 1, then=Value(now + timedelta(seconds=delay))))
        failures += 1
    return Case(*at, default=Value(now + timedelta(seconds=cap)), output_field=DateTimeField())


def _whole_seconds(delta: timedelta) -> int:
    return max(1, math.ceil(delta.total_seconds()))


def _username(request: HttpRequest, credentials: dict[str, Any] | None) -> str | None:
    username = get_client_username(request, credentials)
    return username[:USERNAME_LENGTH] if username else None


class SignInBackoffHandler(AxesHandler):
    """Keeps the backoff in SignInBackoff; axes' own tables stay empty. Times are axes' per-request clock."""

    def is_allowed(self, request: HttpRequest, credentials: dict[str, Any] | None = None) -> bool:
        username = _username(request, credentials)
        if username is None:
            return True
        wait = admit(username, request.axes_attempt_time)
        if wait:
            # Read by user_login_failed (not counted) and axes' middleware (the 429 page).
            request.axes_locked_out = True
            request.sign_in_wait_seconds = wait
        return wait == 0

    def user_login_failed(self, sender: object, credentials: dict[str, Any], request: HttpRequest | None = None,
                          **kwargs: Any) -> None:
        if request is None or request.axes_locked_out:
            return  # refused before the password check: nothing to count, the page is already decided
        username = _username(request, credentials)
        if username is None:
            return
        wait = wait_seconds(username, request.axes_attempt_time)
        # One line per checked failure, naming the client; refusals show in django.request's 429 lines.
        log.warning("sign-in failed for %r from %s; next check allowed in %d s",
                    username, request.axes_ip_address, wait)
        if wait:
            request.axes_locked_out = True
            request.axes_credentials = credentials
            request.sign_in_wait_seconds = wait

    def user_logged_in(self, sender: object, request: HttpRequest, user: Any, **kwargs: Any) -> None:
        forget(user.get_username())

    def user_logged_out(self, sender: object, request: HttpRequest, user: Any, **kwargs: Any) -> None:
        pass

    def get_failures(self, request: HttpRequest, credentials: dict[str, Any] | None = None) -> int:
        username = _username(request, credentials)
        row = SignInBackoff.objects.filter(username=username).values_list("failures", flat=True).first()
        return row or 0

    def reset_attempts(self, *, ip_address: str | None = None, username: str | None = None,
                       ip_or_username: bool = False) -> int:
        """axes_reset and axes_reset_username: clear one username's failures, or everyone's."""
        if username:
            return SignInBackoff.objects.filter(username=username).delete()[0]
        if ip_address:
            return 0  # nothing is kept per address
        return SignInBackoff.objects.all().delete()[0]
