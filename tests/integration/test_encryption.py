"""Content at rest (DESIGN §14): sealed with a per-tenant data key, never in a column in the clear, shown as
before through the API; tampering detected; keys rotated and destroyed."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid

import pytest
from django.core.exceptions import FieldError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from chat.models import Message, Thread
from project import master_keys
from tasks import clock, crypto, jobs, sealed
from tasks.errors import TamperedContent
from tasks.models import AuditEntry, Checkpoint, Operation, Task, TaskEvent, TenantKey
from tasks.statuses import TaskStatus
from tests import stored
from tests.factories import make_task
from tests.integration.chatting import run_queued
from tests.integration.test_research import run_to_end
from webhooks.models import Delivery

pytestmark = pytest.mark.django_db
MARKER = f"kumquat{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def _fresh_keys():
    crypto.forget_cached_keys()
    yield
    crypto.forget_cached_keys()


def tables_holding(text: str) -> dict[str, int]:
    """Every table whose rows, cast to text whole (every column), contain `text`."""
    found = {}
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            columns = [c.name for c in connection.introspection.get_table_description(cursor, table)]
            where = " OR ".join(f"CAST({quote(c)} AS TEXT) LIKE %s" for c in columns)
            cursor.execute(f"SELECT COUNT(*) FROM {quote(table)} WHERE {where}", [f"%{text}%"] * len(columns))
            (n,) = cursor.fetchone()
            if n:
                found[table] = n
    return found


def plant_everywhere(api) -> dict[str, object]:
    """The marker in every sealed kind of content, through the public API."""
    hook = api.post("/api/webhooks", {"url": "http://127.0.0.1:9/hook", "events": ["task.succeeded"]}, format="json")
    assert hook.status_code == 201, hook.content
    research = api.post("/api/tasks", {"kind": "research", "name": "Sealed research",
                                       "input": {"question": f"How does asyncio cancel a task {MARKER}?"}},
                        format="json")
    assert research.status_code == 201, research.content
    asking = api.post("/api/tasks", {"kind": "sleep", "name": "Sealed question", "input": {"steps": 2,
                                                                                        "ask_at_step": 1}},
                      format="json")
    assert asking.status_code == 201, asking.content
    asked = Task.objects.get(public_id=asking.json()["id"])
    for _ in range(5):
        asked.refresh_from_db()
        if asked.status == TaskStatus.WAITING_INPUT:
            break
        jobs.advance(asked.pk)
    answered = api.post(f"/api/tasks/{asked.public_id}/answer", {"answer": f"go on {MARKER}"}, format="json")
    assert answered.status_code in (200, 202), answered.content
    thread_id = api.post("/api/threads", {"title": ""}, format="json").json()["id"]  # its first message names it
    said = api.post(f"/api/threads/{thread_id}/messages", {"content": f"hello {MARKER}"}, format="json")
    assert said.status_code == 202, said.content
    run_queued()
    return {"research": run_to_end(Task.objects.get(public_id=research.json()["id"])),
            "asked": run_to_end(asked), "thread": thread_id}


@pytest.mark.smoke
@pytest.mark.django_db(transaction=True)
def test_no_column_of_any_table_holds_content_in_the_clear_and_the_api_shows_it_as_before(acme, alice_api,
                                                                                           settings):
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True  # the webhook's receiver is on loopback
    planted = plant_everywhere(alice_api)
    research, asked = planted["research"], planted["asked"]
    assert research.status == TaskStatus.SUCCEEDED and asked.status == TaskStatus.SUCCEEDED
    # The marker went into every sealed kind of content...
    assert Checkpoint.objects.filter(task=research).exists() and Operation.objects.filter(task=research).exists()
    assert any(MARKER in json.dumps(op.args) for op in Operation.objects.filter(task=research))
    assert any(MARKER in json.dumps(e.data) for e in TaskEvent.objects.filter(task=research))
    assert MARKER in Task.objects.get(pk=asked.pk).answer
    assert any(MARKER in d.body for d in Delivery.objects.filter(task=research)), "a webhook body waiting to go"

    assert tables_holding(MARKER) == {}, "content in the clear"

    # ...and every reader sees it as before.
    body = alice_api.get(f"/api/tasks/{research.public_id}").json()
    assert MARKER in body["input"]["question"]
    assert MARKER in json.dumps(alice_api.get(f"/api/tasks/{research.public_id}/result").json())
    assert MARKER in json.dumps(alice_api.get(f"/api/tasks/{research.public_id}/events").json())
    messages = alice_api.get(f"/api/threads/{planted['thread']}/messages").json()["results"]
    assert any(m["content"] == f"hello {MARKER}" for m in messages)
    assert alice_api.get(f"/api/threads/{planted['thread']}").json()["title"] == f"hello {MARKER}"


@pytest.mark.django_db(transaction=True)
def test_the_scan_finds_content_written_with_encryption_off(acme, alice_api, settings):
    """The check above can fail: the same content, unsealed, is found."""
    settings.LONGHAUL_ENCRYPT_AT_REST = False
    settings.LONGHAUL_ALLOW_PRIVATE_FETCH = True
    plant_everywhere(alice_api)
    found = tables_holding(MARKER)
    for table in ("tasks_task", "tasks_checkpoint", "tasks_operation", "tasks_taskevent", "chat_message", "chat_run",
                  "chat_thread", "webhooks_delivery"):
        assert table in found, found


def test_a_tampered_or_moved_value_is_an_error_never_a_value(acme, alice, globex, charlie, alice_api):
    ours = make_task(acme, alice, status=TaskStatus.SUCCEEDED, input={"question": "ours"}, result={"report": "x"})
    theirs = make_task(globex, charlie, status=TaskStatus.SUCCEEDED, input={"question": "theirs"})
    raw = dict(Task.objects.filter(pk=ours.pk).values_list("pk", "input"))  # opened...
    stored_input, stored_result = (stored.read("tasks_task", column, [ours.pk])[ours.pk]
                                   for column in ("input", "result"))
    token = json.loads(stored_input)[sealed.JSON_KEY]
    assert raw[ours.pk] == {"question": "ours"} and crypto.is_token(token)

    flipped = token[:-6] + ("A" if token[-6] != "A" else "B") + token[-5:]
    cases = {
        "a changed byte": (ours.pk, "input", json.dumps({sealed.JSON_KEY: flipped})),
        "another column's value": (ours.pk, "input", stored_result),
        "another tenant's row": (theirs.pk, "input", stored_input),
    }
    for what, (pk, column, value) in cases.items():
        stored.write("tasks_task", column, pk, value)
        with pytest.raises(TamperedContent, match="failed its integrity check|sealed for another tenant"):
            Task.objects.get(pk=pk)
        if pk == ours.pk:
            response = alice_api.get(f"/api/tasks/{ours.public_id}")
            assert response.status_code == 500 and response.json()["code"] == "content_tampered", what
            assert "ours" not in response.content.decode()
        # put it back for the next case
        stored.write("tasks_task", column, pk, stored_input if pk == ours.pk else json.dumps({"question": "theirs"}))


def test_destroying_a_tenants_key_erases_its_content_and_only_its(acme, alice, globex, charlie, alice_api, root,
                                                                   root_client):
    thread = Thread.objects.create(tenant=acme, owner=alice, title="t")
    message = Message.objects.create(thread=thread, role="user", content="our words", created_at=task_now())
    ours = make_task(acme, alice, status=TaskStatus.SUCCEEDED, input={"question": "ours"}, result={"report": "r"})
    theirs = make_task(globex, charlie, status=TaskStatus.SUCCEEDED, input={"question": "theirs"})
    changelist = reverse("admin:tasks_tenant_changelist")
    step = {"action": "destroy_data_key", "_selected_action": [acme.pk]}
    client = root_client
    assert "Type <code>acme</code> to confirm" in client.post(changelist, step).content.decode()
    assert TenantKey.objects.filter(tenant=acme, destroyed_at__isnull=True).exists(), "the first step destroys nothing"

    done = client.post(changelist, {**step, "confirm_slug": "acme"}, follow=True)

    assert "Destroyed 1 data key version of acme" in done.content.decode()
    assert Task.objects.get(pk=ours.pk).input == sealed.ERASED_JSON
    assert Message.objects.get(pk=message.pk).content == sealed.ERASED_TEXT
    body = alice_api.get(f"/api/tasks/{ours.public_id}").json()
    assert body["input"] == sealed.ERASED_JSON and body["status"] == "succeeded", "the row stays, its content is gone"
    assert Task.objects.get(pk=theirs.pk).input == {"question": "theirs"}
    entry = AuditEntry.objects.get(action="tenant.key_destroyed")
    assert entry.actor == root and entry.tenant == acme and entry.details == {"versions": 1}
    fresh = make_task(acme, alice, input={"question": "after"})
    assert Task.objects.get(pk=fresh.pk).input == {"question": "after"}, "new content gets a new key"
    assert TenantKey.objects.get(tenant=acme, destroyed_at__isnull=True).version == 2


def test_rotating_the_master_key_rewraps_every_data_key(acme, alice, globex, charlie, settings):
    old = dict(settings.LONGHAUL_MASTER_KEYS)
    ours = make_task(acme, alice, input={"question": "ours"})
    make_task(globex, charlie, input={"question": "theirs"})
    new_id, new_key = master_keys.generate("k-next").split(":", 1)
    settings.LONGHAUL_MASTER_KEYS = {new_id: base64.b64decode(new_key), **old}

    call_command("rotate_master_key")

    assert set(TenantKey.objects.values_list("master_key_id", flat=True)) == {new_id}
    settings.LONGHAUL_MASTER_KEYS = {new_id: base64.b64decode(new_key)}  # the old key retired
    crypto.forget_cached_keys()
    assert Task.objects.get(pk=ours.pk).input == {"question": "ours"}


def test_a_data_key_whose_master_key_is_gone_says_which_to_add_back(acme, alice, settings):
    ours = make_task(acme, alice, input={"question": "ours"})
    wrapped_by = crypto.current_master_id()
    settings.LONGHAUL_MASTER_KEYS = {"k-other": os.urandom(32)}
    crypto.forget_cached_keys()
    with pytest.raises(crypto.KeyUnavailable, match=f"master key '{wrapped_by}' is not in LONGHAUL_MASTER_KEYS"):
        Task.objects.get(pk=ours.pk)
    with pytest.raises(CommandError, match=f"master key '{wrapped_by}' is not in LONGHAUL_MASTER_KEYS"):
        call_command("rotate_master_key")


def test_rotating_a_tenants_key_reseals_its_rows_and_seals_old_plain_ones(acme, alice, globex, charlie, settings):
    settings.LONGHAUL_KEY_CACHE_SECONDS = 0  # nothing to wait out: no other process caches a key here
    settings.LONGHAUL_ENCRYPT_AT_REST = False
    legacy = make_task(acme, alice, input={"question": "written before"})
    settings.LONGHAUL_ENCRYPT_AT_REST = True
    sealed_before = make_task(acme, alice, input={"question": "sealed under v1"})
    theirs = make_task(globex, charlie, input={"question": "theirs"})
    assert stored_versions(Task, "input", [legacy.pk, sealed_before.pk, theirs.pk]) == [None, 1, 1]

    call_command("rotate_tenant_key", "acme", "--batch", "1")

    assert stored_versions(Task, "input", [legacy.pk, sealed_before.pk, theirs.pk]) == [2, 2, 1]
    assert Task.objects.get(pk=legacy.pk).input == {"question": "written before"}
    assert Task.objects.get(pk=sealed_before.pk).input == {"question": "sealed under v1"}
    with pytest.raises(CommandError, match="no tenant 'nobody'"):
        call_command("rotate_tenant_key", "nobody")


def stored_versions(model, column: str, pks: list[int]) -> list[int | None]:
    """The key version each row's column is sealed with (None: in the clear)."""
    values = stored.read(model._meta.db_table, column, pks)
    versions = []
    for pk in pks:
        value = json.loads(values[pk])
        token = value.get(sealed.JSON_KEY) if isinstance(value, dict) else None
        versions.append(crypto.parse(token, label=column)[1] if token else None)
    return versions


