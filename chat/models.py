"""Conversations. A thread belongs to one tenant and one owner."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


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
        return self.title or str(self.public_id)
