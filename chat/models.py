"""Conversations: threads, their messages, and runs of the chat agent."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils.translation import gettext


class Thread(models.Model):
    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    tenant = models.ForeignKey("tasks.Tenant", on_delete=models.CASCADE, related_name="threads")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="threads")
    title = models.CharField(max_length=200, blank=True)
    deleted = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "owner", "-updated_at"], name="thread_owner_recent_idx")]

    def __str__(self) -> str:
        return self.title or gettext("Untitled thread")


class Run(models.Model):
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
    input = models.JSONField(default=dict)
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


class Message(models.Model):
    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"
        TOOL = "tool"

    thread = models.ForeignKey(Thread, on_delete=models.CASCADE, related_name="messages")
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField()
    hidden = models.BooleanField(default=False, help_text="Injected turns (task notifications), not shown.")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="messages")
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["thread", "id"]
        indexes = [models.Index(fields=["thread", "id"], name="message_thread_order_idx")]
        constraints = [
            # One assistant message per run: a run replayed after a crash cannot say it twice.
            models.UniqueConstraint(fields=["run"], name="message_one_reply_per_run",
                                    condition=Q(role="assistant")),
        ]


class Proposal(models.Model):
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
                            help_text="The run whose model proposed it.")
    n = models.PositiveIntegerField(help_text="The tool call's index in its run: the confirmed action's "
                                              "idempotency key is the run's and this.")
    action = models.CharField(max_length=32, choices=Action.choices)
    # start_remote_tool: {server (configured name), server_title, tool, arguments, name};
    # cancel_background_task: {task (public id), name}. Shown only through chat.proposals.public_shape.
    arguments = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    outcome = models.TextField(blank=True, help_text="What happened when it was decided, as the thread was told.")

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
