"""Logs keep task input out of INFO and above, and no secret survives the redaction filter at any level."""

from __future__ import annotations

import logging
import uuid

import pytest
from django.conf import settings as django_settings

from project.logging import REDACTED, RedactSecrets
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.integration.chatting import run_queued
from tests.integration.test_research import run_to_end

MARKER = f"zebra{uuid.uuid4().hex[:10]}"
MODEL_KEY = f"sk-planted-{uuid.uuid4().hex}"
BEARER = f"Bearer {uuid.uuid4().hex}{uuid.uuid4().hex}"
log = logging.getLogger("longhaul.redaction_test")


@pytest.fixture
def planted(settings, caplog) -> list[str]:
    """Secrets in settings, and every record from DEBUG up captured."""
    settings.LONGHAUL_MODEL_API_KEY = MODEL_KEY
    settings.LONGHAUL_METRICS_TOKEN = f"metrics-{uuid.uuid4().hex}"
    settings.LONGHAUL_STEP_SLICE_MS = 0
    caplog.set_level(logging.DEBUG)
    return [MODEL_KEY, settings.LONGHAUL_METRICS_TOKEN, settings.SECRET_KEY, BEARER.split()[1]]


def texts(record: logging.LogRecord) -> str:
    return f"{record.getMessage()}\n{record.exc_text or ''}\n{record.stack_info or ''}"


def assert_nothing_leaked(records: list[logging.LogRecord], secrets: list[str]) -> None:
    for record in records:
        if record.levelno >= logging.INFO:
            assert MARKER not in texts(record), f"task input logged at {record.levelname}: {record.getMessage()}"
        for secret in secrets:
            assert secret not in texts(record), f"a secret survived in {record.name}: {record.getMessage()}"


def test_the_console_handler_carries_the_redaction_filter():
    console = [h for h in logging.getLogger().handlers
               if any(isinstance(f, RedactSecrets) for f in h.filters)]
    assert console, "settings.LOGGING wires RedactSecrets on the root's handler"


@pytest.mark.django_db(transaction=True)
def test_a_research_task_logs_neither_its_input_at_info_nor_any_secret(acme, alice_api, planted, caplog):
    question = f"How does asyncio task cancellation work? {MARKER} Authorization: {BEARER} key {MODEL_KEY}"
    response = alice_api.post("/api/tasks", {"kind": "research", "input": {"question": question}}, format="json")
    assert response.status_code == 201, response.content
    task = run_to_end(Task.objects.get())
    assert task.status in (TaskStatus.SUCCEEDED, TaskStatus.PARTIAL), (task.error_class, task.error_message)
    assert_nothing_leaked(caplog.records, planted)


@pytest.mark.django_db(transaction=True)
def test_a_chat_turn_and_its_task_log_neither_the_text_at_info_nor_any_secret(acme, alice_api, planted, caplog):
    thread_id = alice_api.post("/api/threads", {"title": ""}, format="json").json()["id"]
    text = f"research how asyncio cancellation works {MARKER} {BEARER}"
    assert alice_api.post(f"/api/threads/{thread_id}/messages", {"content": text}, format="json").status_code == 202
    run_queued()
    task = run_to_end(Task.objects.get())
    run_queued()  # the notification of the finished task, told in the thread
    assert MARKER in task.input["question"]
    assert_nothing_leaked(caplog.records, planted)


# --- the filter itself, through the configured handler --------------------------------

@pytest.mark.parametrize(
    ("message", "args", "kept"),
    [
        ("model call with key %s", (MODEL_KEY,), "model call with key"),
        ("headers: %r", ({"Authorization": BEARER, "Accept": "application/json"},), "application/json"),
        ("calling %s", (f"Authorization: {BEARER}",), "Authorization: "),
        ("api token %s", ("Token " + "ab12" * 10,), "api token Token "),
        ("connecting to %s", ("postgres://longhaul:hunter2-secret@db:5432/longhaul",), "postgres://longhaul:"),
        ("conninfo %s", ("dbname=longhaul user=longhaul password=hunter2-secret host=db",), "host=db"),
        ("config %s", ('{"api_key": "abc123xyz789", "model": "gpt"}',), '"model": "gpt"'),
        ("login with password=%s from %s", ("correct-horse-battery", "10.0.0.1"), "from 10.0.0.1"),
        ("plain %s", ("sk-proj-AbCdEf0123456789",), "plain "),
    ],
)
def test_secrets_are_redacted_at_every_level(planted, caplog, message, args, kept):
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        log.log(level, message, *args)
    records = [r for r in caplog.records if r.name == log.name]
    assert len(records) == 4
    for record in records:
        text = record.getMessage()
        assert REDACTED in text
        assert kept in text, "the rest of the line survives"
        for secret in (MODEL_KEY, BEARER.split()[1], "ab12" * 10, "hunter2-secret", "abc123xyz789",
                       "correct-horse-battery", "sk-proj-AbCdEf0123456789"):
            assert secret not in text


def test_the_secret_key_setting_is_redacted_wherever_it_appears(planted, caplog):
    log.warning("signing with %s failed", django_settings.SECRET_KEY)
    assert django_settings.SECRET_KEY not in caplog.records[-1].getMessage()


def test_a_traceback_is_redacted_too(planted, caplog):
    try:
        raise RuntimeError(f"upstream refused key {MODEL_KEY}")
    except RuntimeError:
        log.exception("model call failed")
    record = caplog.records[-1]
    assert "RuntimeError: upstream refused key [redacted]" in record.exc_text
    assert MODEL_KEY not in record.exc_text
    assert MODEL_KEY not in logging.getLogger().handlers[0].format(record)


def test_ordinary_lines_are_left_alone(planted, caplog):
    log.info("task %s: step %s done in %.1f s; token budget 2000", 42, 3, 1.5)
    assert caplog.records[-1].getMessage() == "task 42: step 3 done in 1.5 s; token budget 2000"
