"""Conversations in the operators' admin: read-only, scoped to the operator's tenants like tasks."""

from __future__ import annotations

from django.contrib import admin

from chat.models import Message, Run, Thread
from tasks.admin.display import short_json
from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin


@admin.register(Thread)
class ThreadAdmin(ReadOnlyAdmin):
    # Read-only, title included: a thread and its title are the user's words, not the operator's.
    list_display = ("__str__", "tenant", "owner", "created_at", "updated_at")
    list_filter = (("tenant", OperatorTenantFilter),)
    list_select_related = ("tenant", "owner")
    ordering = ("-updated_at",)
    show_full_result_count = False


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("public_id", "kind", "status", "thread", "tenant", "task", "task_version", "attempts",
                    "created_at", "finished_at")
    list_filter = (("tenant", OperatorTenantFilter), "kind", "status")
    list_select_related = ("thread", "tenant", "task")
    search_fields = ("=idempotency_key",)
    ordering = ("-created_at",)
    show_full_result_count = False


@admin.register(Message)
class MessageAdmin(ReadOnlyAdmin):
    tenant_lookup = "thread__tenant"
    list_display = ("created_at", "thread", "role", "hidden", "run", "excerpt")
    list_filter = (("thread__tenant", OperatorTenantFilter), "role", "hidden")
    list_select_related = ("thread",)
    ordering = ("-created_at",)
    show_full_result_count = False

    @admin.display(description="content")
    def excerpt(self, message: Message) -> str:
        return message.content[:160] or short_json(message.data)