@pytest.mark.parametrize(("value", "words"), [
    ("k1:not base64!", "the key of 'k1' is not valid base64"),
    (f"k1:{base64.b64encode(b'short').decode()}", "the key of 'k1' is 5 bytes; it must be 32"),
    ("just-a-key", "entry 1 must be id:base64key"),
    ("", "LONGHAUL_MASTER_KEYS must be set"),
])
def test_a_missing_or_malformed_master_key_stops_the_process_at_start_naming_it(value, words, tmp_path):
    env = {**os.environ, "DEBUG": "0", "SECRET_KEY": "x" * 50, "LONGHAUL_MASTER_KEYS": value,
           "DJANGO_SETTINGS_MODULE": "project.settings", "LONGHAUL_VAR_DIR": str(tmp_path)}
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, capture_output=True,
                             text=True, timeout=60, check=False)
    assert started.returncode != 0
    assert "LONGHAUL_MASTER_KEYS" in started.stderr and words in started.stderr, started.stderr[-2000:]


def test_development_keeps_a_generated_master_key_in_var(tmp_path):
    first = master_keys.load("", debug=True, var_dir=tmp_path)
    again = master_keys.load("", debug=True, var_dir=tmp_path)
    assert first == again and len(next(iter(first.values()))) == 32
    assert (tmp_path / "master_keys").stat().st_mode & 0o777 == 0o600


