"""Task statuses and what each one means for slots and finality."""

from __future__ import annotations

from django.db import models


class TaskStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_TOOL = "waiting_tool"
    WAITING_INPUT = "waiting_input"
    RETRY_WAIT = "retry_wait"
    PAUSED = "paused"
    PARTIAL = "partial"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED})
# Statuses that count against a tenant's max_running (DESIGN §4 table).
HOLDS_SLOT = frozenset({TaskStatus.RUNNING, TaskStatus.WAITING_TOOL, TaskStatus.RETRY_WAIT})
# Statuses in which a worker may claim the task to run its next step.
CLAIMABLE = frozenset({TaskStatus.RUNNING, TaskStatus.RETRY_WAIT})
# Not terminal and not queued: a cancel or pause request has something to stop.
ACTIVE = frozenset(set(TaskStatus) - TERMINAL)


class ErrorClass(models.TextChoices):
    TRANSIENT = "transient"
    RATE_LIMITED = "rate_limited"
    TIMEOUT = "timeout"
    INVALID_INPUT = "invalid_input"
    PERMANENT = "permanent"
    BUDGET_EXHAUSTED = "budget_exhausted"
    CANCELLED = "cancelled"
    POISON = "poison"
    QUEUE_TIMEOUT = "queue_timeout"
    INTERNAL = "internal"




class OperationStatus(models.TextChoices):
    PENDING = "pending"  # requested by a step, waiting for a gateway job
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class NotificationStatus(models.TextChoices):
    NONE = "none"
    PENDING = "pending"
    CLAIMED = "claimed"
    DISPATCHED = "dispatched"
    RETRY = "retry"
    DELIVERED = "delivered"
    DEAD_LETTER = "dead_letter"
