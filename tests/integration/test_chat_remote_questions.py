"""What the thread says about remote tools: servers by display name, form questions, withdrawn questions."""

from __future__ import annotations

import json

import pytest

from chat import agent, tools
from chat.models import Run, Thread
from tasks import clock
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import make_task

pytestmark = pytest.mark.django_db

FORM = {"type": "object", "required": ["copies"], "properties": {"copies": {"type": "integer"}}}


@pytest.fixture
def servers_file(tmp_path, settings):
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"reports-internal": {
        "transport": "http", "url": "http://127.0.0.1:9/mcp", "title": "Report Studio"}}}))
    settings.LONGHAUL_MCP_SERVERS = str(path)
    return path


@pytest.fixture
def thread(acme, alice) -> Thread:
    return Thread.objects.create(tenant=acme, owner=alice, title="t")


def notification_run(thread: Thread, task: Task, version: int = 1) -> Run:
    return Run.objects.create(thread=thread, tenant=thread.tenant, kind=Run.Kind.NOTIFICATION, task=task,
                              task_version=version, created_at=clock.now())


def chat_run(thread: Thread) -> Run:
    return Run.objects.create(thread=thread, tenant=thread.tenant, created_at=clock.now())


def test_a_remote_tool_is_started_by_the_servers_display_name_and_named_by_it(servers_file, thread):
    reply = tools.start_remote_tool(chat_run(thread), server="report studio", tool="build_report", arguments={})
    assert not reply.data.get("error"), reply.text
    task = Task.objects.get()
    assert task.name == "build_report on Report Studio"
    assert task.input["server"] == "reports-internal"
    assert "reports-internal" not in reply.text


def test_an_unknown_server_is_refused_naming_only_display_names(servers_file, thread):
    reply = tools.start_remote_tool(chat_run(thread), server="elsewhere", tool="t", arguments={})
    assert reply.data["error"] and "“Report Studio”" in reply.text and "reports-internal" not in reply.text
    assert not Task.objects.exists()


def test_the_agent_offers_servers_by_display_name(servers_file, thread):
    assert tools.remote_servers(chat_run(thread)) == [{"name": "Report Studio", "description": ""}]


def test_a_form_question_is_told_with_the_form_not_the_answer_command(acme, alice, thread):
    task = make_task(acme, alice, thread=thread, kind="mcp", name="print job", status=TaskStatus.WAITING_INPUT,
                     question="How many copies?", question_form=FORM)
    text = agent.tell_about_task(notification_run(thread, task)).text
    assert "How many copies?" in text and "form" in text and "answer print job:" not in text


def test_a_withdrawn_question_is_told_as_withdrawn(acme, alice, thread):
    task = make_task(acme, alice, thread=thread, kind="mcp", name="print job", status=TaskStatus.QUEUED,
                     dispatch_version=2, dispatch_event={"event": "question_withdrawn", "status": "queued"})
    assert "no longer needs your answer" in agent.tell_about_task(notification_run(thread, task, 2)).text


@pytest.mark.parametrize("arguments", ['{"copies": 1e999}', '{"copies": NaN}', '{"copies": Infinity}'])
def test_arguments_with_numbers_jsonb_cannot_store_are_refused_in_words(servers_file, thread, arguments):
    run = Run.objects.create(thread=thread, tenant=thread.tenant, created_at=clock.now(),
                             input={"text": f"run build_report on Report Studio with {arguments}"})
    reply = agent.respond(run)
    assert reply.data.get("error") and "not valid JSON" in reply.text
    assert not Task.objects.exists()
