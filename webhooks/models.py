"""Webhook endpoints and their delivery outbox.

Delivery rows are written by other processes at the same time: status, lease and attempt
columns change only through the guarded transitions in webhooks/outbox.py, never through
read-modify-save(). An endpoint's secrets change only through outbox.rotate_secret.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from tasks.models import Task, Tenant
from tasks.sealed import SealedModel, SealedQuerySet, SealedTextField

# Task event kind -> the webhook event type it is delivered as (issue #21).
EVENT_TYPES = {
    "succeeded": "task.succeeded",
    "failed": "task.failed",
    "cancelled": "task.cancelled",
    "partial": "task.partial",
    "input_required": "task.input_required",
    "tracking_degraded": "task.tracking_degraded",
}


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # due at next_attempt_at, held by nobody
    CLAIMED = "claimed"  # a deliverer holds the lease and is sending it
    RETRY = "retry"  # an attempt failed; due again at next_attempt_at
    DELIVERED = "delivered"  # the receiver answered 2xx
    DEAD_LETTER = "dead_letter"  # attempts ran out (an alert was raised); an operator may retry it
    SUPERSEDED = "superseded"  # a newer event of the same task for the same endpoint replaced it undelivered


class Endpoint(models.Model):
    """A URL a tenant asked to be told of task events at, with the secret deliveries are signed with."""

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="webhook_endpoints")
    # Whose tasks it hears of: one user's (a member registered it) or, when empty, the whole tenant's
    # (a tenant admin or an operator registered it), as tasks.tenancy.visible_tasks decides for the API.
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                              related_name="+", help_text="Only this user's tasks; empty: all of the tenant's.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    url = models.CharField(max_length=2000, help_text="http(s); checked by webhooks.destinations.")
    events = models.JSONField(default=list, help_text="Event types delivered, e.g. task.succeeded.")
    description = models.CharField(max_length=200, blank=True)
    enabled = models.BooleanField(default=True, help_text="Disabled: deliveries wait, undelivered, until enabled.")
    # Needed in the clear to sign; never shown after the answer that created or rotated it.
    secret = models.CharField(max_length=100, editable=False)
    previous_secret = models.CharField(max_length=100, blank=True, editable=False)
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(editable=False)
    secret_rotated_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ("-created_at", "-id")

    def __str__(self) -> str:
        return self.url


class Delivery(SealedModel):
    """One event version of one task for one endpoint: the outbox row, sent until the receiver says 2xx."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="deliveries",
                                 db_index=False)  # webhook_delivery_version_unique leads with it
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="+")
    event_seq = models.PositiveBigIntegerField(help_text="The task event's seq: this delivery's version.")
    event_type = models.CharField(max_length=40)
    # The Standard Webhooks message id: the same on every attempt, so receivers dedupe.
    webhook_id = models.CharField(max_length=40, unique=True, editable=False)
    # The exact bytes signed and sent, frozen when the event happened: every attempt sends the same body.
    body = SealedTextField()
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0, help_text="Claims so far, a killed one included.")
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)

    objects = SealedQuerySet.as_manager()

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name_plural = "deliveries"
        constraints = (
            models.UniqueConstraint(fields=["endpoint", "task", "event_seq"], name="webhook_delivery_version_unique"),
        )
        indexes = (
            # outbox.kick_due: pending and retry rows whose time came and whose kick may have been lost.
            models.Index(fields=["next_attempt_at"], name="webhook_delivery_due_idx",
                         condition=Q(status__in=["pending", "retry"])),
            # outbox.kick_due: claimed rows whose deliverer stopped (lease expired).
            models.Index(fields=["lease_expires_at"], name="webhook_delivery_claimed_idx",
                         condition=Q(status="claimed")),
            # admin: dead letters of a tenant, newest first.
            models.Index(fields=["tenant", "-created_at"], name="webhook_delivery_dead_idx",
                         condition=Q(status="dead_letter")),
        )

    def __str__(self) -> str:
        return f"{self.event_type} #{self.event_seq} to {self.endpoint_id}"
