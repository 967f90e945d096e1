"""What the drill's users do, over HTTP against the real daphne: submit sleep and research tasks
through the REST API (token auth, an Idempotency-Key per task), and chat in threads, where the
offline agent starts tasks ("research how asyncio cancellation works", "run a test task of 4
steps"). A request that fails (daphne answering 500 while PostgreSQL restarts, a busy thread)
is repeated with the same key until it succeeds or its time is up; what never succeeds is an
error of the load, reported with the invariants.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from random import Random
from typing import Any

import httpx2

CALL_SECONDS = 30.0  # how long one API call is retried before it counts as failed
RUN_SECONDS = 45.0  # how long a chat flow waits for the assistant between its messages
RESEARCH_QUESTIONS = (
    "how asyncio cancellation works",
    "how python generators work",
    "what context managers are for",
    "how threads and processes differ",
)
CHAT_MESSAGES = ("research how asyncio cancellation works", "run a test task of 4 steps")


class LoadError(Exception):
    """An API call that did not succeed within its time."""


@dataclass
class Api:
    """A token-authenticated client of the REST API that repeats failed calls with the same key."""

    base: str
    token: str
    retried: int = 0
    client: httpx2.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx2.Client(base_url=self.base, timeout=10.0,
                                    headers={"Authorization": f"Token {self.token}"})

    def close(self) -> None:
        self.client.close()

    def call(self, method: str, path: str, *, json: Any = None, key: str | None = None,
             ok: tuple[int, ...] = (200, 201, 202), seconds: float = CALL_SECONDS) -> dict[str, Any]:
        headers = {"Idempotency-Key": key} if key else {}
        deadline = time.monotonic() + seconds
        last = ""
        while time.monotonic() < deadline:
            try:
                response = self.client.request(method, path, json=json, headers=headers)
            except httpx2.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code in ok:
                    return response.json() if response.content else {}
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                # 5xx: the database went away under the web process; 409: the thread is busy; 429: quota.
                if response.status_code < 500 and response.status_code not in (409, 429):
                    break
            self.retried += 1
            time.sleep(0.4)
        raise LoadError(f"{method} {path}: {last}")


@dataclass(frozen=True)
class Planned:
    """One thing a user does, `at` seconds into the load."""

    at: float
    what: str  # "sleep" | "research" | "chat"
    spec: dict[str, Any]


@dataclass
class LoadPlan:
    sleep_tasks: int
    research_tasks: int
    chat_flows: int
    spread_seconds: float  # arrivals are spread over this much of the load phase


def plan(load: LoadPlan, rng: Random, *, threads: list[str]) -> list[Planned]:
    """Arrivals in time order. A third of the sleep tasks report into a chat thread; a quarter fail
    transiently once or twice at a random step (the stand-in for a flaky side-effecting tool)."""
    items: list[Planned] = []
    for n in range(load.sleep_tasks):
        steps = rng.randint(3, 6)
        spec: dict[str, Any] = {"steps": steps, "step_seconds": rng.choice((0.2, 0.4, 0.6)), "side_effect": True}
        if rng.random() < 0.25:
            spec.update(fail_at_step=rng.randint(1, steps), fail_kind="transient", fail_times=rng.randint(1, 2))
        thread = threads[n % len(threads)] if threads and n % 3 == 0 else None
        items.append(Planned(rng.uniform(0, load.spread_seconds), "sleep", {"input": spec, "thread": thread}))
    for n in range(load.research_tasks):
        question = RESEARCH_QUESTIONS[n % len(RESEARCH_QUESTIONS)]
        items.append(Planned(rng.uniform(0, load.spread_seconds), "research", {"input": {"question": question}}))
    # A short drill starts its chats early enough for their tasks to end within it.
    chat_spread = load.spread_seconds * (0.5 if load.spread_seconds < 60 else 1.0)
    for n in range(load.chat_flows):
        items.append(Planned(rng.uniform(0, chat_spread), "chat", {"n": n}))
    return sorted(items, key=lambda item: item.at)


def submit(api: Api, kind: str, task_input: dict[str, Any], *, thread: str | None = None,
           name: str = "") -> dict[str, Any]:
    """POST /api/tasks; a retry after a lost answer gets the same task back, not a second one."""
    body: dict[str, Any] = {"kind": kind, "input": task_input, "name": name or f"drill {kind}",
                            # Retries of injected transient faults must not run a task out of budget.
                            "budget": {"max_retries": 20}}
    if thread:
        body["thread"] = thread
    return api.call("POST", "/api/tasks", json=body, key=f"drill-{uuid.uuid4()}")


def chat_flow(api: Api, thread: str, messages: tuple[str, ...]) -> list[str]:
    """Post each message once the assistant has answered the previous one; returns the run ids."""
    runs = []
    for text in messages:
        run = api.call("POST", f"/api/threads/{thread}/messages", json={"content": text}, key=f"drill-{uuid.uuid4()}")
        runs.append(run["id"])
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline:
            page = api.call("GET", f"/api/threads/{thread}/messages?limit=500")
            if any(m["role"] == "assistant" and m.get("run") == run["id"] for m in page["results"]):
                break
            time.sleep(0.3)
        else:
            raise LoadError(f"no assistant reply to {text!r} in thread {thread} within {RUN_SECONDS:.0f}s")
    return runs


@dataclass
class Load:
    """Runs a plan: one submitter thread for the tasks, one thread per chat flow."""

    api: Api
    items: list[Planned]
    chat_threads: list[str]
    started: float = 0.0
    submitted: list[dict[str, Any]] = field(default_factory=list)
    chat_runs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.started = time.monotonic()
        tasks = [item for item in self.items if item.what != "chat"]
        self._spawn("drill-submitter", self._submit_all, tasks)
        for item in self.items:
            if item.what == "chat":
                thread = self.chat_threads[item.spec["n"] % len(self.chat_threads)]
                self._spawn(f"drill-chat-{item.spec['n']}", self._chat, item, thread)

    def _spawn(self, name: str, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _wait_until(self, at: float) -> bool:
        return not self.stop.wait(max(0.0, self.started + at - time.monotonic()))

    def _submit_all(self, items: list[Planned]) -> None:
        for item in items:
            if not self._wait_until(item.at):
                return
            try:
                task = submit(self.api, item.what, item.spec["input"], thread=item.spec.get("thread"))
            except LoadError as exc:
                self._error(f"submit {item.what}: {exc}")
                continue
            with self._lock:
                self.submitted.append(task)

    def _chat(self, item: Planned, thread: str) -> None:
        if not self._wait_until(item.at):
            return
        try:
            runs = chat_flow(self.api, thread, CHAT_MESSAGES)
        except LoadError as exc:
            self._error(f"chat: {exc}")
            return
        with self._lock:
            self.chat_runs.extend(runs)

    def _error(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
