"""Research tasks through a real qcluster against a loopback OpenAI-compatible server:
many model calls in flight from two worker processes, and a cluster killed with SIGKILL
between two phases that resumes from the checkpoint without running a finished call again."""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest
from django.db import connection, transaction
from django_q.models import OrmQ

from tasks import actions, jobs, kicks
from tasks.models import Checkpoint, Operation, Task, TaskEvent
from tasks.statuses import TERMINAL, OperationStatus, TaskStatus
from tests.factories import submit_sleep
from tests.fakes.openai_server import FakeOpenAI, Reply, prompt_of, purpose_of, research_reply
from tests.processes import qcluster, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]
FINISHED = (OperationStatus.SUCCEEDED, OperationStatus.FAILED)

QUESTIONS = [
    "How does asyncio cancellation work", "What are context managers", "How are exceptions handled",
    "What is a dataclass", "How does the import system find modules", "How does garbage collection work",
    "How does string formatting work", "How do generators work", "What are decorators",
    "How do threads and processes differ",
]


def openai_env(server: FakeOpenAI, **extra: str) -> dict[str, str]:
    return {"LONGHAUL_MODEL_PROVIDER": "openai", "LONGHAUL_MODEL_BASE_URL": server.base_url,
            "LONGHAUL_MODEL": "fake-model", "LONGHAUL_MODEL_API_KEY": "test-key", **extra}


def submit_research(tenant, user, questions: list[str]) -> list[int]:
    with transaction.atomic():  # one commit, so the first steps are all due at once, as after a burst
        return [actions.submit(tenant=tenant, user=user, submission=actions.Submission(
            kind="research", input={"question": q}, name=f"research {n}"))[0].pk for n, q in enumerate(questions)]


def all_terminal(ids: list[int]) -> bool:
    connection.close()  # see other processes' commits with a fresh snapshot
    return not Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists()


def assert_gapless(ids: list[int]) -> None:
    for task in Task.objects.filter(pk__in=ids):
        seqs = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True))
        assert seqs == list(range(1, task.last_event_seq + 1)), f"task {task.pk}: event seqs {seqs}"
        steps = list(Checkpoint.objects.filter(task=task).order_by("step").values_list("step", flat=True))
        assert steps == list(range(1, len(steps) + 1)), f"task {task.pk}: checkpoint steps {steps}"


def test_it_keeps_20_model_calls_in_flight_for_50_research_tasks_on_2_workers(acme, alice, log_dir, settings):
    """50 tasks, a model server that answers every request after 1 s, 2 worker processes: one gateway
    job's event loop keeps at least 20 calls in flight, every task succeeds within the time bound,
    and each model call the tasks asked for reached the server exactly once."""
    tasks, bound = 50, 150.0
    acme.max_running = tasks
    acme.save()
    settings.LONGHAUL_MAX_RUNNING = tasks + 10  # admission runs in the submitting process too
    with FakeOpenAI(default=Reply(content=research_reply, delay=1.0)) as server:
        env = openai_env(server, LONGHAUL_MODEL_CONCURRENCY="100", LONGHAUL_MAX_RUNNING=str(tasks + 10))
        ids = submit_research(acme, alice, [QUESTIONS[n % len(QUESTIONS)] for n in range(tasks)])
        started = time.monotonic()
        with qcluster(log_dir, workers=2, **env):
            wait_until(lambda: all_terminal(ids), timeout=bound, interval=0.5, message=f"{tasks} research tasks")
        elapsed = time.monotonic() - started
        requests = server.request_count
        most_at_once = server.max_in_flight

    statuses = Counter(Task.objects.filter(pk__in=ids).values_list("status", flat=True))
    assert statuses == {TaskStatus.SUCCEEDED: tasks}, statuses
    assert most_at_once >= 20, f"at most {most_at_once} model calls were in flight at once ({elapsed:.0f} s)"
    model_ops = Operation.objects.filter(task_id__in=ids, kind="model", args__isnull=False)
    assert Counter(model_ops.values_list("status", flat=True)) == {OperationStatus.SUCCEEDED: model_ops.count()}
    assert set(model_ops.values_list("attempts", flat=True)) == {1}, "a model call was claimed twice"
    assert requests == model_ops.count(), f"{requests} requests for {model_ops.count()} model calls"
    per_task = Counter(model_ops.values_list("name", flat=True))
    assert per_task["plan"] == tasks and per_task["draft"] == tasks and per_task["extract"] >= tasks, per_task
    assert_gapless(ids)


