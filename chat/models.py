"""Conversations: threads, their messages, and runs of the chat agent."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Q
from django.utils.translation import gettext

from tasks.sealed import SealedJSONField, SealedModel, SealedQuerySet, SealedTextField


class Thread(SealedModel):
    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    tenant = models.ForeignKey("tasks.Tenant", on_delete=models.CASCADE, related_name="threads",
                               db_index=False)  # thread_owner_recent_idx leads with it
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="threads")
    # Sealed: the first message names the thread, so its title is the user's words (tasks/sealed.py).
    title = SealedTextField(blank=True)
    message_seq = models.PositiveIntegerField(default=0, help_text="The seq of the thread's newest message.")
    item_seq = models.PositiveIntegerField(default=0, help_text="The seq of the thread stream's newest item.")
    item_marks = models.JSONField(default=dict, blank=True,
                                  help_text="Per task id, the last event seq the thread stream has looked at.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = SealedQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "owner", "-updated_at"], name="thread_owner_recent_idx")]

    def __str__(self) -> str:
        return self.title or gettext("Untitled thread")


def _next_message_seq(thread_id: int, *, at: datetime) -> int:
    """Take the thread's next message seq, and mark the thread as just active.

    The UPDATE locks the thread's row until the caller's transaction ends, so seqs
    become visible in order: a reader that saw seq n never finds an n - 1 later.
    """
    table = connection.ops.quote_name(Thread._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET message_seq = message_seq + 1, updated_at = %s WHERE id = %s "
                       "RETURNING message_seq", [connection.ops.adapt_datetimefield_value(at), thread_id])
        row = cursor.fetchone()
    if row is None:
        raise Thread.DoesNotExist(f"no thread {thread_id}")
    return row[0]


class Run(SealedModel):
    """One execution of the chat agent in a thread: a reply to the user, or a task notification."""

    class Kind(models.TextChoices):
        CHAT = "chat"
        NOTIFICATION = "notification"

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        INTERRUPTED = "interrupted"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    thread = models.ForeignKey(Thread, on_delete=models.CASCADE, related_name="runs")
    tenant = models.ForeignKey("tasks.Tenant", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.CHAT)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    # Unique: the last line of defence when two workers start the same run.
    idempotency_key = models.CharField(max_length=255, null=True, blank=True, unique=True)
    input = SealedJSONField(default=dict)
    error = models.TextField(blank=True)
    # A notification run tells of its task: deleting the task deletes it (its messages stay in the thread).
    task = models.ForeignKey("tasks.Task", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    task_version = models.PositiveIntegerField(default=0, help_text="The notification version this run tells.")
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = SealedQuerySet.as_manager()

    class Meta:
        constraints = [
            # One active run per thread: a second one is a conflict, by construction.
            models.UniqueConstraint(fields=["thread"], name="run_one_active_per_thread",
                                    condition=Q(status__in=["pending", "running"])),
        ]
        indexes = [
            # chat.runs.claim and the sweeper: runs waiting for a worker.
            models.Index(fields=["created_at"], name="run_active_idx", condition=Q(status__in=["pending", "running"])),
        ]


class Message(SealedModel):
    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"
        TOOL = "tool"

    thread = models.ForeignKey(Thread, on_delete=models.CASCADE, related_name="messages",
                               db_index=False)  # message_thread_seq_unique leads with it
    role = models.CharField(max_length=16, choices=Role.choices)
    content = SealedTextField(tenant="thread__tenant_id")
    hidden = models.BooleanField(default=False, help_text="Injected turns (task notifications), not shown.")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="messages")
    data = SealedJSONField(default=dict, blank=True, tenant="thread__tenant_id")
    # Per thread, from 1 and without gaps: the API's message id and the page's cursor. A global id
    # would tell every tenant how much everyone else writes.
    seq = models.PositiveIntegerField(editable=False)
    created_at = models.DateTimeField()

    objects = SealedQuerySet.as_manager()

    class Meta:
        ordering = ["thread", "seq"]
        indexes = [
            # tasks.retention.purge: messages in the order they were written.
            models.Index(fields=["created_at", "id"], name="message_created_idx"),
        ]
        constraints = [
            # Also the index the message pages read (thread, seq > cursor).
            models.UniqueConstraint(fields=["thread", "seq"], name="message_thread_seq_unique"),
            # One assistant message per run: a run replayed after a crash cannot say it twice.
            models.UniqueConstraint(fields=["run"], name="message_one_reply_per_run",
                                    condition=Q(role="assistant")),
        ]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding or self.seq is not None:
            super().save(*args, **kwargs)
            return
        # The seq and the row commit together, or neither does: no gap, no seq taken twice.
        with transaction.atomic():
            self.seq = _next_message_seq(self.thread_id, at=self.created_at)
            super().save(*args, **kwargs)


class ThreadItem(models.Model):
    """A status change of a task in the thread, numbered in the thread stream's own sequence.

    Numbered by the stream's readers after the event has committed (chat.streams.number_new_items),
    not by the task's writer: a writer would have to lock the thread in the middle of its own
    transaction, behind locks taken in any order. Task events commit in their task's seq order,
    so Thread.item_marks (per task, the last seq looked at) tells exactly which are still to number.
    """

    thread = models.ForeignKey(Thread, on_delete=models.CASCADE, related_name="items",
                               db_index=False)  # thread_item_seq_unique leads with it
    seq = models.PositiveIntegerField()
    # No database constraints on these two: a constraint is checked at commit with a share lock on the
    # task's row, which a reader that holds the thread's row could then wait for behind a transaction
    # that holds the task and wants the thread (confirming a proposal, say). Purges delete a task's items
    # first (tasks/retention.py); deleting a task deletes them through `task`.
    event = models.OneToOneField("tasks.TaskEvent", on_delete=models.DO_NOTHING, related_name="+",
                                 db_constraint=False)
    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="+", db_constraint=False)
    task_seq = models.PositiveBigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["thread", "seq"], name="thread_item_seq_unique")]


class Proposal(SealedModel):
    """A side effect the model proposed (a remote tool call, a cancel): nothing runs until the thread's owner
    confirms. A quoted web page or a remote tool's result can talk the model into calling; the user cannot be."""

    class Action(models.TextChoices):
        START_REMOTE_TOOL = "start_remote_tool"
        CANCEL_BACKGROUND_TASK = "cancel_background_task"

    class Status(models.TextChoices):
        PENDING = "pending"
        CONFIRMED = "confirmed"
        DECLINED = "declined"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    thread = models.ForeignKey(Thread, on_delete=models.CASCADE, related_name="proposals")
    tenant = models.ForeignKey("tasks.Tenant", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="proposals",
                            db_index=False,  # proposal_one_per_tool_call leads with it
                            help_text="The run whose model proposed it.")
    n = models.PositiveIntegerField(help_text="The tool call's index in its run: the confirmed action's "
                                              "idempotency key is the run's and this.")
    action = models.CharField(max_length=32, choices=Action.choices)
    # start_remote_tool: {server (configured name), server_title, tool, arguments, name};
    # cancel_background_task: {task (public id), name}. Shown only through chat.proposals.public_shape.
    arguments = SealedJSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    outcome = models.TextField(blank=True, help_text="What happened when it was decided, as the thread was told.")

    objects = SealedQuerySet.as_manager()

    class Meta:
        constraints = [
            # A run replayed after a crash proposes its tool call once, not twice.
            models.UniqueConstraint(fields=["run", "n"], name="proposal_one_per_tool_call"),
        ]


class LanguagePreference(models.Model):
    """The language a person reads Longhaul in, kept on the server so it follows them to any browser."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True,
                                related_name="language_preference")
    chosen = models.CharField(max_length=16, blank=True,
                              help_text="Picked with the switch in the header; empty: follow the browser.")
    # What the pages were last shown in (the browser's Accept-Language when nothing is chosen):
    # the assistant's replies and notifications, written by workers, use it.
    last_shown = models.CharField(max_length=16, blank=True)

    def __str__(self) -> str:
        return self.chosen or f"({self.last_shown or settings.LANGUAGE_CODE})"
