"""The Longhaul client: `Client` (sync) and `AsyncClient` over the REST API and the task stream.

    with Client("http://127.0.0.1:8000", token) as lh:
        task = lh.submit("research", {"question": "How does asyncio cancellation work?"})
        for event in lh.follow(task["id"]):
            print(event["seq"], event["kind"])
        print(lh.result(task["id"])["result"]["report"])

Both clients send the same requests (longhaul/calls.py) and raise the same typed errors
(longhaul/errors.py). Reads, submits (with their Idempotency-Key) and cancels are retried on
connection failures and 502/503/504; every request is retried when the connection was refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, Self

import httpx2

from longhaul import calls
from longhaul.calls import Call, Settings
from longhaul.errors import (
    AmbiguousName,
    ApiError,
    AuthenticationFailed,
    Conflict,
    ConnectionFailed,
    InvalidRequest,
    LonghaulError,
    NotFound,
    NotSignedIn,
    PermissionDenied,
    RateLimited,
    ServerError,
    error_from_response,
)
from longhaul.follow import Follow, SyncFollow
from longhaul.shapes import Event, EventPage, Result, Task

__all__ = [
    "AmbiguousName", "ApiError", "AsyncClient", "AuthenticationFailed", "Client", "Conflict", "ConnectionFailed",
    "InvalidRequest", "LonghaulError", "NotFound", "NotSignedIn", "PermissionDenied", "RateLimited", "ServerError",
    "Settings",
]

TaskList = list[Task]  # `list` is also a method name below
log = logging.getLogger("longhaul.client")


def _settings(url: str, token: str | None, **options: Any) -> Settings:
    return Settings(url=url, token=token, **options)


def match_name(name: str, tasks: Iterable[Task]) -> Task:
    """The one task called `name` (exactly, else ignoring case); NotFound or AmbiguousName otherwise."""
    tasks = list(tasks)
    for same in (lambda t: t.get("name") == name, lambda t: str(t.get("name", "")).casefold() == name.casefold()):
        found = [t for t in tasks if same(t)]
        if len(found) == 1:
            return found[0]
        if found:
            raise AmbiguousName(name, found)
    raise NotFound(f"no task has the id or name {name!r}", status=404, code="not_found")


def _connection_failed(settings: Settings, exc: Exception) -> ConnectionFailed:
    reason = str(exc) or type(exc).__name__
    return ConnectionFailed(f"cannot reach {settings.url}: {reason}")


def _log_retry(settings: Settings, call: Call, why: object, attempt: int) -> None:
    log.info("%s %s%s: %s; retrying in %.1f s", call.method, settings.api_url, call.path, why or type(why).__name__,
             settings.backoff_delay(attempt))


class Client:
    """Synchronous client. One per thread; close it (or use `with`) to free its connections."""

    def __init__(self, url: str, token: str | None = None, *, transport: httpx2.BaseTransport | None = None,
                 **options: Any) -> None:
        """`options` are Settings fields: tenant, timeout, retries, backoff, reconnect_for, poll_interval,
        use_websocket. `transport` replaces the network (httpx2.MockTransport in tests)."""
        self.settings = _settings(url, token, **options)
        self._http = httpx2.Client(base_url=self.settings.api_url, headers=self.settings.headers(),
                                   timeout=self.settings.timeout, transport=transport)

    @classmethod
    def from_config(cls, **options: Any) -> Client:
        """A client for the server `longhaul login` stored (LONGHAUL_URL and LONGHAUL_TOKEN win)."""
        from longhaul import config

        login = config.load()
        return cls(login.url, login.token, tenant=options.pop("tenant", login.tenant), **options)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, call: Call) -> Any:
        """Send one Call, retrying what is safe to retry; the decoded JSON answer."""
        attempt = 0
        while True:
            try:
                response = self._http.request(call.method, call.path, **call.request_args())
            except httpx2.TransportError as exc:
                if attempt < self.settings.retries and (call.resend_safe or calls.never_sent(exc)):
                    _log_retry(self.settings, call, exc, attempt)
                    time.sleep(self.settings.backoff_delay(attempt))
                    attempt += 1
                    continue
                raise _connection_failed(self.settings, exc) from exc
            if (response.status_code in calls.RESEND_STATUSES and call.resend_safe
                    and attempt < self.settings.retries):
                _log_retry(self.settings, call, f"HTTP {response.status_code}", attempt)
                time.sleep(self.settings.backoff_delay(attempt))
                attempt += 1
                continue
            if response.is_error:
                raise error_from_response(response)
            return calls.decode(response)

    def me(self) -> dict[str, Any]:
        """Who the token belongs to: {"username", "tenant", "memberships"}."""
        return self.send(Call("GET", "/me"))

    def submit(self, kind: str, input: Mapping[str, Any] | None = None, *, name: str | None = None,
               budget: Mapping[str, Any] | None = None, priority: int | None = None, thread: str | None = None,
               idempotency_key: str | None = None) -> Task:
        """Start a task. A fresh Idempotency-Key is made per call (unless given) and reused on its retries."""
        return self.send(calls.submit(kind, input, name=name, budget=budget, priority=priority, thread=thread,
                                      idempotency_key=idempotency_key))

    def get(self, task_id: str) -> Task:
        return self.send(calls.get(f"/tasks/{calls.task_path(task_id)}"))

    def list(self, *, status: str | Iterable[str] | None = None, kind: str | None = None,
             thread: str | None = None, limit: int | None = None) -> TaskList:
        """The newest tasks first: one page (`limit`, default 50, at most 200)."""
        page = self.send(calls.list_tasks(status=status, kind=kind, thread=thread, limit=limit))
        return page["results"]

    def iter_tasks(self, *, status: str | Iterable[str] | None = None, kind: str | None = None,
                   thread: str | None = None) -> Iterator[Task]:
        """Every task, newest first, page after page."""
        cursor: str | None = None
        while True:
            page = self.send(calls.list_tasks(status=status, kind=kind, thread=thread, limit=calls.LIST_PAGE,
                                              cursor=cursor))
            yield from page["results"]
            if (cursor := calls.next_cursor(page)) is None:
                return

    def resolve(self, ref: str, *, status: str | Iterable[str] | None = None) -> Task:
        """The task with this id, or else the one with this name (among `status` when given)."""
        if calls.is_task_id(ref):
            return self.get(ref)
        return match_name(ref, self.iter_tasks(status=status))

    def events(self, task_id: str, *, after: int = 0, limit: int | None = None) -> EventPage:
        """Events with seq > after, in order, and `next_after` to ask with next time."""
        return self.send(calls.events(task_id, after=after, limit=limit))

    def follow(self, task_id: str, *, after: int = 0) -> SyncFollow:
        """Every event after `after`, once each and in order, live until the task ends (see longhaul.follow)."""
        return SyncFollow(self.settings, task_id, after=after)

    def cancel(self, task_id: str, *, reason: str = "", keep_results: bool = False) -> Task:
        return self.send(calls.cancel(task_id, reason=reason, keep_results=keep_results))

    def pause(self, task_id: str, *, reason: str = "") -> Task:
        return self.send(calls.pause(task_id, reason=reason))

    def resume(self, task_id: str, *, budget: Mapping[str, Any] | None = None) -> Task:
        return self.send(calls.resume(task_id, budget=budget))

    def answer(self, task_id: str, answer: str | Mapping[str, Any]) -> Task:
        """Answer the task's question with text or a structured answer, sent as given."""
        return self.send(calls.answer(task_id, answer))

    def result(self, task_id: str) -> Result:
        """The result and its result_version; Conflict (`not_ready`) until there is one."""
        return self.send(calls.get(f"/tasks/{calls.task_path(task_id)}/result"))

    def delete(self, task_id: str) -> None:
        """Delete an ended task and what it produced (Conflict `task_active` while it may still run)."""
        self.send(calls.delete(task_id))


