"""The chat agent's tool calling with the openai provider, against a loopback fake OpenAI server.

The provider is configured through settings only (as test_gateway_openai.py does), and the model is
tests/fakes/openai_server.py: a real HTTP server on 127.0.0.1 speaking the chat-completions protocol,
scripted request by request and recording every request it receives. Over three chat turns the model
calls the chat tools by their real names (chat/agent.py TOOL_SCHEMAS) to start a research task, list
the thread's tasks, cancel the task (a proposal the thread's owner confirms, chat/proposals.py), and
answers in plain text. The tests prove that:

- every request offers the chat tools, with `tool_choice: "auto"`;
- each tool result goes back to the model as a `role: "tool"` message whose `tool_call_id` is the id of
  the call it answers, after the assistant message carrying that call;
- the start call really created the task in the database, in the thread's tenant, for its owner, in
  that thread; the list call listed it; the cancel call, once confirmed, really ended it cancelled;
- the model's final text is stored in the thread once, as the run's one assistant message;
- a turn whose model never stops calling tools, or answers with nothing, still ends with a reply.

The agent reaches the database from asgiref's sync thread (sync_to_async), so the tests commit their
rows (transaction=True), as tests/integration/test_proposals.py does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from rest_framework.test import APIClient

from chat import agent
from chat.models import Message, Proposal, Thread
from tasks.models import Task
from tasks.statuses import TERMINAL, TaskStatus
from tests.fakes.openai_server import FakeOpenAI, Reply, Status, serving_as_the_model
from tests.integration.chatting import run_queued
from tests.integration.test_proposals import chat

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "fake-model"
START, LIST, CANCEL = "start_background_task", "list_background_tasks", "cancel_background_task"
NAME = "Asyncio cancellation"
QUESTION = "How does asyncio task cancellation work?"
FIRST_ANSWER = "I started the asyncio research; it is queued in the background."
SECOND_ANSWER = "Please confirm the cancel in the thread."
FINAL_ANSWER = "Nothing is running now: the asyncio research was cancelled."
# Any request beyond the script fails the run (a permanent 400), so an extra model call cannot pass unseen.
UNSCRIPTED = Status(400, body='{"error": {"message": "unscripted request"}}')

WireMessage = dict[str, Any]  # a chat-completions message as sent


@pytest.fixture
def model(settings) -> Iterator[FakeOpenAI]:
    """The fake server, named as the model provider by the settings the agent reads."""
    with serving_as_the_model(settings, default=UNSCRIPTED, model=MODEL) as server:
        yield server


@pytest.fixture
def thread(acme, alice) -> Thread:
    return Thread.objects.create(tenant=acme, owner=alice, title="asyncio")


def call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One tool call as an OpenAI server sends it: the arguments a JSON string."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def calling(*calls: dict[str, Any]) -> Reply:
    """A completion that calls tools (no text; the fake says finish_reason "tool_calls")."""
    return Reply(content=None, tool_calls=list(calls))


def offered_tools(request: dict[str, Any]) -> set[str]:
    return {tool["function"]["name"] for tool in request.get("tools") or [] if tool.get("type") == "function"}


def answered_calls(request: dict[str, Any]) -> list[tuple[str, str]]:
    """(tool_call_id, content) of the tool messages at the end of a request, after the assistant
    message that made those calls; asserts that message carries exactly those call ids, in order."""
    messages: list[WireMessage] = request["messages"]
    start = len(messages)
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    tool_messages = messages[start:]
    assert tool_messages, f"no role 'tool' message ends the request: {[m.get('role') for m in messages]}"
    assert start > 0 and messages[start - 1]["role"] == "assistant", "the tool results follow the assistant's call"
    made = [c["id"] for c in messages[start - 1].get("tool_calls") or []]
    answered = [(m["tool_call_id"], str(m["content"])) for m in tool_messages]
    assert made == [call_id for call_id, _ in answered], "each call answered once, by its own id, in order"
    return answered


def replies_in(thread: Thread, text: str) -> list[Message]:
    return [m for m in Message.objects.filter(thread=thread) if m.content == text]  # sealed: read, not queried


def confirm(client: APIClient, thread: Thread, proposal: Proposal) -> None:
    answer = client.post(f"/api/threads/{thread.public_id}/proposals/{proposal.public_id}",
                         {"decision": "confirm"}, format="json")
    assert answer.status_code == 200, answer.json()


def test_the_model_starts_lists_and_cancels_a_task_through_the_chat_tools(model, thread, acme, alice, alice_api):
    # Turn 1: start the research, list the thread's tasks, then answer.
    first = chat(model, thread, "Research how asyncio cancellation works and tell me what is running.",
                 calling(call("call_start", START, {"name": NAME, "question": QUESTION})),
                 calling(call("call_list_1", LIST, {})),
                 Reply(content=FIRST_ANSWER))

    assert model.request_count == 3
    for request in model.requests:
        assert request["model"] == MODEL
        assert {START, LIST, CANCEL} <= offered_tools(request)
        assert offered_tools(request) == {tool["function"]["name"] for tool in agent.TOOL_SCHEMAS}
        assert request["tool_choice"] == "auto"
    assert model.requests[0]["messages"][-1] == {
        "role": "user", "content": "Research how asyncio cancellation works and tell me what is running."}

    task = Task.objects.get()
    assert (task.tenant_id, task.owner_id, task.thread_id) == (acme.pk, alice.pk, thread.pk)
    assert (task.kind, task.name, task.input["question"]) == ("research", NAME, QUESTION)
    assert task.status not in TERMINAL

    ((start_id, started),) = answered_calls(model.requests[1])
    assert start_id == "call_start"
    assert f"Started “{NAME}”" in started
    ((list_id, listed),) = answered_calls(model.requests[2])
    assert list_id == "call_list_1"
    assert NAME in listed and task.status in listed
    assert [m.content for m in Message.objects.filter(run=first, role=Message.Role.ASSISTANT)] == [FIRST_ANSWER]

    # Turn 2: the model asks to cancel it; nothing stops until the owner confirms.
    chat(model, thread, "Stop that research, please.",
         calling(call("call_cancel", CANCEL, {"name": NAME})),
         Reply(content=SECOND_ANSWER))

    ((cancel_id, proposed),) = answered_calls(model.requests[4])
    assert cancel_id == "call_cancel"
    assert "Waiting for the user to confirm" in proposed
    proposal = Proposal.objects.get(thread=thread)
    assert proposal.action == Proposal.Action.CANCEL_BACKGROUND_TASK
    assert proposal.arguments == {"task": str(task.public_id), "name": NAME}
    task.refresh_from_db()
    assert task.status not in TERMINAL and task.cancel_requested_at is None

    confirm(alice_api, thread, proposal)
    run_queued()  # the cancellation's notification, told in the thread

    task.refresh_from_db()
    assert task.status == TaskStatus.CANCELLED

    # Turn 3: the model lists again, sees the cancel, and answers in plain text.
    last = chat(model, thread, "What is running now?",
                calling(call("call_list_2", LIST, {})),
                Reply(content=FINAL_ANSWER))

    assert model.request_count == 7
    ((list_id, listed),) = answered_calls(model.requests[6])
    assert list_id == "call_list_2"
    assert NAME in listed and TaskStatus.CANCELLED in listed
    (final,) = replies_in(thread, FINAL_ANSWER)
    assert (final.role, final.run_id) == (Message.Role.ASSISTANT, last.pk)
    assert Task.objects.count() == 1


def test_two_calls_in_one_completion_are_each_answered_by_their_own_id(model, thread):
    chat(model, thread, "Research asyncio cancellation, then show me the list.",
         calling(call("call_a", START, {"name": NAME, "question": QUESTION}), call("call_b", LIST, {})),
         Reply(content=FIRST_ANSWER))

    assert model.request_count == 2
    (assistant,) = [m for m in model.requests[1]["messages"] if m.get("tool_calls")]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in assistant["tool_calls"]] == [("call_a", START, {"name": NAME, "question": QUESTION}),
                                                  ("call_b", LIST, {})]
    (started_id, started), (listed_id, listed) = answered_calls(model.requests[1])
    assert (started_id, listed_id) == ("call_a", "call_b")
    assert f"Started “{NAME}”" in started
    assert NAME in listed, "the list, made after the start, lists the task it started"
    assert Task.objects.get().thread_id == thread.pk
    assert len(replies_in(thread, FIRST_ANSWER)) == 1


def test_a_model_that_never_stops_calling_tools_still_gets_a_reply(model, thread):
    rounds = agent.MAX_TOOL_ROUNDS
    run = chat(model, thread, "What is running?",
               *(calling(call(f"call_{n}", LIST, {})) for n in range(rounds)))

    assert model.request_count == rounds
    (reply,) = Message.objects.filter(run=run, role=Message.Role.ASSISTANT)
    assert reply.content == "I did what I could; see the task panel for details."


def test_an_empty_answer_is_replied_to_as_done(model, thread):
    run = chat(model, thread, "Thanks!", Reply(content=""))

    (reply,) = Message.objects.filter(run=run, role=Message.Role.ASSISTANT)
    assert reply.content == "Done."
