"""Pinned versions: a task records at submission what its behaviour depends on (code, checkpoint schema,
model, prompts, tool protocol), and each call records the model or tool protocol that ran it."""

from __future__ import annotations

import pytest
from django.conf import settings as django_settings

from tasks.drivers.research import SCHEMA_VERSION
from tasks.gateway.providers import PROMPT_VERSION
from tasks.gateway.providers.offline import OFFLINE_MODEL
from tasks.gateway.tools import TOOL_PROTOCOL
from tasks.models import Operation, Task
from tasks.statuses import TaskStatus
from tests.integration.test_research import run_to_end, submit

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _settings(settings):
    settings.LONGHAUL_STEP_SLICE_MS = 0


def test_a_research_task_records_its_model_prompts_and_tools_and_the_api_shows_model_and_prompts(alice_api):
    response = alice_api.post("/api/tasks", {"kind": "research", "input": {"question": "What is a coroutine?"}},
                              format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["model_name"], body["prompt_version"]) == (f"offline:{OFFLINE_MODEL}", PROMPT_VERSION)
    task = Task.objects.get(public_id=body["id"])
    assert (task.code_version, task.schema_version, task.tool_protocol) == (
        django_settings.LONGHAUL_CODE_VERSION, SCHEMA_VERSION, TOOL_PROTOCOL)
    assert task.code_version, "the code version is known"


def test_the_configured_model_is_what_a_task_records(alice_api, settings):
    settings.LONGHAUL_MODEL_PROVIDER = "openai"
    settings.LONGHAUL_MODEL_BASE_URL = "http://127.0.0.1:9/v1"
    settings.LONGHAUL_MODEL = "gpt-test-1"
    body = alice_api.post("/api/tasks", {"kind": "research", "input": {"question": "What is a coroutine?"}},
                          format="json").json()
    assert body["model_name"] == "openai:gpt-test-1"


def test_each_call_records_the_model_or_tool_protocol_that_ran_it(acme, alice):
    task = run_to_end(submit(acme, alice))
    assert task.status == TaskStatus.SUCCEEDED, (task.error_class, task.error_message)
    versions = set(Operation.objects.filter(task=task).values_list("kind", "name", "version"))
    assert ("model", "plan", f"offline:{OFFLINE_MODEL} prompts/{PROMPT_VERSION}") in versions
    assert ("tool", "search", f"search {TOOL_PROTOCOL}") in versions
    assert all(version for _, _, version in versions), versions


def test_a_sleep_task_pins_no_model(acme, alice):
    from tests.factories import submit_sleep

    task = submit_sleep(acme, alice)
    assert (task.model_name, task.prompt_version, task.tool_protocol) == ("", "", "")



def test_a_misconfigured_model_is_recorded_as_such_and_the_submission_stands(alice_api, settings):
    settings.LONGHAUL_MODEL_PROVIDER = "not-a-provider"
    response = alice_api.post("/api/tasks", {"kind": "research", "input": {"question": "What is a coroutine?"}},
                              format="json")
    assert response.status_code == 201, response.content
    assert response.json()["model_name"] == "model:misconfigured"
