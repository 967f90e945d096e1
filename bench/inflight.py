"""Model calls in flight: 200 research tasks against a loopback OpenAI-compatible fake that
answers after 2 s, through a qcluster of 2 worker processes, beside a bare asyncio + httpx2 client.

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/inflight.py --tasks 200 --delay 2 --workers 2

The fake (tests/fakes/openai_server.py, run in this process) answers by purpose (`research_reply`),
told apart by the system prompt tasks/gateway/providers/openai.py sends: plan -> {"subquestions": [...]}, extract ->
quotes copied from the sources in the request (so they pass the verbatim check), draft ->
{"markdown": ...}. search and visit go to a loopback SearxNG-style endpoint whose results are pages of
its own (`--search web`, the default: a search API, as in production), or to the bundled offline
corpus, which searches on the gateway's CPU (`--search corpus`). The fake counts requests in
flight (its own counter), and a sampler here maps each in-flight request's client port to the
worker process that owns the socket (/proc/net/tcp and /proc/<pid>/fd), every 0.2 s, to get the
calls in flight per worker process.

By default (--start staged) every task's first step, which only asks for its plan, runs in this
process before the cluster starts, so all the plan calls are due at once, as after a burst of
submissions: the first wave shows what the gateway (one job, by default) can keep in flight. The later
waves (search, visit, extract, draft) follow at the pace the workers commit steps. --start live
submits the tasks to a running cluster instead.

Baselines on the same fake: 200 concurrent requests from one bare httpx2.AsyncClient with a
pool of 200 connections, and the same with httpx2's default pool (Limits: 100 connections).
Every row made is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from statistics import median

import _harness as h
import httpx2
from _processes import Proc, machine_busy, processes
from _web_site import WebSite
from django.conf import settings
from django.db import transaction

from tasks import actions, jobs, kicks, operations
from tasks.descriptors import calls_at_most
from tasks.gateway.transport import gateway_client
from tasks.models import Checkpoint, Operation, Task
from tasks.statuses import TERMINAL, TaskStatus
from tests.fakes.openai_server import FakeOpenAI, Reply, _Handler, research_reply

TARGET_PER_PROCESS = 100
CLAIM_WAIT_TARGET_MS = 50  # a call requested -> claimed by a gateway job, p50
NEXT_STEP_TARGET_MS = 100  # a step's last answer (the gateway had it) -> its next step committed, p50
SATURATED = 0.9  # 0.2 s in which the cores were this busy had no CPU to spare for a step
POOL_CONCURRENCY = 400  # each pool's (model, search, visit): above what a wave of 200 tasks asks of the model
WITH_ROOM = "requested while the gateway had room for it"
# A call's time out with a gateway job, in two: the remote answer as the job timed it (usage.duration_ms,
# retries included), and the rest (the call started on the job's loop, its outcome recorded), whose two waits the
# job notes in the call's usage too (started_after_ms, recorded_after_ms).
ANSWER = "the remote answer (the gateway's own timing)"
IN_JOB = "claimed -> its record began"  # the row's finished_at: when the batch that records it began
AROUND = f"{IN_JOB}, less the remote answer"
BEFORE_START = "claimed -> started (the claim's rest, then the job's event loop)"
BEFORE_RECORD = "answered -> its record began (the job's recorder)"
# The target's interval starts at the gateway's answer (the row's finished_at less its recorded_after_ms), before
# the recorder's queue; the row's finished_at alone (when its batch began) would leave that queue out.
FROM_ANSWER = "last answer of a step (the gateway had it)"
STARTS = {"staged": "first steps run before the cluster started", "live": "submitted to a running cluster"}
SEARCHES = {"web": "a loopback SearxNG-style search endpoint and its pages", "corpus": "the bundled offline corpus"}
ROUNDS = 3  # the figures move by a factor of two from run to run on a shared 2-core machine: a verdict is a median
LIMITS = {"tasks": 2000, "delay": 30.0, "workers": 8, "timeout": 1800, "turns": 8, "rounds": 9}
QUESTIONS = [
    "How does asyncio cancellation work", "What are context managers", "How are exceptions handled",
    "What is a dataclass", "How does the import system find modules", "How does garbage collection work",
    "How does string formatting work", "How do generators work", "What are decorators",
    "How do threads and processes differ",
]


class _TrackingHandler(_Handler):
    def do_POST(self) -> None:  # noqa: N802
        port = self.client_address[1]
        self.owner.started(port)
        try:
            super().do_POST()
        finally:
            self.owner.finished(port)


class TrackingFake(FakeOpenAI):
    """The fake, also noting which client ports have a request in progress."""

    handler_class = _TrackingHandler

    def __init__(self, delay: float) -> None:
        super().__init__(default=Reply(content=research_reply, delay=delay))
        self.active: Counter[int] = Counter()
        self._ports_lock = threading.Lock()

    def started(self, port: int) -> None:
        with self._ports_lock:
            self.active[port] += 1

    def finished(self, port: int) -> None:
        with self._ports_lock:
            self.active[port] -= 1
            if self.active[port] <= 0:
                del self.active[port]

    def active_ports(self) -> list[int]:
        with self._ports_lock:
            return [port for port, n in self.active.items() for _ in range(n)]

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.headers.clear()
            self.max_in_flight = 0


# --- in flight per process ------------------------------------------------------------------


class Sampler(threading.Thread):
    """Every `interval` s: the fake's in-flight requests counted per worker process (by socket owner); and, from
    the first model call out (the clusters' start-up left out), how busy the machine's cores were, with the CPU
    time of every process every CPU_EVERY rounds (CpuUse)."""

    CPU_EVERY = 5  # a scan of /proc costs about 6 ms of this process's CPU, which the fakes share

    def __init__(self, fake: TrackingFake, pids: Callable[[], list[int]], interval: float = 0.2) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.fake, self.find_pids, self.interval = fake, pids, interval
        self.pids = pids()
        self.max_per_pid: Counter[int] = Counter()
        self.max_total = 0
        self.samples: list[tuple[float, int, dict[int, int]]] = []
        self.busy: list[tuple[float, float, float]] = []  # (time.time(), the cores' busy and total CPU seconds so far)
        self.cpu = CpuUse()
        self.stopping = threading.Event()

    def run(self) -> None:
        rounds = 0
        while not self.stopping.wait(self.interval):
            rounds += 1
            ports = self.fake.active_ports()
            if ports and not self.busy:  # the first model call is out: CPU is counted from here, past the start-up
                self.cpu.look(first=True)
            if self.busy or ports:
                self.busy.append((time.time(), *machine_busy()))
                if rounds % self.CPU_EVERY == 0:
                    self.cpu.look()
            if rounds % 10 == 0:  # django-q2 respawns a worker that died or was recycled
                self.pids = self.find_pids()
            if not ports:
                self.samples.append((time.time(), 0, {}))
                continue
            owners = h.socket_owners(self.fake.port, set(ports), self.pids)
            if len(owners) < len(set(ports)):  # a worker we have not seen yet
                self.pids = self.find_pids()
                owners = h.socket_owners(self.fake.port, set(ports), self.pids)
            per_pid = Counter(owners.get(port) for port in ports)
            per_pid.pop(None, None)
            for pid, n in per_pid.items():
                self.max_per_pid[pid] = max(self.max_per_pid[pid], n)
            self.max_total = max(self.max_total, len(ports))
            self.samples.append((time.time(), len(ports), dict(per_pid)))
        if self.busy:
            self.cpu.look()
            self.busy.append((time.time(), *machine_busy()))

    def busy_during(self, during: list[float]) -> list[float]:
        """How busy the machine's cores were (0 to 1) in each of the samples' intervals (0.2 s) in which something
        of `during` (sorted time.time()s: the steps' commits) happened. Not whole seconds, nor every interval: a
        wave's steps drain in well under a second, and between waves the cluster waits for the model's answers
        with nothing to do."""
        return [(later[1] - earlier[1]) / (later[2] - earlier[2]) for earlier, later in zip(self.busy, self.busy[1:])
                if later[2] > earlier[2]
                and bisect.bisect_right(during, later[0]) > bisect.bisect_right(during, earlier[0])]


class CpuUse:
    """The CPU seconds each process used between the first look and the last: from its first sighting, or from
    zero for one that started after the first look. A process that ends between two looks loses what it used
    since the last one (a worker django-q2 recycles: at most a second's worth)."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, int], float] = {}  # by pid and start time: a pid may be used again
        self.last: dict[tuple[int, int], Proc] = {}

    def look(self, *, first: bool = False) -> None:
        for proc in processes():
            key = (proc.pid, proc.started)
            self.first.setdefault(key, proc.cpu if first else 0.0)
            if key in self.last and not any(proc.argv):  # it has ended (a zombie has no command line): as it was
                proc = replace(self.last[key], cpu=proc.cpu)
            self.last[key] = proc

    def by_role(self, *, gateway: set[int]) -> dict[str, float]:
        """CPU seconds used by each part of the run (ROLES), the rest of the machine's processes last.
        `gateway`: the pids of the worker processes that ran a gateway job."""
        spent: Counter[str] = Counter()
        for key, proc in self.last.items():
            if proc.pid in gateway and proc.is_task_cluster:
                role = ROLES[0]
            elif proc.is_task_cluster:
                role = ROLES[1]
            elif proc.is_chat_service:
                role = ROLES[2]
            elif proc.name == "postgres":
                role = ROLES[3]
            elif proc.pid == os.getpid():
                role = ROLES[4]
            else:
                role = ROLES[5]
            spent[role] += proc.cpu - self.first[key]
        return {role: spent[role] for role in ROLES}


ROLES = ("the worker processes that ran a gateway job (with any steps they ran besides)",
         "the task cluster's other processes (workers that ran steps and no gateway job; the guard, pusher, monitor)",
         "the chat service's cluster", "PostgreSQL (every postgres process)",
         "this benchmark's process (the fake model server, the search site and its pages, the sampler)",
         "the rest of the machine")


# --- the baseline --------------------------------------------------------------------------


async def bare_client(base_url: str, count: int, limits: httpx2.Limits | None) -> tuple[float, list[float]]:
    """`count` concurrent plan requests from one AsyncClient: seconds until all answered, and each one's
    answer time in ms (the fake's own, under that many requests at once)."""
    body = {"model": "fake", "messages": [{"role": "system", "content": "You plan research."},
                                          {"role": "user", "content": "Question:\nbaseline\n\nConstraints:\nnone"}]}
    kwargs = {"limits": limits} if limits is not None else {}
    answers: list[float] = []

    async def one(client: httpx2.AsyncClient) -> httpx2.Response:
        sent = time.monotonic()
        response = await client.post(f"{base_url}/chat/completions", json=body)
        answers.append((time.monotonic() - sent) * 1000)
        return response

    started = time.monotonic()
    async with httpx2.AsyncClient(timeout=120, **kwargs) as client:
        responses = await asyncio.gather(*(one(client) for _ in range(count)))
    bad = [r.status_code for r in responses if r.status_code != 200]
    assert not bad, f"baseline requests failed: {bad[:5]}"
    return time.monotonic() - started, answers


async def bare_visits(site_url: str, count: int) -> list[float]:
    """`count` page visits at once from the gateway's client (tasks/gateway/transport.py), alone: each one's
    answer time in ms. The site closes each page's connection, as a page's own host would."""
    answers: list[float] = []

    async def one(client: httpx2.AsyncClient, n: int) -> httpx2.Response:
        sent = time.monotonic()
        response = await client.get(f"{site_url}/page?n={n}&q=baseline", timeout=120)
        answers.append((time.monotonic() - sent) * 1000)
        return response

    async with gateway_client(count) as client:
        responses = await asyncio.gather(*(one(client, n) for n in range(count)))
    bad = [r.status_code for r in responses if r.status_code != 200]
    assert not bad, f"baseline visits failed: {bad[:5]}"
    return answers


# --- the benchmark -------------------------------------------------------------------------


def submit_research(scope: h.Scope, count: int) -> tuple[list[int], float]:
    with transaction.atomic():
        ids = [actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
            kind="research", input={"question": QUESTIONS[n % len(QUESTIONS)]}, name=f"inflight {n}"))[0].pk
            for n in range(count)]
    return ids, time.time()


def withdraw_step_kicks(ids: set[int]) -> int:
    """Delete the kicks to advance these tasks, and those for the task due longest. After the staged first steps
    they are all stale: each task's submission kicked it, and each turn here ended with a kick for the task due
    longest, but this process ran every first step itself (where a burst's workers would have taken those
    kicks). Left, about 400 jobs that find nothing due would meet the first wave. The kicks for the plan calls
    stay: the gateway runs them."""
    from django_q.models import OrmQ

    stale = [pk for pk, func, task_id in h.broker_rows()
             if func == kicks.JOBS["advance"] and (task_id in ids or task_id == kicks.DUE_LONGEST)]
    OrmQ.objects.filter(pk__in=stale).delete()
    return len(stale)


def pipeline_waits(ids: list[int], *, cap: int, window: tuple[float, float] | None = None) -> dict[str, list[float]]:
    """From the rows: how long operations waited for a gateway job (those requested once a job was
    claiming), ran, and how long a task then waited for its next step to commit once its last
    operation of a step was done. With a `window` (time.time() from, to), only the calls requested in it,
    and the steps that asked for them (a step's calls are requested together, by its commit)."""
    checkpoints: dict[tuple[int, int], float] = {
        (task_id, step): at.timestamp()
        for task_id, step, at in Checkpoint.objects.filter(task_id__in=ids).values_list("task_id", "step", "at")}
    claim_wait: dict[str, list[float]] = {"model": [], "tool": []}
    claim_wait_with_room: dict[str, list[float]] = {"model": [], "tool": []}
    run: dict[str, list[float]] = {"model": [], "tool": []}
    answer: dict[str, list[float]] = {"model": [], "tool": []}  # the remote part, as the gateway timed it
    waits: dict[str, list[float]] = {f"{kind} call: {what}": [] for kind in ("model", "tool")
                                     for what in (BEFORE_START, BEFORE_RECORD)}
    last_done: dict[tuple[int, int], float] = {}
    last_answer: dict[tuple[int, int], float] = {}  # the same, from when the gateway had the answer
    calls = list(Operation.objects.filter(task_id__in=ids, args__isnull=False, finished_at__isnull=False).values_list(
        "pk", "task_id", "step", "kind", "created_at", "started_at", "finished_at", "usage", "pool"))
    first_claim = min((started for *_, started, _, _, _ in calls), default=None)
    room = had_room(calls, cap=cap, pool_cap=POOL_CONCURRENCY)  # the calls before the window hold room too
    if window is not None:
        calls = [call for call in calls if window[0] <= call[4].timestamp() <= window[1]]
    for op_id, task_id, step, kind, created, started, done, usage, _ in calls:
        if created >= first_claim:  # a call staged before any worker ran waited for the cluster to start
            claim_wait[kind].append((started - created).total_seconds() * 1000)
            if op_id in room:
                claim_wait_with_room[kind].append(claim_wait[kind][-1])
        run[kind].append((done - started).total_seconds() * 1000)
        answer[kind].append(float(usage.get("duration_ms", 0)))
        for what, key in ((BEFORE_START, "started_after_ms"), (BEFORE_RECORD, "recorded_after_ms")):
            if key in usage:
                waits[f"{kind} call: {what}"].append(float(usage[key]))
        key = (task_id, step)
        last_done[key] = max(last_done.get(key, 0.0), done.timestamp())
        answered = done.timestamp() - float(usage.get("recorded_after_ms", 0)) / 1000
        last_answer[key] = max(last_answer.get(key, 0.0), answered)
    # Operations of step k (0-based) were requested by checkpoint k + 1; their outcomes are read by step k + 1,
    # whose checkpoint is k + 2.
    next_step = [(checkpoints[(t, s + 2)] - done) * 1000 for (t, s), done in last_done.items()
                 if (t, s + 2) in checkpoints]
    next_step_from_answer = [(checkpoints[(t, s + 2)] - answered) * 1000 for (t, s), answered in last_answer.items()
                             if (t, s + 2) in checkpoints]
    return {
        "model call: requested -> claimed by a gateway job": claim_wait["model"],
        f"model call: {WITH_ROOM} -> claimed": claim_wait_with_room["model"],
        f"model call: {IN_JOB}": run["model"],
        f"model call: {ANSWER}": answer["model"],
        f"model call: {AROUND}": [whole - remote for whole, remote in zip(run["model"], answer["model"])],
        f"model call: {BEFORE_START}": waits[f"model call: {BEFORE_START}"],
        f"model call: {BEFORE_RECORD}": waits[f"model call: {BEFORE_RECORD}"],
        "tool call: requested -> claimed by a gateway job": claim_wait["tool"],
        f"tool call: {WITH_ROOM} -> claimed": claim_wait_with_room["tool"],
        f"tool call: {IN_JOB}": run["tool"],
        f"tool call: {ANSWER}": answer["tool"],
        f"tool call: {AROUND}": [whole - remote for whole, remote in zip(run["tool"], answer["tool"])],
        f"tool call: {BEFORE_START}": waits[f"tool call: {BEFORE_START}"],
        f"tool call: {BEFORE_RECORD}": waits[f"tool call: {BEFORE_RECORD}"],
        "last result of a step -> next step committed": next_step,
        f"{FROM_ANSWER} -> next step committed": next_step_from_answer,
    }


def cluster_env(fake: TrackingFake, site_url: str | None, *, max_running: int, turns: int = 1) -> dict[str, str]:
    """The task cluster's environment: the fake as its model, each pool at POOL_CONCURRENCY, and search and visit
    against the loopback site (the offline corpus without one)."""
    env = {"LONGHAUL_MODEL_PROVIDER": "openai", "LONGHAUL_MODEL_BASE_URL": fake.base_url,
           "LONGHAUL_MODEL": "fake", "LONGHAUL_MODEL_CONCURRENCY": str(POOL_CONCURRENCY),
           "LONGHAUL_TOOL_CONCURRENCY": str(POOL_CONCURRENCY),
           "LONGHAUL_MAX_RUNNING": str(max_running), "LONGHAUL_GATEWAY_TURNS": str(turns)}
    if site_url is not None:
        env |= {"LONGHAUL_SEARCH_URL": f"{site_url}/search", "LONGHAUL_ALLOW_PRIVATE_FETCH": "1"}
    return env


def gateway_cap(turns: int) -> int:
    """The calls the gateway keeps out at most: each job holding a turn keeps up to job_cap()."""
    return job_cap() * turns


def job_cap() -> int:
    """The calls a gateway job keeps out at most: LONGHAUL_GATEWAY_INFLIGHT, or fewer where the open-file limit,
    which the workers inherit from this process, is too low for it (tasks/descriptors.py)."""
    return calls_at_most(settings.LONGHAUL_GATEWAY_INFLIGHT)


def had_room(calls: list[tuple], *, cap: int, pool_cap: int) -> set[int]:
    """The calls requested while the gateway had room for them: fewer than `cap`, its jobs' caps
    (LONGHAUL_GATEWAY_INFLIGHT, once per turn), out or asked for earlier and still waiting, and fewer than
    `pool_cap` of their own pool's (POOL_CONCURRENCY). The others waited for calls to end, as the caps say
    they must; these waited for the gateway alone. (A task's cap, 8 calls, which no research step asks for
    more than, never binds.) `calls`: pipeline_waits' rows."""
    moves: list[tuple[float, int, int, int, str]] = []  # (when, order among moves at one time, op, what, pool)
    for op_id, _, _, _, created, started, done, _, pool in calls:
        moves += [(created.timestamp(), 1, op_id, 0, pool), (started.timestamp(), 0, op_id, 1, pool),
                  (done.timestamp(), 0, op_id, 2, pool)]
    busy, busy_in, room = 0, Counter[str](), set()  # calls out or waiting: in all, in each pool
    for _, _, op_id, what, pool in sorted(moves):
        if what == 0:
            if busy < cap and busy_in[pool] < pool_cap:
                room.add(op_id)
            busy += 1
            busy_in[pool] += 1
        elif what == 2:
            busy -= 1
            busy_in[pool] -= 1
    return room


def busiest_second(times: list[float]) -> int:
    """The most of `times` (sorted) within any one second."""
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= 1.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def most_at_once(ids: list[int]) -> tuple[int, int]:
    """From the rows: the most calls requested and not yet claimed at one moment, and the most claimed
    and not yet recorded (out with a gateway job) at one moment."""
    moves: list[tuple[float, int, int]] = []  # (when, change in waiting, change in out)
    for created, started, done in Operation.objects.filter(task_id__in=ids, args__isnull=False).values_list(
            "created_at", "started_at", "finished_at"):
        moves.append((created.timestamp(), 1, 0))
        if started is not None:
            moves.append((started.timestamp(), -1, 1))
        if done is not None:
            moves.append((done.timestamp(), 0, -1))
    waiting = out = most_waiting = most_out = 0
    for _, into_waiting, into_out in sorted(moves):
        waiting, out = waiting + into_waiting, out + into_out
        most_waiting, most_out = max(most_waiting, waiting), max(most_out, out)
    return most_waiting, most_out


def per_pid_max(samples: Iterable[tuple[float, int, dict[int, int]]]) -> list[int]:
    """The most calls each process had in flight over these samples, largest first."""
    most: Counter[int] = Counter()
    for _, _, per_pid in samples:
        for pid, n in per_pid.items():
            most[pid] = max(most[pid], n)
    return sorted(most.values(), reverse=True)


def all_terminal(ids: list[int]) -> bool:
    return not Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists()


@dataclass
class Round:
    """What one round left in the rows and the samples, read before its tenant was purged."""

    waits: dict[str, list[float]]
    statuses: Counter[str]
    ops: Counter[str]
    elapsed: float  # the first call claimed -> the last task's end (or the end of the wait, if some did not end)
    first_wave_end: float
    commits: list[float]  # the steps' commit times since the first call claimed
    calls: int  # the fake's count
    max_in_flight: int
    most_waiting: int
    most_out: int
    sampler: Sampler
    timed_out: str | None

    def p50(self, interval: str) -> float:
        return h.percentile(self.waits[interval], 50)

    @property
    def claim_waits(self) -> dict[str, float]:
        return {kind: self.p50(f"{kind} call: requested -> claimed by a gateway job") for kind in ("model", "tool")}

    @property
    def next_step(self) -> float:
        return self.p50(f"{FROM_ANSWER} -> next step committed")

    @property
    def cpu_per_step_ms(self) -> float:
        spent = self.sampler.cpu.by_role(gateway=set(self.sampler.max_per_pid))
        return (spent[ROLES[0]] + spent[ROLES[1]]) / len(self.commits) * 1000 if self.commits else 0.0


def one_round(fake: TrackingFake, env: dict[str, str], *, tasks: int, workers: int, timeout: float, start: str,
              turns: int) -> Round:
    """Submit `tasks` research tasks under a tenant of their own, run them through a cluster started for them,
    and read what they did."""
    scope = h.Scope.create("inflight", max_running=tasks + 10)
    try:
        fake.reset()
        ids: list[int] = []
        if start == "staged":
            # Every task's first step (it asks for its plan) runs here, before any worker exists,
            # so all the plan calls are due at once when the cluster starts.
            ids, _ = submit_research(scope, tasks)
            for task_id in ids:
                jobs.advance(task_id)
            waiting = Task.objects.filter(pk__in=ids, waiting_reason="model").count()
            assert waiting == tasks, f"{waiting} of {tasks} staged tasks wait for their plan call"
            withdraw_step_kicks(set(ids))
        # As autovacuum would have by now (this machine's PostgreSQL runs without it): the planner
        # plans the run's claims for the rows there are, not for the empty tables of a fresh database.
        h.vacuum_analyze()
        sampler = Sampler(fake, list)
        timed_out = None
        with h.qcluster("inflight", workers=workers, **env) as cluster:
            sampler.find_pids = cluster.descendants
            sampler.start()
            try:
                if start == "live":
                    h.wait_until(lambda: len(cluster.descendants()) >= workers, timeout=60,
                                 message="the workers to start")
                    time.sleep(1)
                    ids, _ = submit_research(scope, tasks)
                try:
                    h.wait_until(lambda: all_terminal(ids), timeout=timeout, interval=0.5,
                                 message=f"{tasks} research tasks to end")
                except TimeoutError as exc:
                    timed_out = f"{exc}; the figures cover what happened until then."
            finally:
                sampler.stopping.set()
                sampler.join(timeout=10)
            calls = fake.request_count
            max_in_flight = fake.max_in_flight
            stopped = time.time()
        started = min(Operation.objects.filter(task_id__in=ids, started_at__isnull=False)
                      .values_list("started_at", flat=True)).timestamp()
        first_wave_end = max(Operation.objects.filter(task_id__in=ids, name="plan", finished_at__isnull=False)
                             .values_list("finished_at", flat=True)).timestamp()
        statuses = Counter(Task.objects.filter(pk__in=ids).values_list("status", flat=True))
        finished = [t.timestamp() for t in Task.objects.filter(pk__in=ids, finished_at__isnull=False)
                    .values_list("finished_at", flat=True)]
        ops = Counter(Operation.objects.filter(task_id__in=ids, args__isnull=False).values_list("kind", flat=True))
        waits = pipeline_waits(ids, cap=gateway_cap(turns))
        most_waiting, most_out = most_at_once(ids)
        since = datetime.fromtimestamp(started, tz=timezone.utc)
        commits = sorted(at.timestamp() for at in Checkpoint.objects.filter(task_id__in=ids, at__gte=since)
                         .values_list("at", flat=True))
    finally:
        scope.purge()
    return Round(waits=waits, statuses=statuses, ops=ops,
                 elapsed=(max(finished) if len(finished) == tasks else stopped) - started,
                 first_wave_end=first_wave_end, commits=commits, calls=calls, max_in_flight=max_in_flight,
                 most_waiting=most_waiting, most_out=most_out, sampler=sampler, timed_out=timed_out)


def run(*, tasks: int = 200, delay: float = 2.0, workers: int = 2, timeout: float = 180,
        start: str = "staged", search: str = "web", turns: int = 1, rounds: int = ROUNDS) -> h.Report:
    h.migrate_if_needed()
    report = h.Report(
        "inflight" if turns == 1 else "inflight_turns",
        "Model calls in flight per worker process" + ("" if turns == 1 else f", {turns} gateway turns"),
        f"{tasks} research tasks against a loopback OpenAI-compatible fake answering after {delay:g} s, through a "
        f"qcluster of {workers} worker processes "
        + ("(one gateway job claims at a time, LONGHAUL_GATEWAY_TURNS 1, the default; "
           if turns == 1 else f"(up to {turns} gateway jobs claim at once, each in a worker process of its own: "
           f"LONGHAUL_GATEWAY_TURNS {turns}; ")
        + "a gateway job keeps up to LONGHAUL_GATEWAY_INFLIGHT "
        f"{job_cap()} calls out; LONGHAUL_MODEL_CONCURRENCY and LONGHAUL_TOOL_CONCURRENCY "
        f"{POOL_CONCURRENCY}, so each of the model, search and visit pools takes up to {POOL_CONCURRENCY}); search "
        f"and visit against {SEARCHES[search]}; the fake's in-flight requests, "
        f"attributed to worker processes by socket owner, beside a bare asyncio + httpx2 client. The claim waits leave "
        f"out the calls staged before the cluster started (they wait for the workers to start, not for a claim). "
        f"{rounds} round(s), each with tasks of its own and a cluster started for it: the targets are judged on the "
        f"median of the rounds' figures, and the tables are those of the round whose next-step wait was the median.",
    )
    with TrackingFake(delay) as fake, (WebSite() if search == "web" else contextlib.nullcontext()) as site:
        baseline, fake_answers = [], []
        for label, limits in ((f"bare httpx2.AsyncClient, pool of {tasks}",
                               httpx2.Limits(max_connections=tasks, max_keepalive_connections=tasks)),
                              ("bare httpx2.AsyncClient, default pool (100 connections)", None)):
            fake.reset()
            seconds, answers = asyncio.run(bare_client(fake.base_url, tasks, limits))
            fake_answers = fake_answers or answers  # the first: every request out at once
            baseline.append([label, fake.max_in_flight, "-", f"{tasks / seconds:.0f} calls/s"])
        visit_answers = asyncio.run(bare_visits(site.url, POOL_CONCURRENCY)) if site is not None else []
        env = cluster_env(fake, site.url if site is not None else None, max_running=tasks + 10, turns=turns)
        with h.override(LONGHAUL_MAX_RUNNING=tasks + 10, **{k: v for k, v in env.items()
                                                             if k.startswith("LONGHAUL_MODEL")}):
            done = [one_round(fake, env, tasks=tasks, workers=workers, timeout=timeout, start=start, turns=turns)
                    for _ in range(rounds)]
    shown = sorted(done, key=lambda r: r.next_step)[(len(done) - 1) // 2]
    report.add("Rounds", h.table(
        ["round", "model call requested -> claimed, p50 ms", "tool call requested -> claimed, p50 ms",
         "last answer -> next step committed, p50 ms", "task cluster's CPU a step, ms", "first call -> last end, s",
         "tables below"],
        [[n, h.fmt(r.claim_waits["model"], 0), h.fmt(r.claim_waits["tool"], 0), h.fmt(r.next_step, 0),
          h.fmt(r.cpu_per_step_ms, 1), h.fmt(r.elapsed, 1), "these" if r is shown else ""]
         for n, r in enumerate(done, 1)]))
    report.notes += [r.timed_out for r in done if r.timed_out]
    waits, statuses, ops, sampler = shown.waits, shown.statuses, shown.ops, shown.sampler
    first_wave_end, commits = shown.first_wave_end, shown.commits
    calls, max_in_flight, most_waiting, most_out = shown.calls, shown.max_in_flight, shown.most_waiting, shown.most_out
    steps = len(commits)
    elapsed = shown.elapsed
    # Each call holds one of the job's slots from its claim until its outcome is recorded: summed, they say how
    # long the run must last at the least, its calls back to back in every slot.
    slot_seconds = sum(sum(waits[f"{kind} call: {IN_JOB}"]) for kind in ("model", "tool")) / 1000
    floor = slot_seconds / gateway_cap(turns)
    per_minute = statuses.get(TaskStatus.SUCCEEDED, 0) / elapsed * 60
    first = per_pid_max(s for s in sampler.samples if s[0] <= first_wave_end)
    later = per_pid_max(s for s in sampler.samples if s[0] > first_wave_end)
    per_process = sorted(sampler.max_per_pid.values(), reverse=True)
    busy = [s for s in sampler.samples if s[1] > 0]
    first_label = "first wave (the plan calls, all due at once)" if start == "staged" else "first wave (plan calls)"
    report.add("In flight", h.table(
        ["client", "most model calls in flight at once", "most per worker process (sampled every 0.2 s)", "rate"], [
            *baseline,
            [f"Longhaul, {workers} worker processes: whole run (fake's counter)", max_in_flight,
             ", ".join(map(str, per_process)) or "-", f"{calls / elapsed:.1f} calls/s"],
            [f"Longhaul: {first_label}", max((s[1] for s in sampler.samples if s[0] <= first_wave_end), default=0),
             ", ".join(map(str, first)) or "-", ""],
            ["Longhaul: later waves (search, visit, extract, draft)",
             max((s[1] for s in sampler.samples if s[0] > first_wave_end), default=0),
             ", ".join(map(str, later)) or "-", ""],
        ]) + "\n\nA worker process django-q2 replaced during the run counts as another process.")
    mean_busy = sum(s[1] for s in busy) / len(busy) if busy else 0
    report.add("Tasks", h.table(["measure", "value"], [
        ["tasks", f"{tasks} ({STARTS[start]})"],
        ["search and visit", SEARCHES[search]],
        ["statuses", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))],
        ["first call claimed -> last finished_at", f"{elapsed:.1f} s"],
        ["tasks finished per minute", f"{per_minute:.0f}"],
        ["steps committed per minute", f"{steps / elapsed * 60:.0f}"],
        ["model calls made (fake's count)", f"{calls} ({calls / elapsed:.1f}/s)"],
        ["operations requested (model / tool)", f"{ops.get('model', 0)} / {ops.get('tool', 0)}"],
        ["mean model calls in flight while any was", f"{mean_busy:.0f}"],
        ["most calls out with gateway jobs at once (a job's cap: LONGHAUL_GATEWAY_INFLIGHT, once per turn)",
         f"{most_out} (cap {gateway_cap(turns)})"],
        ["most calls requested and not yet claimed at once", most_waiting],
        ["calls' time out with a gateway job (claimed -> recorded), summed; over the jobs' caps",
         f"{slot_seconds:,.0f} s; {floor:.1f} s at the least, the run took {elapsed:.1f} s"],
        [f"the fake's answer to {tasks} requests at once (bare client, pool of {tasks}), p50 / p90",
         f"{h.fmt(h.percentile(fake_answers, 50), 0)} / {h.fmt(h.percentile(fake_answers, 90), 0)} ms "
         f"(it sleeps {delay * 1000:,.0f} ms)"],
        *([[(f"the site's answer to {POOL_CONCURRENCY} page visits at once (the gateway's client alone, in "
             "this benchmark's process beside the site), p50 / p90"),
            (f"{h.fmt(h.percentile(visit_answers, 50), 0)} / {h.fmt(h.percentile(visit_answers, 90), 0)} ms "
             "(it answers at once)")]] if visit_answers else []),
        ["samples with 2+ processes calling at once", sum(1 for s in busy if len(s[2]) >= 2)],
    ]))
    # The cores' CPU seconds while the cluster ran, in all and busy.
    window, cores_busy = ((sampler.busy[-1][2] - sampler.busy[0][2], sampler.busy[-1][1] - sampler.busy[0][1])
                          if len(sampler.busy) > 1 else (0.0, 0.0))

    def share(seconds: float) -> str:
        return f"{seconds / window:.0%}" if window else "-"

    gateways = len(sampler.max_per_pid)  # the worker processes that had model calls out: a job may move between them
    spent = sampler.cpu.by_role(gateway=set(sampler.max_per_pid))
    cpu_rows = [[role, f"{used:.1f}", share(used)] for role, used in spent.items()]
    cpu_rows.append([f"the machine's {os.cpu_count()} cores, busy", f"{cores_busy:.1f} of {window:.1f}",
                     share(cores_busy)])
    stepping = sampler.busy_during(commits)
    saturated, samples = sum(share >= SATURATED for share in stepping), len(stepping)
    stepping_busy = sum(stepping) / samples if samples else 0.0
    # The whole task cluster's: a worker that runs a gateway job on a thread runs steps beside it.
    calls_made = sum(len(waits[f"{kind} call: {IN_JOB}"]) for kind in ("model", "tool"))
    per_step_ms = shown.cpu_per_step_ms
    report.add("Where the CPU went from the first model call out to the end", h.table(
        ["part", "CPU seconds", "share of the cores' time"], cpu_rows)
        + f"\n\nThe task cluster's processes, the gateway's included, used {per_step_ms:.1f} ms of CPU per step "
        f"committed ({steps} steps, and the {calls_made:,} calls they asked for). "
        f"In the intervals of 0.2 s in which steps committed, the cores were {stepping_busy:.0%} busy on average, "
        f"and at least {SATURATED:.0%} busy in {saturated} of the {samples} (/proc/stat). Each process's CPU time "
        "is read from /proc/<pid>/stat every second; one that ended between two reads (a worker django-q2 "
        "recycled) loses what it used since the last.")
    report.add("Where a task's time goes (milliseconds)", h.table(["interval", "p50", "p90", "p99", "samples"], [
        [name, h.fmt(h.percentile(v, 50), 0), h.fmt(h.percentile(v, 90), 0), h.fmt(h.percentile(v, 99), 0), len(v)]
        for name, v in waits.items()]))
    tops = [max(r.sampler.max_per_pid.values(), default=0) for r in done]
    report.targets.append(h.Target(
        f"at least {TARGET_PER_PROCESS} model calls in flight per worker process",
        f"{median(tops):.0f} in one process at most, the median of the rounds' ({', '.join(map(str, tops))}); "
        f"the round shown: {max_in_flight} in all", median(tops) >= TARGET_PER_PROCESS))
    outcomes = sum((r.statuses for r in done), Counter())
    report.targets.append(h.Target("every task succeeded", ", ".join(f"{k} {v}" for k, v in outcomes.items()),
                                   outcomes.get(TaskStatus.SUCCEEDED, 0) == tasks * len(done)))
    claim_waits = {kind: median([r.claim_waits[kind] for r in done]) for kind in ("model", "tool")}
    next_step = median([r.next_step for r in done])
    with_room = {kind: h.percentile(waits[f"{kind} call: {WITH_ROOM} -> claimed"], 50) for kind in ("model", "tool")}

    def each(figures: Iterable[float]) -> str:
        return ", ".join(h.fmt(f, 0) for f in figures)

    report.targets.append(h.Target(
        f"a call requested -> claimed by a gateway job, p50 < {CLAIM_WAIT_TARGET_MS} ms",
        f"model {claim_waits['model']:,.0f} ms, tool {claim_waits['tool']:,.0f} ms, the medians of the rounds' "
        f"(model {each(r.claim_waits['model'] for r in done)}; tool {each(r.claim_waits['tool'] for r in done)}); "
        f"in the round shown, of the calls {WITH_ROOM}: "
        f"model {h.fmt(with_room['model'], 0)} ms, tool {h.fmt(with_room['tool'], 0)} ms",
        max(claim_waits.values()) < CLAIM_WAIT_TARGET_MS))
    report.targets.append(h.Target(
        f"a step's last answer (the gateway had it) -> its next step committed, p50 < {NEXT_STEP_TARGET_MS} ms",
        f"{next_step:,.0f} ms, the median of the rounds' ({each(r.next_step for r in done)}); in the round shown, "
        f"from its record: {h.fmt(h.percentile(waits['last result of a step -> next step committed'], 50), 0)} ms",
        next_step < NEXT_STEP_TARGET_MS))
    steps_per_s = steps / elapsed if elapsed else 0.0
    busiest = busiest_second(commits)
    if max(claim_waits.values()) >= CLAIM_WAIT_TARGET_MS:
        held = sum(len(waits[f"{kind} call: requested -> claimed by a gateway job"])
                   - len(waits[f"{kind} call: {WITH_ROOM} -> claimed"]) for kind in ("model", "tool"))
        report.notes.append(
            "Why calls wait to be claimed: a running gateway job claims when it hears a step's commit (LISTEN), on a "
            f"thread and a database connection of its own. The calls {WITH_ROOM} (fewer calls out or waiting before "
            f"them than the jobs' caps, {gateway_cap(turns)}, and than their pool's) waited "
            f"{h.fmt(with_room['model'], 0)} ms (model) and {h.fmt(with_room['tool'], 0)} ms (tool) at the median: "
            "that is the gateway's own wait. "
            + (f"The others ({held}) were asked for while the jobs were full "
               f"({gateway_cap(turns)} calls out or waiting) or their pool was ({POOL_CONCURRENCY}): "
               f"a wave asks for more at once ({most_waiting} waited to be claimed at the busiest moment), so they "
               "wait for calls to end, as the caps say they must. The slots a job frees are shared among the pools "
               "with calls due (operations.claim_batch). "
               f"A tool call holds its slot for its remote answer, {h.fmt(h.percentile(waits[f'tool call: {ANSWER}'], 50), 0)} "
               "ms at the median against a site that answers at once: that is the HTTP client's own work on the "
               "job's event loop, beside every other call's"
               + (f" (the gateway's client alone, in this benchmark's process, takes {h.fmt(h.percentile(visit_answers, 50), 0)} ms "
                  f"at the median for {POOL_CONCURRENCY} visits at once: the Tasks table)" if visit_answers else "")
               + ". Bigger pools put more calls on that loop (measured once, on 2026-12-07, with the pools at 1,000 "
               "and a job's cap at 2,000: tool calls claimed in 87 to 107 ms at the median, but the next step "
               "committed 243 to 272 ms after the last answer). " if held else "")
            + (" The offline corpus's searches run on the gateway's CPU too." if search == "corpus" else ""))
    if turns > 1:
        report.notes.append(
            "With more than one turn a call's claim wait can read below zero: its started_at is the claim's time, "
            "taken before the claim waits at the claims' lock behind another job's, and a call committed meanwhile "
            "is among those it claims.")
        quickest = min(done, key=lambda r: r.claim_waits["tool"])
        slowest = max(done, key=lambda r: r.claim_waits["tool"])
        if quickest.next_step > slowest.next_step:
            report.notes.append(
                f"With {turns} turns every worker process may run a gateway job beside its steps, and the rounds "
                "traded one wait for the other: the round whose tool calls were claimed soonest "
                f"({h.fmt(quickest.claim_waits['tool'], 0)} ms at the median) waited longest for its next steps "
                f"({h.fmt(quickest.next_step, 0)} ms), the round whose tool calls waited longest "
                f"({h.fmt(slowest.claim_waits['tool'], 0)} ms) the least ({h.fmt(slowest.next_step, 0)} ms): calls "
                "claimed at once are calls whose HTTP work shares the interpreter with the steps, in both processes.")
    around = {kind: {what: h.percentile(waits[f"{kind} call: {what}"], 50) for what in (AROUND, BEFORE_START,
                                                                                         BEFORE_RECORD)}
              for kind in ("model", "tool")}
    report.notes.append(
        "Where a call's time in its gateway job goes, beside the remote answer (p50, model / tool): "
        f"{h.fmt(around['model'][AROUND], 0)} / {h.fmt(around['tool'][AROUND], 0)} ms in all; of it, from the "
        f"claim to the start (the claim's own statements, then the job's event loop) "
        f"{h.fmt(around['model'][BEFORE_START], 0)} / "
        f"{h.fmt(around['tool'][BEFORE_START], 0)} ms, and waiting for the job's recorder after the answer "
        f"{h.fmt(around['model'][BEFORE_RECORD], 0)} / {h.fmt(around['tool'][BEFORE_RECORD], 0)} ms (the calls' "
        "usage: started_after_ms, recorded_after_ms; the rest is the call's own work on the loop; a row's finished_at "
        "is when its record's batch began, so the record's own transaction is in none of them). The loop runs every "
        f"call's HTTP client and parsing; the recorder writes {operations.WRITERS} batches at once (up to "
        f"{operations.BATCH_AT_MOST} outcomes a transaction); both share their process's interpreter with the steps "
        "its main thread runs.")
    if next_step >= NEXT_STEP_TARGET_MS:
        report.notes.append(
            f"Why a task waits for its next step: the {workers} worker processes run the steps, "
            + ("one of them beside the gateway job's thread" if turns == 1 else
               f"up to {turns} of them each beside a gateway job's thread")
            + f": {steps_per_s:.0f} steps/s over the run, and {busiest} in the "
            f"busiest second, when a backlog kept them going from task to task. Results arrive in waves (the {tasks} "
            "plan answers within a second or two of each other, then their searches, and so on), and a wave's next "
            f"steps queue: {tasks} of them take {tasks / busiest if busiest else 0:.1f} s to drain at that pace, so "
            "the median task of a wave waits about half that. Before that queue there is the recorder's (the rows "
        "above), and after it no hand-off to speak of (a kick "
            "reaches an idle worker at once: its pusher listens for it). "
            + f"While steps committed the machine's cores were {stepping_busy:.0%} busy on average (in intervals of "
            f"0.2 s), and at least {SATURATED:.0%} busy in {saturated} of {samples}: the worker processes, the gateway's "
            "thread and PostgreSQL share them, so a wave's steps wait for a core as well as for a worker. Of the "
            "cores' time from the first call out, the "
            f"{'process' if gateways == 1 else f'{gateways} processes'} that ran the gateway took "
            f"{share(spent[ROLES[0]])}, the task cluster's others {share(spent[ROLES[1]])} and PostgreSQL "
            f"{share(spent[ROLES[3]])}, and this benchmark's fakes, which stand for other machines, "
            f"{share(spent[ROLES[4]])} (the table above): the task cluster used {per_step_ms:.1f} ms of CPU a step, "
            "its calls' share included.")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--delay", type=float, default=2.0, help="seconds the fake takes to answer")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180, help="seconds allowed for all tasks to end")
    parser.add_argument("--start", choices=("staged", "live"), default="staged",
                        help="staged: every task's first step runs before the cluster starts, so all plan calls "
                             "are due at once; live: the tasks are submitted to a running cluster")
    parser.add_argument("--search", choices=tuple(SEARCHES), default="web",
                        help="web: a loopback search endpoint and pages, as with a search API in production; "
                             "corpus: the offline corpus, searched on the gateway's CPU")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds, each with tasks and a cluster of its own")
    parser.add_argument("--turns", type=int, default=1,
                        help="LONGHAUL_GATEWAY_TURNS: gateway jobs that claim at once, each in a process of its own")
    args = parser.parse_args()
    for name, limit in LIMITS.items():
        if not 0 < getattr(args, name) <= limit:
            parser.error(f"--{name} must be above 0 and at most {limit}")
    if args.turns > args.workers:
        parser.error(f"--turns must be at most --workers ({args.workers}): a worker process holds one turn at a time")
    report = run(tasks=args.tasks, delay=args.delay, workers=args.workers, timeout=args.timeout, start=args.start,
                 search=args.search, turns=args.turns, rounds=args.rounds)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
