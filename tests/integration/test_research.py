"""The research driver on the offline defaults: a real question about Python in, a cited report out."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import time_machine
from django.utils.html import escape

from tasks import actions, clock, jobs, leases, operations
from tasks.gateway.providers.offline import markdown_text, plan_subquestions
from tasks.models import Membership, Operation, Task, Tenant
from tasks.statuses import OperationStatus, TaskStatus

pytestmark = pytest.mark.django_db(transaction=True)
QUESTION = "How does asyncio task cancellation work?"


@pytest.fixture(autouse=True)
def _settings(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


def submit(tenant, user, **extra) -> Task:
    task, _ = actions.submit(tenant=tenant, user=user, submission=actions.Submission(
        kind="research", input={"question": QUESTION, **extra.pop("input", {})}, **extra))
    return task


def run_to_end(task: Task, *, max_rounds: int = 60) -> Task:
    """Advance steps and run gateway batches in-process until the task ends."""
    for _ in range(max_rounds):
        task.refresh_from_db()
        if task.status in (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.PARTIAL, TaskStatus.CANCELLED):
            return task
        if operations.unfinished(task.pk, task.current_step - 1) if task.current_step else False:
            operations.run_due(run_for=5)
        else:
            jobs.advance(task.pk)
    raise AssertionError(f"still {task.status} at step {task.current_step}")


def test_a_research_task_ends_with_a_report_citing_sources_that_contain_its_quotes(acme, alice):
    task = run_to_end(submit(acme, alice))
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    result = task.result
    sources = {s["n"]: s for s in result["sources"]}
    assert len(sources) >= 2, result["sources"]
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", result["report"].split("## Sources")[0])}
    assert cited, result["report"]
    assert cited <= set(sources), "every citation points at a listed source"
    texts = {op.args["url"]: op.result["text"] for op in Operation.objects.filter(task=task, name="visit",
                                                                                  status="succeeded")}
    for evidence in result["evidence"]:
        source = sources.get(evidence["n"])
        if source is None:
            continue
        assert evidence["quote"] in texts[source["url"]], "a quote is verbatim from its source"
    kinds = list(task.events.values_list("kind", flat=True))
    for phase in ("planning", "searching", "source_read", "evidence_added", "drafting", "succeeded"):
        assert phase in kinds
    assert list(task.events.values_list("seq", flat=True)) == list(range(1, task.last_event_seq + 1))


def test_a_worker_lost_between_phases_resumes_without_repeating_finished_calls(acme, alice, settings):
    task = submit(acme, alice)
    jobs.advance(task.pk)               # plan requested
    operations.run_due(run_for=5)       # plan done
    task.refresh_from_db()
    doomed = leases.claim(task.pk, owner="killed:1", now=clock.now())  # a worker takes the next step, then dies
    assert doomed is not None
    before = {op.key: op.attempts for op in Operation.objects.filter(task=task)}
    with time_machine.travel(clock.now() + timedelta(seconds=settings.LONGHAUL_LEASE_SECONDS + 1), tick=True):
        task = run_to_end(task)
    assert task.status == TaskStatus.SUCCEEDED
    assert "recovered" in task.events.values_list("kind", flat=True)
    after = {op.key: op.attempts for op in Operation.objects.filter(task=task)}
    assert all(after[key] == attempts for key, attempts in before.items()), "finished calls were not run again"
    assert all(a == 1 for a in after.values())
    assert not Operation.objects.filter(task=task).exclude(status=OperationStatus.SUCCEEDED).exists()


def test_a_model_call_budget_ends_partial_with_a_scoped_report(acme, alice):
    # plan (1) + one extract per sub-question fit; the draft does not.
    calls = 1 + len(plan_subquestions(QUESTION, 3))
    task = run_to_end(submit(acme, alice, budget={"max_model_calls": calls}))
    assert task.status == TaskStatus.PARTIAL, (task.status, task.error_message)
    assert task.result["scope"].startswith("covers sub-questions")
    assert "Partial report" in task.result["report"]
    partial = task.events.get(kind="partial")
    assert f"model-call budget of {calls}" in partial.data["scope"]


GIL = "What is the global interpreter lock and how does it affect threads versus multiprocessing?"


def test_the_report_answers_first_and_links_each_source_to_its_section_here_and_on_docs_python_org(acme, alice):
    task = run_to_end(submit(acme, alice, input={"question": GIL}))
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    report = task.result["report"]

    answer = report.split("\n\n", 1)[0]
    assert not answer.startswith("#") and 2 <= len(re.findall(r"\[\d+\]", answer)) <= 4, answer
    assert "only one thread executes Python bytecode at a time" in answer  # the glossary's definition
    sources = {s["n"]: s for s in task.result["sources"]}
    assert any(s["url"] == "corpus://docs/glossary.html#term-global-interpreter-lock" for s in sources.values())
    assert not any("global-statement" in s["url"] or "setdlopenflags" in s["url"] for s in sources.values())
    assert "*Read offline from the Python 3.11 documentation (python3.11-doc).*" in report
    for n, source in sources.items():
        label = markdown_text(source["title"])
        link = f"[{n}] [{label}](/tasks/{task.public_id}/sources/{n}/) — {source['origin_url']}"
        assert link in report, link
        assert source["origin_url"].startswith("https://docs.python.org/3.11/")
    body = report.split("\n## Sources\n", 1)[0]
    for quote in {e["quote"] for e in task.result["evidence"]}:
        assert body.count(markdown_text(quote.rstrip("."))) <= 1, quote  # no quote used twice


def test_the_cited_section_opens_in_longhaul_with_its_quotes_marked_and_only_for_those_who_may_see_it(
        acme, alice, client, django_user_model):
    from tests.conftest import make_user

    task = run_to_end(submit(acme, alice, input={"question": GIL}))
    source = next(s for s in task.result["sources"] if s["url"].endswith("#term-global-interpreter-lock"))
    quoted = next(e["quote"] for e in task.result["evidence"] if e["n"] == source["n"])
    page = f"/tasks/{task.public_id}/sources/{source['n']}/"

    client.force_login(alice)
    response = client.get(page)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1 id=\"source-title\">global interpreter lock</h1>" in html
    assert f"<mark>{escape(quoted)}</mark>" in html
    assert 'href="https://docs.python.org/3.11/glossary.html#term-global-interpreter-lock"' in html
    assert client.get(f"/tasks/{task.public_id}/sources/99/").status_code == 404

    other_tenant = make_user("mallory", Tenant.objects.create(name="Globex", slug="globex-x"))
    client.force_login(other_tenant)
    assert client.get(page).status_code == 404
    same_tenant_member = make_user("bobby", acme)
    client.force_login(same_tenant_member)
    assert client.get(page).status_code == 404  # another member's task, not an admin
    admin = make_user("ada", acme, role=Membership.Role.ADMIN)
    client.force_login(admin)
    assert client.get(page).status_code == 200  # a tenant admin sees the tenant's tasks


def test_a_source_no_longer_in_the_corpus_shows_its_quotes_and_says_so(acme, alice, client):
    task = run_to_end(submit(acme, alice, input={"question": GIL}))
    result = task.result
    n = result["sources"][0]["n"]
    result["sources"][0]["url"] = "corpus://docs/library/gone.html#vanished"
    Task.objects.filter(pk=task.pk).update(result=result)
    quoted = next(e["quote"] for e in result["evidence"] if e["n"] == n)

    client.force_login(alice)
    html = client.get(f"/tasks/{task.public_id}/sources/{n}/").content.decode()

    assert "This section is not in the offline corpus now: here are the quotes." in html
    assert f"<mark>{escape(quoted)}</mark>" in html


def test_bad_research_input_names_the_field(alice_api):
    response = alice_api.post("/api/tasks", {"kind": "research", "input": {"question": "x"}}, format="json")
    assert response.status_code == 400 and response.json()["field"] == "input.question"
    response = alice_api.post("/api/tasks", {"kind": "research", "input": {"question": "why?", "depth": 9}},
                              format="json")
    assert response.status_code == 400 and response.json()["field"] == "input.depth"
