"""Stream latency: commit of a task event -> its arrival at WebSocket subscribers, next to a bare
channels_redis group_send -> receive with the same fan-out, in one run on this machine.

    DATABASE_URL=postgres://... REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python bench/stream_latency.py --subscribers 200 --tasks 20 --seconds 10

Starts one daphne against DATABASE_URL (migrating it first if needed), creates its own tenant,
user and tasks there and deletes them afterwards. A writer appends events through
tasks.events.append at a steady rate, one transaction each, and notes each commit's time from
an on-commit hook registered before the wake-up's (the event's data carries its write time).
The subscribers run in a child process of their own, so that the writer's work does not delay
their clocks; they reconnect with their last seq and a backoff, as static/js/task_stream.js does.
Loopback only; bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET_P99_MS = 100.0
TARGET_RATIO = 3.0
READ_ALONE = "the stream's read alone"
CONNECT_SECONDS = 60.0
CONNECT_BATCH = 20
DRAIN_SECONDS = 10.0
RECONNECT_BASE, RECONNECT_CAP = 0.1, 2.0
LIMITS = {"subscribers": 2000, "tasks": 500, "seconds": 120, "rate": 2000}
SUBSCRIBER_FLAG = "--subscriber-process"


# --- the subscriber process (no Django here: autobahn's asyncio client) ---------------

@dataclass
class Subscriber:
    """One WebSocket client following one task; keeps (seq, receipt time) and its server closes."""

    url: str
    headers: dict[str, str]
    origin: str
    receipts: list[tuple[int, float]] = field(default_factory=list)
    closes: list[int | None] = field(default_factory=list)
    protocol: Any = None
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    leaving: bool = False

    @property
    def last_seq(self) -> int:
        return self.receipts[-1][0] if self.receipts else 0


async def connect(subscriber: Subscriber) -> None:
    from autobahn.asyncio.websocket import WebSocketClientFactory, WebSocketClientProtocol

    class Protocol(WebSocketClientProtocol):
        def onOpen(self) -> None:
            subscriber.protocol = self
            subscriber.opened.set()

        def onMessage(self, payload: bytes, is_binary: bool) -> None:
            at = time.time()
            message = json.loads(payload)
            if "seq" in message and message["seq"] > subscriber.last_seq:
                subscriber.receipts.append((message["seq"], at))

        def onClose(self, was_clean: bool, code: int | None, reason: str | None) -> None:
            if not subscriber.leaving:
                reconnect_later(subscriber, code)

    url = f"{subscriber.url}?after={subscriber.last_seq}"
    factory = WebSocketClientFactory(url, origin=subscriber.origin, headers=subscriber.headers)
    # A loaded machine can take longer than autobahn's 5 s to answer a handshake; giving up then
    # would only add a reconnect to daphne's queue.
    factory.setProtocolOptions(openHandshakeTimeout=CONNECT_SECONDS)
    factory.protocol = Protocol
    host_port = subscriber.url.split("/")[2]
    host, port = host_port.rsplit(":", 1)
    try:
        await asyncio.get_running_loop().create_connection(factory, host, int(port))
    except OSError:
        reconnect_later(subscriber, None)


def reconnect_later(subscriber: Subscriber, code: int | None) -> None:
    """Count the close and come back with the last seq after a capped, jittered backoff."""
    subscriber.closes.append(code)
    delay = min(RECONNECT_CAP, RECONNECT_BASE * 2 ** len(subscriber.closes)) * random.uniform(0.5, 1)
    asyncio.get_running_loop().call_later(delay, lambda: asyncio.ensure_future(connect(subscriber)))


async def follow(config: dict[str, Any]) -> dict[str, Any]:
    """Connect every subscriber, say ready, then wait for the drain order and report receipts."""
    ws_base = config["base"].replace("http://", "ws://")
    subscribers = [
        Subscriber(f"{ws_base}/ws/tasks/{config['tasks'][i % len(config['tasks'])]}/",
                   {"Cookie": config["cookie"]}, config["base"])
        for i in range(config["subscribers"])
    ]
    # A few handshakes at a time: each costs daphne some queries in its one database thread.
    for start in range(0, len(subscribers), CONNECT_BATCH):
        batch = subscribers[start:start + CONNECT_BATCH]
        for subscriber in batch:
            await connect(subscriber)
        await asyncio.wait_for(asyncio.gather(*(s.opened.wait() for s in batch)), CONNECT_SECONDS)
    # Ready once every stream has replayed the warm-up event: the server side is set up, not just the socket.
    deadline = time.monotonic() + CONNECT_SECONDS
    while any(s.last_seq < 1 for s in subscribers):
        if time.monotonic() > deadline:
            raise TimeoutError("some subscribers never received the warm-up event")
        await asyncio.sleep(0.05)
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    last_seqs: dict[str, int] = json.loads(line)
    expected = [last_seqs[config["tasks"][i % len(config["tasks"])]] for i in range(len(subscribers))]
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline and any(s.last_seq < e for s, e in zip(subscribers, expected)):
        await asyncio.sleep(0.05)
    for subscriber in subscribers:
        subscriber.leaving = True
        if subscriber.protocol is not None:
            subscriber.protocol.sendClose(1000)
    return {"receipts": [s.receipts for s in subscribers], "closes": [s.closes for s in subscribers]}


def subscriber_process() -> None:
    import txaio

    txaio.use_asyncio()
    config = json.loads(sys.stdin.readline())
    print(json.dumps(asyncio.run(follow(config))), flush=True)


# --- the writer --------------------------------------------------------------------

def write_events(tasks: list, *, rate: float, seconds: float) -> dict[tuple[str, int], float]:
    """Append one event per tick, round robin over the tasks; returns commit times by (task id, seq)."""
    from django.db import transaction

    from tasks import clock, events
    from tasks.events import NewEvent

    commits: dict[tuple[str, int], float] = {}
    start = time.monotonic()
    for n in range(int(rate * seconds)):
        task = tasks[n % len(tasks)]
        stamp: dict[str, float] = {}
        with transaction.atomic():
            # Registered before append's wake-up, so it runs first, right after COMMIT.
            transaction.on_commit(lambda s=stamp: s.setdefault("at", time.time()))
            seq = events.append(task, [NewEvent("bench", {"written_at": time.time()})],
                                status=task.status, at=clock.now())
        commits[(str(task.public_id), seq)] = stamp["at"]
        time.sleep(max(0.0, start + (n + 1) / rate - time.monotonic()))
    return commits


def run_subscribers(base: str, cookie: str, tasks: list, count: int, write) -> dict[str, Any]:
    """Start the subscriber process, run `write` once all are connected, and collect what they got."""
    child = subprocess.Popen([sys.executable, __file__, SUBSCRIBER_FLAG], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ids = [str(task.public_id) for task in tasks]
        child.stdin.write(json.dumps({"base": base, "cookie": cookie, "tasks": ids, "subscribers": count}) + "\n")
        child.stdin.flush()
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the subscribers did not all connect; see the output above")
        commits = write()
        child.stdin.write(json.dumps({str(t.public_id): t.last_event_seq for t in tasks}) + "\n")
        child.stdin.flush()
        result = json.loads(child.stdout.readline())
        result["commits"] = commits
        return result
    finally:
        child.stdin.close()
        child.wait(DRAIN_SECONDS)


def stream_latencies(tasks: list, result: dict[str, Any]) -> tuple[list[float], int]:
    """Commit -> receipt in ms for every delivery, and the number of missing or repeated deliveries."""
    latencies, faults = [], 0
    for i, receipts in enumerate(result["receipts"]):
        task = tasks[i % len(tasks)]
        seqs = [seq for seq, _ in receipts]
        faults += len(set(range(1, task.last_event_seq + 1)) ^ set(seqs)) + len(seqs) - len(set(seqs))
        commits = result["commits"]
        latencies += [(at - commits[(str(task.public_id), seq)]) * 1000 for seq, at in receipts if seq > 1]
    return latencies, faults


# --- the baseline ------------------------------------------------------------------

async def group_send_latencies(receivers: int, groups: int, *, rate: float, seconds: float) -> list[float]:
    """group_send -> receive in ms through the configured layer, same fan-out and rate, no database, no socket."""
    from channels.layers import channel_layers

    layer = channel_layers.make_backend("default")  # a fresh instance, bound to this event loop
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
    start, total = time.monotonic(), int(rate * seconds)
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
    if hasattr(layer, "close_pools"):  # channels_redis core; its flush() would empty everyone's groups
        await layer.close_pools()
    return latencies


def read_latencies(tasks: list, *, rate: float, seconds: float) -> list[float]:
    """The stream's read of a task's last event in ms, at the writer's pace: the stream's path holds one
    such read per process per commit (the followers of a task share it), which the baseline does not."""
    from tasks.streams import BATCH_SIZE, TaskStream

    streams = [TaskStream(t.pk, t.public_id, t.status, t.last_event_seq, t.result_version) for t in tasks]
    latencies: list[float] = []
    for n in range(int(rate * seconds)):
        stream = streams[n % len(streams)]
        time.sleep(1 / rate)
        start = time.perf_counter()
        stream.read_after(stream.last_event_seq - 1, BATCH_SIZE)
        latencies.append((time.perf_counter() - start) * 1000)
    return latencies


# --- rows of our own ---------------------------------------------------------------

def migrate_if_needed() -> None:
    from django.core.management import call_command
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        print(f"migrating {connection.settings_dict['NAME']} first")
        call_command("migrate", verbosity=0)


def make_rows(task_count: int) -> tuple[Any, Any, list]:
    """A tenant, a user and running tasks, each with one warm-up event (seq 1, not measured)."""
    from django.contrib.auth.models import User
    from django.db import transaction

    from tasks import clock, events
    from tasks.events import NewEvent
    from tasks.models import Membership, Task, Tenant
    from tasks.statuses import TaskStatus

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
    for task in tasks:
        with transaction.atomic():
            events.append(task, [NewEvent("warm_up")], status=task.status, at=now)
    return tenant, user, tasks


def delete_rows(tenant: Any, user: Any, session_key: str | None) -> None:
    from django.contrib.sessions.models import Session

    from tasks.models import Membership, Task, TaskEvent

    TaskEvent.objects.filter(tenant=tenant).delete()
    Task.objects.filter(tenant=tenant).delete()
    Membership.objects.filter(tenant=tenant).delete()
    if session_key:
        Session.objects.filter(session_key=session_key).delete()
    user.delete()
    tenant.delete()


def session_for(user: Any) -> tuple[str, str]:
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    key = client.cookies[settings.SESSION_COOKIE_NAME].value
    return key, f"{settings.SESSION_COOKIE_NAME}={key}"


# --- the report --------------------------------------------------------------------

def percentiles(values: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[94], cuts[98]


def report(args: argparse.Namespace, stream: list[float], baseline: list[float], reads: list[float],
           faults: int, closes: int) -> None:
    from django.conf import settings

    backend = settings.CHANNEL_LAYERS["default"]["BACKEND"].rsplit(".", 1)[-1]
    print(f"\nstream latency: {args.subscribers} subscribers on {args.tasks} tasks, {args.rate:g} events/s "
          f"for {args.seconds:g} s ({int(args.rate * args.seconds)} events), one daphne, {backend}, loopback")
    print(f"{'':26}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'samples':>10}")
    figures = {}
    for name, values in [("commit -> WebSocket", stream), ("group_send -> receive", baseline),
                         (READ_ALONE, reads)]:
        figures[name] = percentiles(values)
        print(f"{name:26}" + "".join(f"{v:9.1f}" for v in figures[name]) + f"{len(values):10d}")
    p99, base_p99 = figures["commit -> WebSocket"][2], figures["group_send -> receive"][2]
    ratio = p99 / base_p99 if base_p99 > 0 else float("inf")
    print(f"missing or repeated deliveries: {faults}; connections the server closed: {closes}")
    print(f"target p99 < {TARGET_P99_MS:g} ms: {'met' if p99 < TARGET_P99_MS else 'NOT met'} ({p99:.1f} ms)")
    print(f"target p99 within {TARGET_RATIO:g}x of the baseline's: "
          f"{'met' if ratio <= TARGET_RATIO else 'NOT met'} ({ratio:.1f}x)")
    if ratio > TARGET_RATIO:
        print("why: a commit reaches a socket through the baseline's hop, then one read of the database per "
              "process (its sockets on the task share it), then one send per socket. The read alone, at the same "
              f"pace, takes {figures[READ_ALONE][2]:.1f} ms at p99 (the row above), which the baseline does not "
              "spend; the channel layer carries wake-ups only, never events (DESIGN)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=float, help="events per second over all tasks (default: one per task a second, "
                                                   "about what a research task reports)")
    args = parser.parse_args()
    args.rate = args.rate or float(args.tasks)
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    return args


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    from tests.processes import daphne

    if not settings.REDIS_URL or connection.vendor != "postgresql":
        sys.exit("set DATABASE_URL=postgres://... and REDIS_URL=redis://...: this measures the Redis layer")
    migrate_if_needed()
    tenant, user, tasks = make_rows(args.tasks)
    session_key = None
    try:
        session_key, cookie = session_for(user)
        # One user holds every subscriber: the per-user and per-tenant socket caps (LONGHAUL_WS_MAX_PER_*,
        # 20 and 200 by default) would refuse most of them, and this measures latency, not the caps.
        room = str(args.subscribers + 10)
        # The web process as the Procfile runs it: no persistent connections but the read threads' own.
        with daphne(ROOT / "var" / "bench-logs" / "stream_latency", REDIS_URL=settings.REDIS_URL,
                    LONGHAUL_DB_CONN_MAX_AGE="0", LONGHAUL_WS_MAX_PER_USER=room,
                    LONGHAUL_WS_MAX_PER_TENANT=room) as base:
            result = run_subscribers(base, cookie, tasks, args.subscribers,
                                     lambda: write_events(tasks, rate=args.rate, seconds=args.seconds))
        stream, faults = stream_latencies(tasks, result)
        closes = sum(len(c) for c in result["closes"])
        baseline = asyncio.run(group_send_latencies(args.subscribers, args.tasks, rate=args.rate,
                                                    seconds=args.seconds))
        reads = read_latencies(tasks, rate=args.rate, seconds=args.seconds)
        report(args, stream, baseline, reads, faults, closes)
    finally:
        delete_rows(tenant, user, session_key)


if __name__ == "__main__":
    subscriber_process() if SUBSCRIBER_FLAG in sys.argv else main()