class AsyncClient:
    """Asynchronous client: the same methods as Client, awaited."""

    def __init__(self, url: str, token: str | None = None, *, transport: httpx2.AsyncBaseTransport | None = None,
                 **options: Any) -> None:
        self.settings = _settings(url, token, **options)
        self._http = httpx2.AsyncClient(base_url=self.settings.api_url, headers=self.settings.headers(),
                                        timeout=self.settings.timeout, transport=transport)

    @classmethod
    def from_config(cls, **options: Any) -> AsyncClient:
        from longhaul import config

        login = config.load()
        return cls(login.url, login.token, tenant=options.pop("tenant", login.tenant), **options)

    @classmethod
    def from_settings(cls, settings: Settings) -> AsyncClient:
        options = dataclasses.asdict(settings)
        return cls(options.pop("url"), options.pop("token"), **options)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                response = await self._http.request(call.method, call.path, **call.request_args())
            except httpx2.TransportError as exc:
                if attempt < self.settings.retries and (call.resend_safe or calls.never_sent(exc)):
                    _log_retry(self.settings, call, exc, attempt)
                    await asyncio.sleep(self.settings.backoff_delay(attempt))
                    attempt += 1
                    continue
                raise _connection_failed(self.settings, exc) from exc
            if (response.status_code in calls.RESEND_STATUSES and call.resend_safe
                    and attempt < self.settings.retries):
                _log_retry(self.settings, call, f"HTTP {response.status_code}", attempt)
                await asyncio.sleep(self.settings.backoff_delay(attempt))
                attempt += 1
                continue
            if response.is_error:
                raise error_from_response(response)
            return calls.decode(response)

    async def me(self) -> dict[str, Any]:
        return await self.send(Call("GET", "/me"))

    async def submit(self, kind: str, input: Mapping[str, Any] | None = None, *, name: str | None = None,
                     budget: Mapping[str, Any] | None = None, priority: int | None = None,
                     thread: str | None = None, idempotency_key: str | None = None) -> Task:
        return await self.send(calls.submit(kind, input, name=name, budget=budget, priority=priority,
                                            thread=thread, idempotency_key=idempotency_key))

    async def get(self, task_id: str) -> Task:
        return await self.send(calls.get(f"/tasks/{calls.task_path(task_id)}"))

    async def list(self, *, status: str | Iterable[str] | None = None, kind: str | None = None,
                   thread: str | None = None, limit: int | None = None) -> TaskList:
        page = await self.send(calls.list_tasks(status=status, kind=kind, thread=thread, limit=limit))
        return page["results"]

    async def iter_tasks(self, *, status: str | Iterable[str] | None = None, kind: str | None = None,
                         thread: str | None = None) -> AsyncIterator[Task]:
        cursor: str | None = None
        while True:
            page = await self.send(calls.list_tasks(status=status, kind=kind, thread=thread,
                                                    limit=calls.LIST_PAGE, cursor=cursor))
            for task in page["results"]:
                yield task
            if (cursor := calls.next_cursor(page)) is None:
                return

    async def resolve(self, ref: str, *, status: str | Iterable[str] | None = None) -> Task:
        if calls.is_task_id(ref):
            return await self.get(ref)
        return match_name(ref, [task async for task in self.iter_tasks(status=status)])

    async def events(self, task_id: str, *, after: int = 0, limit: int | None = None) -> EventPage:
        return await self.send(calls.events(task_id, after=after, limit=limit))

    def follow(self, task_id: str, *, after: int = 0) -> Follow:
        """`async for event in client.follow(id)`: every event after `after`, once each, until the task ends."""
        return Follow(self, task_id, after=after)

    async def cancel(self, task_id: str, *, reason: str = "", keep_results: bool = False) -> Task:
        return await self.send(calls.cancel(task_id, reason=reason, keep_results=keep_results))

    async def pause(self, task_id: str, *, reason: str = "") -> Task:
        return await self.send(calls.pause(task_id, reason=reason))

    async def resume(self, task_id: str, *, budget: Mapping[str, Any] | None = None) -> Task:
        return await self.send(calls.resume(task_id, budget=budget))

    async def answer(self, task_id: str, answer: str | Mapping[str, Any]) -> Task:
        return await self.send(calls.answer(task_id, answer))

    async def result(self, task_id: str) -> Result:
        return await self.send(calls.get(f"/tasks/{calls.task_path(task_id)}/result"))

    async def delete(self, task_id: str) -> None:
        await self.send(calls.delete(task_id))


__all__ += ["Event", "EventPage", "Follow", "Result", "SyncFollow", "Task"]
