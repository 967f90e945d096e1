"""The API's one error shape, parsed into the client's typed errors (httpx2.MockTransport: parsing only)."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

from longhaul.client import (
    ApiError,
    AuthenticationFailed,
    Client,
    Conflict,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RateLimited,
    ServerError,
)
from longhaul.errors import AmbiguousName, error_from_response

pytestmark = pytest.mark.smoke


def answering(status: int, body: Any = None, *, text: str | None = None, headers: dict[str, str] | None = None
              ) -> Client:
    """A client whose every request gets this one answer, never retried."""
    def handler(request: httpx2.Request) -> httpx2.Response:
        if text is not None:
            return httpx2.Response(status, text=text, headers=headers)
        return httpx2.Response(status, json=body, headers=headers)

    return Client("http://longhaul.test", "token", transport=httpx2.MockTransport(handler), retries=0)


@pytest.mark.parametrize(("status", "cls"), [
    (400, InvalidRequest), (401, AuthenticationFailed), (403, PermissionDenied), (404, NotFound),
    (409, Conflict), (413, InvalidRequest), (429, RateLimited), (500, ServerError), (503, ServerError),
    (405, ApiError),
])
def test_it_raises_the_error_class_of_each_status(status, cls):
    with answering(status, {"error": "no", "code": "some_code"}) as client, pytest.raises(cls) as raised:
        client.get("5b0e")
    assert type(raised.value) is cls
    assert raised.value.status == status


def test_it_carries_the_code_and_the_field_at_fault():
    body = {"error": "input.depth: must be at most 3", "code": "invalid_input", "field": "input.depth"}
    with answering(400, body) as client, pytest.raises(InvalidRequest) as raised:
        client.submit("research", {"question": "q", "depth": 9})
    assert (raised.value.code, raised.value.field) == ("invalid_input", "input.depth")
    assert str(raised.value) == "input.depth: must be at most 3"


def test_it_leaves_the_field_empty_when_no_field_is_at_fault():
    with answering(409, {"error": "the task is running and has no result yet", "code": "not_ready"}) as client, \
            pytest.raises(Conflict) as raised:
        client.result("5b0e")
    assert (raised.value.code, raised.value.field) == ("not_ready", None)


def test_it_reads_retry_after_of_a_full_queue():
    with answering(429, {"error": "queue full", "code": "queue_full"}, headers={"Retry-After": "30"}) as client, \
            pytest.raises(RateLimited) as raised:
        client.submit("research", {"question": "q"})
    assert (raised.value.code, raised.value.retry_after) == ("queue_full", 30.0)


def test_it_names_the_status_when_a_proxy_answers_instead_of_the_api():
    with answering(502, text="<html>Bad Gateway</html>") as client, pytest.raises(ServerError) as raised:
        client.list()
    assert raised.value.code == "http_502"
    assert raised.value.message == "HTTP 502 Bad Gateway"


def test_it_ignores_a_code_or_field_that_is_not_text():
    error = error_from_response(httpx2.Response(400, json={"error": "bad", "code": 7, "field": ["x"]}))
    assert (error.code, error.field) == ("http_400", None)


def test_it_lists_every_candidate_of_an_ambiguous_name():
    error = AmbiguousName("digest", [{"id": "a1", "status": "running"}, {"id": "b2", "status": "queued"}])
    assert error.code == "ambiguous_name"
    assert str(error) == "2 tasks are named 'digest': a1 (running), b2 (queued)"