def test_a_worker_runs_steps_while_its_gateway_job_has_calls_out(acme, alice, log_dir):
    """One worker process. A research task's plan call is held at the model server, out with the gateway job,
    when a sleep task is submitted: the worker runs its steps to the end while the call is still out (the job
    runs on a thread of its own and frees the worker at once), and the research task goes on once it answers."""
    with FakeOpenAI(default=Reply(content=research_reply)) as server:
        gate = server.hold(lambda body: purpose_of(body) == "plan")
        [researching] = submit_research(acme, alice, QUESTIONS[:1])
        with qcluster(log_dir, workers=1, **openai_env(server, LONGHAUL_STEP_SLICE_MS="0")):
            wait_until(lambda: server.held == 1, timeout=60, interval=0.1, message="the plan call held at the server")
            sleeping = submit_sleep(acme, alice, steps=3)
            wait_until(lambda: all_terminal([sleeping.pk]), timeout=60, interval=0.1, message="the sleep task's end")
            assert server.held == 1, "the plan call was still out"
            assert Operation.objects.get(task_id=researching, name="plan").status == OperationStatus.STARTED
            gate.set()
            wait_until(lambda: all_terminal([researching]), timeout=90, interval=0.2, message="the research's end")
    assert Task.objects.get(pk=sleeping.pk).status == TaskStatus.SUCCEEDED
    assert Task.objects.get(pk=researching).status == TaskStatus.SUCCEEDED


def test_a_worker_replaced_while_its_gateway_thread_has_calls_out_records_them_first(acme, alice, log_dir):
    """django-q2 replaces a worker after LONGHAUL_Q_RECYCLE jobs (here 2): the gateway job, then a step. The
    gateway job returned while its call was out; the process, ending after the step, claims nothing new and
    waits for its thread to record the call's answer (Python's exit would otherwise shut the thread pools that
    work goes through, and the answer would be lost until the call's lease ran out). A new worker takes its
    place meanwhile: another task's step runs while the call is still out."""
    with FakeOpenAI(default=Reply(content=research_reply)) as server:
        gate = server.hold(lambda body: purpose_of(body) == "plan")
        [researching] = submit_research(acme, alice, QUESTIONS[:1])
        jobs.advance(researching)  # here, so its plan call's gateway kick is the cluster's first job
        OrmQ.objects.filter(key=kicks.queue_of("advance")).delete()  # the submission's kick, spent by that step
        assert OrmQ.objects.count() == 1
        env = openai_env(server, LONGHAUL_Q_RECYCLE="2", Q_LOG_LEVEL="INFO", LONGHAUL_STEP_SLICE_MS="0")
        with qcluster(log_dir, workers=1, **env) as cluster:
            wait_until(lambda: server.held == 1, timeout=60, interval=0.1, message="the plan call held at the server")
            sleeping = submit_sleep(acme, alice, steps=1)  # the worker's second job
            wait_until(lambda: all_terminal([sleeping.pk]), timeout=60, interval=0.1, message="the sleep task's end")
            wait_until(lambda: "stopped doing work" in cluster.output(), timeout=30, interval=0.1,
                       message="the worker to end its work")
            another = submit_sleep(acme, alice, steps=1)
            wait_until(lambda: all_terminal([another.pk]), timeout=60, interval=0.1,
                       message="a step on the worker that took the ending one's place")
            assert server.held == 1, "the ending worker's call was still out"
            assert "worker cluster replaced" not in cluster.output(), "no worker took the ending one's place"
            assert "recycled while finishing its calls out" in cluster.output()
            gate.set()
            wait_until(lambda: all_terminal([researching]), timeout=120, interval=0.2, message="the research's end")
            output = cluster.output()
    assert Task.objects.get(pk=researching).status == TaskStatus.SUCCEEDED
    plan = Operation.objects.get(task_id=researching, name="plan")
    assert (plan.status, plan.attempts) == (OperationStatus.SUCCEEDED, 1), "the answer was recorded by the first job"
    assert "gateway job failed" not in output, output[-3000:]


# Short operation leases and gateway slices so the killed cluster's calls are taken over within
# seconds, and django-q2's retry (its timeout below it) so the killed cluster's messages come back soon.
FAST_RECOVERY = {
    "LONGHAUL_GATEWAY_SLICE_SECONDS": "2",
    "LONGHAUL_OPERATION_LEASE_SECONDS": "10",
    "LONGHAUL_Q_TIMEOUT": "15",
    "LONGHAUL_Q_RETRY": "20",
    "LONGHAUL_STEP_SLICE_MS": "0",
}


