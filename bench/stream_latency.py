"""Stream latency: commit of a task event -> its arrival at WebSocket subscribers, next to a bare
channels_redis group_send -> receive with the same fan-out, in one run on this machine.

    DATABASE_URL=postgres://... REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/stream_latency.py --subscribers 200 --tasks 20 --seconds 10

Starts one daphne against DATABASE_URL (migrating it first if needed), creates its own tenant,
user and tasks there and deletes them afterwards. A writer appends events through
tasks.events.append at a steady rate, one transaction each, and notes each commit's time from
an on-commit hook registered before the wake-up's; subscribers note each event's receipt.
Loopback only; bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()  # loads daphne, which installs Twisted's asyncio reactor: autobahn's Twisted client fits

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol, connectWS  # noqa: E402
from channels_redis.core import RedisChannelLayer  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.contrib.sessions.models import Session  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.migrations.executor import MigrationExecutor  # noqa: E402
from django.test import Client  # noqa: E402
from twisted.internet import reactor  # noqa: E402
from twisted.internet.threads import blockingCallFromThread  # noqa: E402

from tasks import clock, events  # noqa: E402
from tasks.events import NewEvent  # noqa: E402
from tasks.models import Membership, Task, TaskEvent, Tenant  # noqa: E402
from tasks.statuses import TaskStatus  # noqa: E402
from tests.processes import daphne  # noqa: E402

TARGET_P99_MS = 100.0
TARGET_RATIO = 3.0
DRAIN_SECONDS = 10.0
RECONNECT_DELAY = 0.1
LIMITS = {"subscribers": 2000, "tasks": 500, "seconds": 120, "rate": 2000}


# --- subscribers -------------------------------------------------------------------

class _Protocol(WebSocketClientProtocol):
    def onOpen(self) -> None:
        self.factory.subscriber.opened(self)

    def onMessage(self, payload: bytes, is_binary: bool) -> None:
        self.factory.subscriber.received(time.time(), json.loads(payload))

    def onClose(self, was_clean: bool, code: int | None, reason: str | None) -> None:
        self.factory.subscriber.closed(code)


@dataclass
class Subscriber:
    """One WebSocket client following one task; reconnects with its last seq, as the JS client does."""

    base: str
    task: Task
    cookie: str
    ready: threading.Semaphore
    receipts: dict[int, float] = field(default_factory=dict)
    seqs: list[int] = field(default_factory=list)
    closes: list[int | None] = field(default_factory=list)
    protocol: _Protocol | None = None
    leaving: bool = False

    def connect(self) -> None:
        after = self.seqs[-1] if self.seqs else 0
        url = self.base.replace("http://", "ws://") + f"/ws/tasks/{self.task.public_id}/?after={after}"
        factory = WebSocketClientFactory(url, origin=self.base, headers={"Cookie": self.cookie})
        factory.protocol = _Protocol
        factory.subscriber = self
        connectWS(factory)

    def opened(self, protocol: _Protocol) -> None:
        if self.protocol is None:
            self.ready.release()
        self.protocol = protocol

    def received(self, at: float, message: dict) -> None:
        if "seq" in message:
            self.seqs.append(message["seq"])
            self.receipts.setdefault(message["seq"], at)

    def closed(self, code: int | None) -> None:
        if not self.leaving:
            self.closes.append(code)
            reactor.callLater(RECONNECT_DELAY, self.connect)

    def leave(self) -> None:
        self.leaving = True
        if self.protocol is not None:
            self.protocol.sendClose(1000)


def start_reactor() -> None:
    """Twisted's reactor in a thread: the subscribers live there, the writer in the main thread."""
    started = threading.Event()
    reactor.callWhenRunning(started.set)
    threading.Thread(target=reactor.run, kwargs={"installSignalHandlers": False}, daemon=True).start()
    if not started.wait(10):
        raise RuntimeError("the Twisted reactor did not start")