def task_now():
    return clock.now()


def test_sql_may_not_compare_sealed_content_only_test_it_for_null(acme, alice):
    """An equality on a sealed column would quietly match nothing (every write has its own nonce): refused."""
    make_task(acme, alice, result={"report": "r"})
    with pytest.raises(FieldError, match="tasks_task.result is sealed: SQL cannot compare its content"):
        Task.objects.filter(result={"report": "r"}).exists()
    with pytest.raises(FieldError, match="chat_message.content is sealed"):
        Message.objects.filter(content__contains="r").exists()
    with pytest.raises(FieldError, match="tasks_task.input is sealed: SQL cannot compare or read into"):
        Task.objects.filter(input__question="q").exists()
    assert Task.objects.filter(result__isnull=False).count() == 1 and Task.objects.filter(answer_data=None).count() == 1
    assert TaskEvent.objects.filter(kind="retry_scheduled", data__error_class="x").count() == 0, \
        "a column with rows in the clear keeps its key lookups"


@pytest.mark.django_db(transaction=True)
def test_a_key_made_in_a_transaction_that_rolled_back_is_never_used(acme, alice):
    """A tenant's first write rolls back, and its new key with it: the next write must not seal with that key."""
    with pytest.raises(RuntimeError), transaction.atomic():
        make_task(acme, alice, input={"question": "rolled back"})
        raise RuntimeError("the submission failed after sealing")
    assert not TenantKey.objects.exists()
    kept = make_task(acme, alice, input={"question": "kept"})
    crypto.forget_cached_keys()  # another process, or this one once its cache expired
    assert Task.objects.get(pk=kept.pk).input == {"question": "kept"}


