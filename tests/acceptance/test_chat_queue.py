"""Chat runs have a queue and workers of their own: while every chat worker waits on a slow model,
task steps keep flowing on the task workers, and the waiting answers all arrive once the model replies."""

from __future__ import annotations

import pytest
from django.db import connection

from chat import runs
from chat.models import Message, Run, Thread
from tasks.models import Task
from tasks.statuses import TaskStatus
from tests.factories import submit_sleep
from tests.fakes.openai_server import FakeOpenAI, Reply
from tests.processes import qcluster, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]


def fresh(query):
    connection.close()  # see the workers' commits with a fresh snapshot
    return query()


def test_task_steps_flow_while_every_chat_worker_waits_on_the_model(acme, alice, log_dir):
    with FakeOpenAI(default=Reply(content="Here is my answer.")) as model:
        gate = model.hold(lambda body: True)
        env = {"LONGHAUL_MODEL_PROVIDER": "openai", "LONGHAUL_MODEL_BASE_URL": model.base_url,
               "LONGHAUL_MODEL": "fake-model", "LONGHAUL_MODEL_API_KEY": "test-key"}
        with qcluster(log_dir, workers=1, **env):
            threads = [Thread.objects.create(tenant=acme, owner=alice, title=f"thread {n}") for n in range(3)]
            chats = [runs.start_run(t, kind=Run.Kind.CHAT, user_text="hello?", hidden=False, key=None)[0]
                     for t in threads]
            # The one chat worker is answering, held at the model.
            wait_until(lambda: model.held >= 1, timeout=60, message="a chat run waiting on the model")

            task = submit_sleep(acme, alice, steps=3)
            wait_until(lambda: fresh(lambda: Task.objects.get(pk=task.pk).status) == TaskStatus.SUCCEEDED,
                       timeout=60, message="the sleep task to finish while the chat worker is busy")
            assert fresh(lambda: Run.objects.filter(pk__in=[r.pk for r in chats],
                                                    status=Run.Status.SUCCEEDED).count()) == 0

            gate.set()
            wait_until(lambda: fresh(lambda: Run.objects.filter(pk__in=[r.pk for r in chats],
                                                                status=Run.Status.SUCCEEDED).count()) == 3,
                       timeout=90, message="every chat run to answer once the model replies")
        replies = Message.objects.filter(thread__in=threads, role=Message.Role.ASSISTANT)
        assert sorted(replies.values_list("content", flat=True)) == ["Here is my answer."] * 3