def subscribe(base: str, tasks: list[Task], cookie: str, count: int) -> list[Subscriber]:
    ready = threading.Semaphore(0)
    subscribers = [Subscriber(base, tasks[i % len(tasks)], cookie, ready) for i in range(count)]
    for subscriber in subscribers:
        blockingCallFromThread(reactor, subscriber.connect)
    deadline = time.monotonic() + 30
    for _ in subscribers:
        if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RuntimeError("subscribers did not all connect within 30 s")
    return subscribers


# --- the writer --------------------------------------------------------------------

def write_events(tasks: list[Task], *, rate: float, seconds: float) -> dict[tuple[int, int], float]:
    """Append one event per tick, round robin over the tasks; returns commit times by (task pk, seq)."""
    commits: dict[tuple[int, int], float] = {}
    interval = 1.0 / rate
    start = time.monotonic()
    for n in range(int(rate * seconds)):
        task = tasks[n % len(tasks)]
        with transaction.atomic():
            stamp: dict[str, float] = {}
            # Registered before append's wake-up, so it runs first, right after COMMIT.
            transaction.on_commit(lambda s=stamp: s.setdefault("at", time.time()))
            seq = events.append(task, [NewEvent("bench", {"written_at": time.time()})],
                                status=task.status, at=clock.now())
        commits[(task.pk, seq)] = stamp["at"]
        time.sleep(max(0.0, start + (n + 1) * interval - time.monotonic()))
    return commits


