"""What the model proposes waits for the user (chat/proposals.py): a remote tool call or a cancel the
model asks for on its own is a card in the thread, and nothing runs until the thread's owner confirms.

The model is the loopback fake OpenAI server, scripted tool call by tool call. The agent reaches the
database from a thread of its own (sync_to_async), so these tests commit their rows (transaction=True).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from chat import proposals
from chat.models import Message, Proposal, Run, Thread
from chat.runs import start_run
from tasks.mcp import config
from tasks.models import AuditEntry, Task
from tasks.statuses import TaskStatus
from tests.conftest import api_client_for
from tests.factories import make_task
from tests.fakes.openai_server import FakeOpenAI, Reply, serving_as_the_model
from tests.integration.chatting import run_queued

pytestmark = pytest.mark.django_db(transaction=True)

CONFIGURED = "reports-internal"  # a server's configured name: never shown to users
TITLE = "Report Studio"


@pytest.fixture
def servers_file(tmp_path, settings):
    """Two servers: Report Studio (confirm, the default) and Trusted Tools (confirm = false)."""
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {
        CONFIGURED: {"transport": "http", "url": "http://127.0.0.1:9/mcp", "title": TITLE},
        "trusted-internal": {"transport": "http", "url": "http://127.0.0.1:9/mcp", "title": "Trusted Tools",
                             "confirm": False},
    }}))
    settings.LONGHAUL_MCP_SERVERS = str(path)
    return path


@pytest.fixture
def model(settings) -> Iterator[FakeOpenAI]:
    with serving_as_the_model(settings, default=Reply(content="Done."), model="fake-model") as server:
        yield server


@pytest.fixture
def thread(acme, alice) -> Thread:
    return Thread.objects.create(tenant=acme, owner=alice, title="reports")


def tool_call(name: str, arguments: dict[str, Any]) -> Reply:
    return Reply(content=None, tool_calls=[{"id": "call_1", "type": "function",
                                            "function": {"name": name, "arguments": json.dumps(arguments)}}])


def chat(model: FakeOpenAI, thread: Thread, text: str, *replies: Reply) -> Run:
    """One user turn answered by the scripted model, as a chat worker would."""
    model.script(*replies)
    run, _ = start_run(thread, kind=Run.Kind.CHAT, user_text=text, hidden=False, key=None)
    run_queued()
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED, run.error
    return run


REMOTE = {"server": TITLE, "tool": "build_report", "arguments": {"quarter": "Q3", "note": "<b>bold</b>"},
          "name": "Q3 report"}


def propose_remote(model: FakeOpenAI, thread: Thread, **overrides: Any) -> Proposal:
    chat(model, thread, "the page says to build the report", tool_call("start_remote_tool", {**REMOTE, **overrides}),
         Reply(content="I asked you to confirm the report."))
    return Proposal.objects.get()


def decide(client, thread: Thread, proposal: Proposal, decision: Any):
    return client.post(f"/api/threads/{thread.public_id}/proposals/{proposal.public_id}",
                       {"decision": decision}, format="json")


def cards(thread: Thread) -> list[Message]:
    return [m for m in Message.objects.filter(thread=thread) if "proposal" in m.data]


# --- proposing -------------------------------------------------------------------------------------


def test_it_shows_a_card_and_starts_nothing_when_the_model_proposes_a_remote_tool(
        servers_file, model, thread, alice_api):
    proposal = propose_remote(model, thread)

    assert not Task.objects.exists()
    assert proposal.status == Proposal.Status.PENDING and proposal.action == "start_remote_tool"
    assert proposal.arguments["server"] == CONFIGURED
    (card,) = cards(thread)
    assert card.role == Message.Role.ASSISTANT and "build_report" in card.content
    # The model heard that nothing ran, and said so.
    told = model.requests[1]["messages"][-1]["content"]
    assert "Waiting for the user to confirm" in told
    assert Message.objects.filter(thread=thread, role="assistant").last().content == "I asked you to confirm the report."

    page = alice_api.get(f"/api/threads/{thread.public_id}/messages").json()
    (shown,) = [m["proposal"] for m in page["results"] if m["proposal"]]
    assert shown == {"id": str(proposal.public_id), "action": "start_remote_tool", "status": "pending",
                     "name": "Q3 report", "server": TITLE, "tool": "build_report",
                     "arguments": {"quarter": "Q3", "note": "<b>bold</b>"}, "outcome": "",
                     "created_at": shown["created_at"], "decided_at": None}
    assert CONFIGURED not in json.dumps(page)


def test_it_runs_a_trusted_servers_tool_at_once_without_a_card(servers_file, model, thread):
    chat(model, thread, "build it", tool_call("start_remote_tool", {**REMOTE, "server": "Trusted Tools"}),
         Reply(content="Started."))

    task = Task.objects.get()
    assert task.kind == "mcp" and task.input["server"] == "trusted-internal"
    assert not Proposal.objects.exists() and not cards(thread)


def test_a_proposal_the_driver_would_refuse_is_answered_to_the_model_without_a_card(servers_file, model, thread):
    chat(model, thread, "build it", tool_call("start_remote_tool", {**REMOTE, "tool": ""}), Reply(content="Sorry."))

    assert "input.tool" in model.requests[1]["messages"][-1]["content"]
    assert not Proposal.objects.exists() and not cards(thread) and not Task.objects.exists()


def test_a_typed_command_runs_at_once_without_asking(servers_file, thread, acme, alice):
    # The offline provider reads what the user typed: the user's own command is not a proposal.
    start_run(thread, kind=Run.Kind.CHAT, user_text="run build_report on Report Studio", hidden=False, key=None)
    run_queued()

    assert Task.objects.get().input["server"] == CONFIGURED
    assert not Proposal.objects.exists()


def test_a_replayed_run_proposes_once(servers_file, thread, acme):
    run = Run.objects.create(thread=thread, tenant=acme, created_at=thread.created_at)
    for _ in range(2):
        proposals.propose_remote_tool(run, server=TITLE, tool="build_report", arguments={}, name="", n=0)

    assert Proposal.objects.count() == 1 and len(cards(thread)) == 1


# --- deciding ---------------------------------------------------------------------------------------


def test_it_starts_exactly_one_task_when_confirmed_and_refuses_a_second_confirm(
        servers_file, model, thread, alice, alice_api):
    proposal = propose_remote(model, thread)

    answer = decide(alice_api, thread, proposal, "confirm")

    assert answer.status_code == 200, answer.json()
    assert answer.json()["status"] == "confirmed" and answer.json()["decided_at"]
    task = Task.objects.get()
    assert (task.kind, task.name, task.owner_id, task.thread_id) == ("mcp", "Q3 report", alice.pk, thread.pk)
    assert task.input == {"server": CONFIGURED, "tool": "build_report",
                          "arguments": {"quarter": "Q3", "note": "<b>bold</b>"}}
    (told,) = deciding(thread, proposal)
    assert told.role == "assistant" and "Started" in told.content and told.data["started"] == str(task.public_id)
    proposal.refresh_from_db()
    assert proposal.decided_by_id == alice.pk and proposal.outcome == told.content
    assert AuditEntry.objects.filter(action="proposal.confirm", target_id=str(proposal.public_id)).count() == 1

    again = decide(alice_api, thread, proposal, "confirm")

    assert again.status_code == 409 and again.json()["code"] == "already_decided"
    assert Task.objects.count() == 1
    assert len(deciding(thread, proposal)) == 1


def test_two_confirms_at_once_start_one_task(servers_file, model, thread, alice):
    proposal = propose_remote(model, thread)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def confirm() -> None:
        barrier.wait()
        try:
            proposals.decide(proposal, user=alice, decision="confirm")
            outcomes.append("confirmed")
        except proposals.AlreadyDecided:
            outcomes.append("already_decided")
        finally:
            connections.close_all()

    workers = [threading.Thread(target=confirm) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert sorted(outcomes) == ["already_decided", "confirmed"]
    assert Task.objects.count() == 1


def test_the_confirmed_action_keeps_the_runs_key_for_the_tool_call(servers_file, model, thread, alice):
    # The second guard: were the proposal's row ever confirmed twice, the task's key would find the first task.
    proposal = propose_remote(model, thread)
    proposals.decide(proposal, user=alice, decision="confirm")
    Proposal.objects.filter(pk=proposal.pk).update(status=Proposal.Status.PENDING)

    proposals.decide(proposal, user=alice, decision="confirm")

    assert Task.objects.count() == 1


def test_it_starts_nothing_when_declined(servers_file, model, thread, alice, alice_api):
    proposal = propose_remote(model, thread)

    answer = decide(alice_api, thread, proposal, "decline")

    assert answer.status_code == 200 and answer.json()["status"] == "declined"
    assert not Task.objects.exists()
    (told,) = deciding(thread, proposal)
    assert "nothing was run" in told.content
    assert decide(alice_api, thread, proposal, "confirm").status_code == 409
    assert not Task.objects.exists()
    shown = alice_api.get(f"/api/threads/{thread.public_id}/proposals/{proposal.public_id}").json()
    assert shown["status"] == "declined" and shown["outcome"] == told.content


def test_a_model_proposed_cancel_waits_for_the_confirm(servers_file, model, thread, acme, alice, alice_api):
    task = make_task(acme, alice, thread=thread, name="Quarterly research")

    chat(model, thread, "the report says to stop", tool_call("cancel_background_task", {"name": "quarterly"}),
         Reply(content="Confirm the cancel, please."))

    task.refresh_from_db()
    assert task.cancel_requested_at is None and task.status == TaskStatus.QUEUED
    proposal = Proposal.objects.get()
    assert proposal.arguments == {"task": str(task.public_id), "name": "Quarterly research"}
    shown = alice_api.get(f"/api/threads/{thread.public_id}/messages").json()["results"]
    (card,) = [m["proposal"] for m in shown if m["proposal"]]
    assert card["action"] == "cancel_background_task" and card["name"] == "Quarterly research"
    assert card["server"] is None and card["arguments"] is None

    assert decide(alice_api, thread, proposal, "confirm").status_code == 200

    task.refresh_from_db()
    assert task.cancel_requested_at is not None or task.status == TaskStatus.CANCELLED


def test_a_cancel_of_an_unknown_task_is_answered_to_the_model_without_a_card(servers_file, model, thread, acme,
                                                                            alice):
    make_task(acme, alice, thread=thread, name="Quarterly research")

    chat(model, thread, "stop it", tool_call("cancel_background_task", {"name": "nonexistent"}),
         Reply(content="No such task."))

    assert "No task matches" in model.requests[1]["messages"][-1]["content"]
    assert not Proposal.objects.exists()


# --- who may decide, and what -------------------------------------------------------------------------


def test_another_tenants_or_owners_user_gets_404_and_decides_nothing(servers_file, model, thread, acme, bob,
                                                                     charlie_api):
    proposal = propose_remote(model, thread)
    bob_api = api_client_for(bob)

    for client in (charlie_api, bob_api):
        assert decide(client, thread, proposal, "confirm").status_code == 404
        assert client.get(f"/api/threads/{thread.public_id}/proposals/{proposal.public_id}").status_code == 404

    # Another thread of alice's own does not reach it either.
    other = Thread.objects.create(tenant=acme, owner=thread.owner, title="other")
    assert decide(api_client_for(thread.owner), other, proposal, "confirm").status_code == 404
    proposal.refresh_from_db()
    assert proposal.status == "pending" and not Task.objects.exists()


def test_an_unknown_proposal_is_404(thread, alice_api):
    for proposal_id in ("00000000-0000-0000-0000-000000000000", "not-a-uuid"):
        answer = alice_api.post(f"/api/threads/{thread.public_id}/proposals/{proposal_id}",
                                {"decision": "confirm"}, format="json")
        assert answer.status_code == 404 and answer.json()["code"] == "not_found"


@pytest.mark.parametrize("body", [{"decision": "yes"}, {"decision": 1}, {"decision": True}, {}])
def test_a_bad_decision_is_400_naming_the_field_and_writes_nothing(servers_file, model, thread, alice_api, body):
    proposal = propose_remote(model, thread)
    before = Message.objects.count()

    answer = alice_api.post(f"/api/threads/{thread.public_id}/proposals/{proposal.public_id}", body, format="json")

    assert answer.status_code == 400
    assert answer.json()["field"] == "decision" and answer.json()["code"] == "invalid_input"
    proposal.refresh_from_db()
    assert proposal.status == "pending" and Message.objects.count() == before and not Task.objects.exists()


# --- the servers file ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["no", 0, None, [True]])
def test_a_servers_file_with_a_non_boolean_confirm_names_the_field(tmp_path, value):
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"reports": {"transport": "http", "url": "http://127.0.0.1:9/mcp",
                                                        "confirm": value}}}))

    with pytest.raises(ImproperlyConfigured, match=r"server 'reports': confirm must be true or false"):
        config.read(str(path))


def test_confirm_defaults_to_true(tmp_path):
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"reports": {"transport": "http", "url": "http://127.0.0.1:9/mcp"}}}))

    assert config.read(str(path))["reports"].confirm is True



def deciding(thread, proposal) -> list[Message]:
    """The thread's messages that tell the proposal's decision (their data is sealed: read, not queried)."""
    return [m for m in Message.objects.filter(thread=thread) if m.data.get("decides") == str(proposal.public_id)]
