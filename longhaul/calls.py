"""What each client method sends, described once for the sync and the async client.

A Call is a request not yet sent: the clients differ only in how they send it and wait.
Retrying reuses the same Call, so a submit's Idempotency-Key stays the same across its
retries and a submit that did reach the server is answered with the same task (200).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx2

from longhaul import __version__

# Statuses a proxy or a restarting server answers with before the request did anything.
RESEND_STATUSES = frozenset({502, 503, 504})
MAX_BACKOFF_S = 10.0
LIST_PAGE = 200  # the API's largest page: name look-ups read the fewest pages


@dataclass(frozen=True)
class Settings:
    """Where the server is, who is calling, and how patient to be."""

    url: str
    token: str | None = None
    tenant: str | None = None
    timeout: float = 30.0
    retries: int = 3
    backoff: float = 0.5
    # follow(): how long to keep trying a server that stopped answering before giving up.
    reconnect_for: float = 60.0
    poll_interval: float = 1.0
    use_websocket: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", base_url(self.url))

    @property
    def api_url(self) -> str:
        return self.url + "/api"

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": f"longhaul-client/{__version__}"}
        if self.token:
            headers["Authorization"] = f"Token {self.token}"
        if self.tenant:
            headers["X-Longhaul-Tenant"] = self.tenant
        return headers

    def stream_url(self, task_id: str, after: int) -> str:
        """ws(s)://host/ws/tasks/<id>/?after=N: the task's events after N, then live (tasks/consumers.py)."""
        parts = urlsplit(self.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        query = f"after={after}"
        if self.tenant:
            # The stream cannot read X-Longhaul-Tenant (browsers send no headers); it takes ?tenant=.
            query += f"&tenant={quote(self.tenant, safe='')}"
        return urlunsplit((scheme, parts.netloc, f"{parts.path}/ws/tasks/{task_path(task_id)}/", query, ""))

    def backoff_delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based): doubling, capped."""
        return min(self.backoff * 2**attempt, MAX_BACKOFF_S)


def base_url(url: str) -> str:
    """The server's root URL: "http://host:8000/api/" and "host:8000" both become "http://host:8000"."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url.removesuffix("/api")


def task_path(task_id: str) -> str:
    # Quoted so an id typed by a person can never reach another route ("../threads").
    return quote(str(task_id), safe="")


def is_task_id(ref: str) -> bool:
    try:
        uuid.UUID(ref)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Call:
    """One request to /api, as data."""

    method: str
    path: str
    params: Mapping[str, str | int] | None = None
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Whether a request that may have reached the server can be sent again without a second effect.
    resend_safe: bool = True
    has_body: bool = False

    def request_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"params": dict(self.params or {}), "headers": dict(self.headers)}
        if self.has_body:
            args["json"] = self.body
        return args


def get(path: str, params: Mapping[str, str | int] | None = None) -> Call:
    return Call("GET", path, params=params)


def post(path: str, body: Any, *, resend_safe: bool, headers: Mapping[str, str] | None = None) -> Call:
    return Call("POST", path, body=body, has_body=True, resend_safe=resend_safe, headers=headers or {})


def submit(kind: str, input: Mapping[str, Any] | None, *, name: str | None, budget: Mapping[str, Any] | None,
           priority: int | None, thread: str | None, idempotency_key: str | None) -> Call:
    body: dict[str, Any] = {"kind": kind, "input": dict(input or {})}
    for key, value in (("name", name), ("budget", budget), ("priority", priority), ("thread", thread)):
        if value is not None:
            body[key] = value
    # One key per call, generated here, not per attempt: that is what makes the retries safe.
    key = idempotency_key or f"longhaul-client-{uuid.uuid4()}"
    return post("/tasks", body, resend_safe=True, headers={"Idempotency-Key": key})


def list_tasks(*, status: str | Iterable[str] | None, kind: str | None, thread: str | None, limit: int | None,
               cursor: str | None = None) -> Call:
    params: dict[str, str | int] = {}
    if status is not None:
        params["status"] = status if isinstance(status, str) else ",".join(status)
    if kind is not None:
        params["kind"] = kind
    if thread is not None:
        params["thread"] = thread
    if limit is not None:
        params["limit"] = limit
    if cursor is not None:
        params["cursor"] = cursor
    return get("/tasks", params)


def next_cursor(page: Mapping[str, Any]) -> str | None:
    """The cursor of the next page of a list answer (DRF hands out the whole URL)."""
    link = page.get("next")
    if not link:
        return None
    return httpx2.URL(link).params.get("cursor")


def events(task_id: str, *, after: int, limit: int | None) -> Call:
    params: dict[str, str | int] = {"after": after}
    if limit is not None:
        params["limit"] = limit
    return get(f"/tasks/{task_path(task_id)}/events", params)


def cancel(task_id: str, *, reason: str, keep_results: bool) -> Call:
    # Repeating a cancel is harmless (the API says so): safe to resend.
    return post(f"/tasks/{task_path(task_id)}/cancel", {"reason": reason, "keep_results": keep_results},
                resend_safe=True)


def pause(task_id: str, *, reason: str) -> Call:
    return post(f"/tasks/{task_path(task_id)}/pause", {"reason": reason}, resend_safe=True)


def resume(task_id: str, *, budget: Mapping[str, Any] | None) -> Call:
    body = {"budget": dict(budget)} if budget is not None else {}
    # A resume that did arrive would make the repeat a 409: only resent when it surely never left.
    return post(f"/tasks/{task_path(task_id)}/resume", body, resend_safe=False)


def answer(task_id: str, answer: str | Mapping[str, Any]) -> Call:
    # Text or a structured answer ({"action": "accept", "content": {...}}), passed through as given.
    value = answer if isinstance(answer, str) else dict(answer)
    return post(f"/tasks/{task_path(task_id)}/answer", {"answer": value}, resend_safe=False)


def delete(task_id: str) -> Call:
    return Call("DELETE", f"/tasks/{task_path(task_id)}", resend_safe=False)


def never_sent(exc: Exception) -> bool:
    """The connection failed before the request left: any request may be sent again."""
    return isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout)


def decode(response: httpx2.Response) -> Any:
    return response.json() if response.content else None