def drain(subscribers: list[Subscriber]) -> None:
    """Wait (bounded) until every subscriber has its task's last event."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        if all(s.seqs and s.seqs[-1] >= s.task.last_event_seq for s in subscribers):
            return
        time.sleep(0.05)


def stream_latencies(subscribers: list[Subscriber], commits: dict[tuple[int, int], float]) -> tuple[list[float], int]:
    """Commit -> receipt in ms for every delivery, and the number of missing or repeated deliveries."""
    latencies, faults = [], 0
    for s in subscribers:
        expected = list(range(1, s.task.last_event_seq + 1))
        faults += len(set(expected) ^ set(s.seqs)) + (len(s.seqs) - len(set(s.seqs)))
        latencies += [(at - commits[(s.task.pk, seq)]) * 1000 for seq, at in s.receipts.items()]
    return latencies, faults


# --- the baseline ------------------------------------------------------------------

async def group_send_latencies(receivers: int, groups: int, *, rate: float, seconds: float) -> list[float]:
    """group_send -> receive in ms through channels_redis, same fan-out and rate, no database, no socket."""
    layer = RedisChannelLayer(**settings.CHANNEL_LAYERS["default"].get("CONFIG", {}))
    run = uuid.uuid4().hex[:8]
    channels = [await layer.new_channel() for _ in range(receivers)]
    for i, channel in enumerate(channels):
        await layer.group_add(f"bench-echo-{run}-{i % groups}", channel)
    latencies: list[float] = []

    async def receive(channel: str) -> None:
        while True:
            message = await layer.receive(channel)
            latencies.append((time.time() - message["t"]) * 1000)

    receiving = [asyncio.create_task(receive(channel)) for channel in channels]
    start = time.monotonic()
    total = int(rate * seconds)
    for n in range(total):
        await layer.group_send(f"bench-echo-{run}-{n % groups}", {"type": "echo", "t": time.time()})
        await asyncio.sleep(max(0.0, start + (n + 1) / rate - time.monotonic()))
    members = [len(range(g, receivers, groups)) for g in range(groups)]
    expected = sum(members[n % groups] for n in range(total))
    deadline = time.monotonic() + DRAIN_SECONDS
    while len(latencies) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for task in receiving:
        task.cancel()
    await asyncio.gather(*receiving, return_exceptions=True)
    for i, channel in enumerate(channels):
        await layer.group_discard(f"bench-echo-{run}-{i % groups}", channel)
    await layer.close_pools()
    return latencies


# --- rows of our own ---------------------------------------------------------------

def migrate_if_needed() -> None:
    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        print(f"migrating {connection.settings_dict['NAME']} first")
        call_command("migrate", verbosity=0)


def make_rows(task_count: int) -> tuple[Tenant, User, list[Task]]:
    suffix = uuid.uuid4().hex[:8]
    tenant = Tenant.objects.create(slug=f"bench-stream-{suffix}", name="stream latency bench", max_running=task_count)
    user = User.objects.create_user(username=f"bench-stream-{suffix}")
    Membership.objects.create(user=user, tenant=tenant)
    now = clock.now()
    tasks = [
        Task.objects.create(tenant=tenant, owner=user, kind="sleep", name=f"bench {i}", status=TaskStatus.RUNNING,
                            created_at=now, updated_at=now)
        for i in range(task_count)
    ]
    return tenant, user, tasks


def delete_rows(tenant: Tenant, user: User, session_key: str | None) -> None:
    TaskEvent.objects.filter(tenant=tenant).delete()
    Task.objects.filter(tenant=tenant).delete()
    Membership.objects.filter(tenant=tenant).delete()
    if session_key:
        Session.objects.filter(session_key=session_key).delete()
    user.delete()
    tenant.delete()


def session_for(user: User) -> tuple[str, str]:
    client = Client()
    client.force_login(user)
    key = client.cookies[settings.SESSION_COOKIE_NAME].value
    return key, f"{settings.SESSION_COOKIE_NAME}={key}"


# --- the report --------------------------------------------------------------------

def percentiles(values: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[94], cuts[98]


def report(args: argparse.Namespace, stream: list[float], baseline: list[float], faults: int,
           reconnects: int) -> None:
    events_written = int(args.rate * args.seconds)
    print(f"\nstream latency: {args.subscribers} subscribers on {args.tasks} tasks, {args.rate:g} events/s "
          f"for {args.seconds:g} s ({events_written} events), one daphne, Redis layer, loopback")
    print(f"{'':26}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'samples':>10}")
    rows = [("commit -> WebSocket", stream), ("group_send -> receive", baseline)]
    figures = {}
    for name, values in rows:
        figures[name] = percentiles(values)
        p50, p95, p99 = figures[name]
        print(f"{name:26}{p50:9.1f}{p95:9.1f}{p99:9.1f}{len(values):10d}")
    p99, base_p99 = figures["commit -> WebSocket"][2], figures["group_send -> receive"][2]
    ratio = p99 / base_p99 if base_p99 > 0 else float("inf")
    print(f"missing or repeated deliveries: {faults}; reconnects after a server close: {reconnects}")
    print(f"target p99 < {TARGET_P99_MS:g} ms: {'met' if p99 < TARGET_P99_MS else 'NOT met'} ({p99:.1f} ms)")
    print(f"target p99 within {TARGET_RATIO:g}x of the baseline's: "
          f"{'met' if ratio <= TARGET_RATIO else 'NOT met'} ({ratio:.1f}x)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=float, default=100, help="events per second over all tasks")
    args = parser.parse_args()
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    return args


def main() -> None:
    args = parse_args()
    if not settings.REDIS_URL or connection.vendor != "postgresql":
        sys.exit("set DATABASE_URL=postgres://... and REDIS_URL=redis://...: this measures the Redis layer")
    migrate_if_needed()
    tenant, user, tasks = make_rows(args.tasks)
    session_key = None
    try:
        session_key, cookie = session_for(user)
        log_dir = ROOT / "var" / "bench-logs" / "stream_latency"
        with daphne(log_dir, REDIS_URL=settings.REDIS_URL) as base:
            start_reactor()
            subscribers = subscribe(base, tasks, cookie, args.subscribers)
            commits = write_events(tasks, rate=args.rate, seconds=args.seconds)
            drain(subscribers)
            for subscriber in subscribers:
                reactor.callFromThread(subscriber.leave)
        stream, faults = stream_latencies(subscribers, commits)
        reconnects = sum(len(s.closes) for s in subscribers)
        baseline = asyncio.run(group_send_latencies(args.subscribers, args.tasks, rate=args.rate,
                                                    seconds=args.seconds))
        report(args, stream, baseline, faults, reconnects)
    finally:
        delete_rows(tenant, user, session_key)


if __name__ == "__main__":
    main()
