"""Every page and API answer carries the headers that keep a browser from running or framing what
it should not: a Content-Security-Policy without inline script, frame-ancestors 'none', a
Referrer-Policy and nosniff (issue "Safe defaults", item 7). The pages work under them: the
Playwright suite runs with them on, and tests/e2e/test_security_headers.py watches for violations."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def directives(header: str) -> dict[str, list[str]]:
    parsed = {}
    for part in header.split(";"):
        name, *values = part.split()
        parsed[name] = values
    return parsed


@pytest.mark.parametrize("path", ["/", "/accounts/login/", "/api/me", "/api/tasks", "/admin/login/", "/no-such-page"])
def test_every_answer_carries_the_security_headers(alice, path):
    client = Client()
    client.force_login(alice)
    response = client.get(path)

    policy = directives(response["Content-Security-Policy"])
    assert policy["default-src"] == ["'self'"]
    assert policy["script-src"] == ["'self'"]  # no 'unsafe-inline', no 'unsafe-eval'
    assert policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert policy["base-uri"] == ["'none'"]
    assert policy["form-action"] == ["'self'"]
    assert response["Referrer-Policy"] == "same-origin"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["X-Frame-Options"] == "DENY"