def test_it_resumes_research_killed_between_phases_without_running_a_finished_call_again(
        acme, alice, log_dir):
    """Every task has read its sources (checkpointed) and its extraction calls are at the model
    server, held there, when every process of the cluster is killed. A new cluster finishes the
    tasks: the calls that had finished (plan, searches, visits) keep their single attempt and
    reached the server once; only the interrupted extraction calls run again, once each."""
    questions = QUESTIONS[:3]
    with FakeOpenAI(default=Reply(content=research_reply, delay=0.2)) as server:
        gate = server.hold(lambda body: purpose_of(body) == "extract")
        ids = submit_research(acme, alice, questions)
        env = openai_env(server, **FAST_RECOVERY)

        def extracting_and_held() -> bool:
            connection.close()
            latest = {}
            for task_id, step, state in Checkpoint.objects.filter(task_id__in=ids).values_list(
                    "task_id", "step", "state"):
                if step >= latest.get(task_id, (0, None))[0]:
                    latest[task_id] = (step, state["phase"])
            if len(latest) < len(ids) or {phase for _, phase in latest.values()} != {"extracting"}:
                return False
            ops = Operation.objects.filter(task_id__in=ids, args__isnull=False)
            extract = ops.filter(name="extract")
            others_done = not ops.exclude(name="extract").exclude(status__in=FINISHED).exists()
            return (others_done and extract.exists()
                    and not extract.exclude(status=OperationStatus.STARTED).exists()
                    and server.held == extract.count())

        with qcluster(log_dir, workers=2, name="first", **env) as first:
            wait_until(extracting_and_held, timeout=90, interval=0.1,
                       message="every task's extraction calls held at the model server")
            first.stop(signal.SIGKILL)  # the supervisor and every worker, mid-call
        killed_at = time.time()
        connection.close()
        before = {op.key: op for op in Operation.objects.filter(task_id__in=ids, args__isnull=False)}
        checkpoints_before = set(Checkpoint.objects.filter(task_id__in=ids).values_list("task_id", "step", "at"))
        assert not Task.objects.filter(pk__in=ids).exclude(lease_owner="").exists(), "tasks wait holding no worker"
        gate.set()  # the killed calls' handlers answer into closed sockets

        with qcluster(log_dir, workers=2, name="second", **env):
            wait_until(lambda: all_terminal(ids), timeout=120, interval=0.5, message="the tasks to end")
        prompts = Counter(prompt_of(body) for body in server.requests)

    assert Counter(Task.objects.filter(pk__in=ids).values_list("status", flat=True)) == {
        TaskStatus.SUCCEEDED: len(ids)}
    after = {op.key: op for op in Operation.objects.filter(task_id__in=ids, args__isnull=False)}
    finished = [key for key, op in before.items() if op.status in FINISHED]
    interrupted = [key for key, op in before.items() if op.status == OperationStatus.STARTED]
    assert {before[key].name for key in finished} >= {"plan", "search", "visit"}
    assert {before[key].name for key in interrupted} == {"extract"}
    for key in finished:
        assert before[key].attempts == 1, f"{key} needed {before[key].attempts} attempts before the kill"
        assert (after[key].attempts, after[key].finished_at) == (1, before[key].finished_at), \
            f"finished operation {key} ran again"
    for key in interrupted:
        assert after[key].status == OperationStatus.SUCCEEDED
        assert after[key].attempts == 2, f"{key}: the interrupted call ran {after[key].attempts} times in all"
    # The model server's own count, per distinct prompt: the plans answered before the kill were not
    # asked again; each interrupted extraction was asked once more; each draft once.
    by_purpose: dict[str, Counter[int]] = {}
    for (purpose, _), n in prompts.items():
        by_purpose.setdefault(purpose, Counter())[n] += 1
    assert by_purpose == {"plan": Counter({1: len(ids)}), "extract": Counter({2: len(interrupted)}),
                          "draft": Counter({1: len(ids)})}, by_purpose
    model_attempts = sum(op.attempts for op in after.values() if op.kind == "model")
    assert sum(prompts.values()) == model_attempts
    # Resumed from the checkpoint: the steps committed before the kill stand, the new ones follow them.
    checkpoints_after = set(Checkpoint.objects.filter(task_id__in=ids).values_list("task_id", "step", "at"))
    assert checkpoints_before <= checkpoints_after
    assert all(at.timestamp() > killed_at for _, _, at in checkpoints_after - checkpoints_before)
    assert_gapless(ids)