def key_reads(queries) -> int:
    return sum('"tasks_tenantkey"' in q["sql"] for q in queries.captured_queries)


@pytest.mark.django_db(transaction=True)
def test_a_tenants_key_is_read_once_inside_a_transaction_too(acme, alice):
    """A key row committed before the transaction that reads it is cached at once: a recorder's batch seals
    many outcomes, and a claim opens many calls, in one transaction each (they read it once per value before)."""
    make_task(acme, alice, input={"question": "makes the key"})
    crypto.forget_cached_keys()
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        tokens = [crypto.seal(acme.pk, f"value {n}".encode(), label="result") for n in range(3)]
        opened = [crypto.open_token(token, label="result")[1] for token in tokens]
    assert opened == [b"value 0", b"value 1", b"value 2"]
    assert key_reads(queries) == 1


@pytest.mark.django_db(transaction=True)
def test_keys_destroyed_in_a_transaction_that_rolled_back_still_open_what_they_sealed(acme, alice):
    """What a transaction that destroys a tenant's keys reads of them is not cached before it commits."""
    kept = make_task(acme, alice, input={"question": "kept"})
    crypto.forget_cached_keys()
    with pytest.raises(RuntimeError), transaction.atomic():
        crypto.destroy_keys(acme.pk)
        assert crypto.data_key(acme.pk, 1) is None
        raise RuntimeError("the erasure failed after destroying the keys")
    assert crypto.data_key(acme.pk, 1) is not None
    assert Task.objects.get(pk=kept.pk).input == {"question": "kept"}


@pytest.mark.django_db(transaction=True)
def test_a_key_made_in_an_open_transaction_is_cached_once_it_commits(acme, alice):
    with transaction.atomic():
        make_task(acme, alice, input={"question": "makes the key"})
        assert crypto._current == {}, "cached before its row committed"
    assert set(crypto._current) == {acme.pk}
    with CaptureQueriesContext(connection) as queries:
        make_task(acme, alice, input={"question": "sealed with the cached key"})
    assert key_reads(queries) == 0
