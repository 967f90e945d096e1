"""REST API throughput over HTTP against a real daphne: idempotent submissions (half new keys,
half replays) and task-detail reads, at 1, 4 and 16 concurrent clients, beside /healthz on the
same server as the baseline.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/api.py --concurrency 1,4,16 --seconds 4

One daphne (tests/processes.py) serves project.asgi; no worker runs, so submitted tasks stay
queued or running and their kicks wait in the broker table (both removed at the end). The
client is httpx2.AsyncClient with a token, one connection per concurrent client, on the same
2-core machine as the server and the database: its own cost is in every figure, the baseline's
included. A submission counts as an error unless a new key answers 201 and a replay 200 with the
task the key made first; a read unless it answers 200 with the task asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import _harness as h
import httpx2
from django.db import connection
from rest_framework.authtoken.models import Token

from tasks.models import Task

LIMITS = {"seconds": 120, "requests": 100_000}
BODY = {"kind": "sleep", "name": "api bench", "input": {"steps": 1, "step_seconds": 0}}
SEED_KEYS = 20


@dataclass
class Sample:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    elapsed: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.latencies_ms) / self.elapsed if self.elapsed else 0.0

    def fail(self, why: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or why


class Load:
    """The client side: keys made so far (key -> task id) and the requests of each kind."""

    def __init__(self, client: httpx2.AsyncClient) -> None:
        self.client = client
        self.keys: dict[str, str] = {}
        self.turn = 0

    async def healthz(self, sample: Sample) -> None:
        response = await self.client.get("/healthz")
        if response.status_code != 200:
            sample.fail(f"/healthz answered {response.status_code}")

    async def submit(self, sample: Sample) -> None:
        self.turn += 1
        replay = self.turn % 2 == 0 and self.keys
        key = random.choice(list(self.keys)) if replay else uuid.uuid4().hex
        response = await self.client.post("/api/tasks", json=BODY, headers={"Idempotency-Key": key})
        expected = 200 if replay else 201
        if response.status_code != expected:
            sample.fail(f"POST /api/tasks ({'replay' if replay else 'new'}) answered {response.status_code}: "
                        f"{response.text[:200]}")
            return
        task_id = response.json()["id"]
        if replay and task_id != self.keys[key]:
            sample.fail("a replayed key answered with another task")
        self.keys.setdefault(key, task_id)

    async def detail(self, sample: Sample) -> None:
        task_id = random.choice(list(self.keys.values()))
        response = await self.client.get(f"/api/tasks/{task_id}")
        if response.status_code != 200 or response.json().get("id") != task_id:
            sample.fail(f"GET /api/tasks/{{id}} answered {response.status_code}")


async def drive(request: Callable[[Sample], Awaitable[None]], *, concurrency: int, seconds: float,
                max_requests: int) -> Sample:
    """`concurrency` loops issuing `request` back to back until time or count runs out."""
    sample = Sample()
    stop_at = time.monotonic() + seconds
    issued = 0

    async def loop() -> None:
        nonlocal issued
        while time.monotonic() < stop_at and issued < max_requests:
            issued += 1
            started = time.perf_counter()
            try:
                await request(sample)
            except httpx2.HTTPError as exc:
                sample.fail(f"{type(exc).__name__}: {exc}")
                continue
            sample.latencies_ms.append((time.perf_counter() - started) * 1000)

    started = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    sample.elapsed = time.monotonic() - started
    return sample


async def sweep(base: str, token: str, levels: list[int], *, seconds: float,
                max_requests: int) -> dict[tuple[str, int], Sample]:
    results: dict[tuple[str, int], Sample] = {}
    limits = httpx2.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx2.AsyncClient(base_url=base, headers={"Authorization": f"Token {token}"}, limits=limits,
                                  timeout=30) as client:
        load = Load(client)
        seed = Sample()
        for _ in range(SEED_KEYS):  # keys to replay and tasks to read from the first request on
            load.turn = 0
            await load.submit(seed)
        if seed.errors:
            raise RuntimeError(f"the API refused the seed submissions: {seed.first_error}")
        await drive(load.healthz, concurrency=max(levels), seconds=1, max_requests=200)  # warm connections
        for level in levels:
            for name, request in (("GET /healthz (baseline)", load.healthz),
                                  ("POST /api/tasks (idempotent)", load.submit),
                                  ("GET /api/tasks/{id}", load.detail)):
                results[(name, level)] = sample = await drive(request, concurrency=level, seconds=seconds,
                                                              max_requests=max_requests)
                print(f"{name} x{level}: {sample.rate:.0f} req/s, p50 {h.percentile(sample.latencies_ms, 50):.1f} "
                      f"ms, errors {sample.errors}", flush=True)
    return results


class ConnectionCounter(threading.Thread):
    """The most connections to the benchmark database at once (daphne's, plus this script's one)."""

    def __init__(self) -> None:
        super().__init__(name="bench-connections", daemon=True)
        self.most = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.wait(0.25):
                with connection.cursor() as cursor:
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
                    self.most = max(self.most, cursor.fetchone()[0])
        finally:
            connection.close()


def run(*, levels: tuple[int, ...] = (1, 4, 16), seconds: float = 4.0, max_requests: int = 20_000,
        conn_max_age: int | None = 0) -> h.Report:
    h.migrate_if_needed()
    report = h.Report(
        "api", "REST API over HTTP (one daphne)",
        f"Idempotent POST /api/tasks (half new keys, half replays) and GET /api/tasks/{{id}} with a token, "
        f"{seconds:g} s per point at {', '.join(map(str, levels))} concurrent clients (httpx2.AsyncClient), "
        f"against one daphne process, beside GET /healthz on the same server.",
    )
    scope = h.Scope.create("api")
    try:
        token = Token.objects.create(user=scope.user).key
        # No 429 from the queue caps: this measures the request path, not backpressure.
        env = {"LONGHAUL_MAX_QUEUED": "1000000"}
        if conn_max_age is not None:
            env["LONGHAUL_DB_CONN_MAX_AGE"] = str(conn_max_age)
        counter = ConnectionCounter()
        with h.daphne("api", **env) as base:
            counter.start()
            try:
                results = asyncio.run(sweep(base, token, list(levels), seconds=seconds, max_requests=max_requests))
            finally:
                counter.stopping.set()
                counter.join(timeout=5)
        made = Task.objects.filter(tenant=scope.tenant).count()
    finally:
        scope.purge()

    rows = []
    errors = 0
    for (name, level), s in results.items():
        errors += s.errors
        rows.append([name, level, h.fmt(s.rate, 0), h.fmt(h.percentile(s.latencies_ms, 50), 1),
                     h.fmt(h.percentile(s.latencies_ms, 99), 1), s.errors])
    report.add("Requests", h.table(["endpoint", "clients", "req/s", "p50 ms", "p99 ms", "errors"], rows))
    first_errors = sorted({s.first_error for s in results.values() if s.first_error})
    for why in first_errors:
        report.notes.append(f"first error: {why}")
    report.notes.append(f"{made} tasks were submitted in all (then deleted with their broker rows).")
    age = conn_max_age if conn_max_age is not None else h.settings.DATABASES["default"]["CONN_MAX_AGE"]
    report.notes.append(f"Connections to the database at once, at most: {counter.most} (daphne's and this "
                        f"script's; CONN_MAX_AGE={age} in daphne).")
    top = max(levels)
    health = results[("GET /healthz (baseline)", top)].rate
    for name in ("POST /api/tasks (idempotent)", "GET /api/tasks/{id}"):
        report.notes.append(f"{name} at {top} clients: {results[(name, top)].rate / health:.0%} of /healthz's rate.")
    report.targets.append(h.Target("no errors", f"{errors}", errors == 0))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--seconds", type=float, default=4.0, help="per endpoint and concurrency")
    parser.add_argument("--requests", type=int, default=20_000, help="at most this many per point")
    # 0, as the Procfile runs the web process: daphne's request threads would each keep a connection.
    parser.add_argument("--conn-max-age", type=int, default=0,
                        help="LONGHAUL_DB_CONN_MAX_AGE for daphne (default 0, as the Procfile runs it)")
    args = parser.parse_args()
    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        parser.error("--concurrency must be integers separated by commas")
    if not all(1 <= c <= 256 for c in levels):
        parser.error("--concurrency values must be between 1 and 256")
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    report = run(levels=levels, seconds=args.seconds, max_requests=args.requests, conn_max_age=args.conn_max_age)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
