"""The audit log: who did what to which row, through the admin or the API."""

from __future__ import annotations

from django.contrib import admin
from django.utils.safestring import SafeString

from tasks.admin.display import admin_url, link, short_json
from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin
from tasks.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("at", "tenant", "actor", "action", "target", "details_excerpt")
    list_filter = (("tenant", OperatorTenantFilter), ("actor", admin.RelatedOnlyFieldListFilter), "action",
                   "target_type")
    list_select_related = ("tenant", "actor")
    date_hierarchy = "at"
    search_fields = ("=target_id",)

    @admin.display(description="target")
    def target(self, entry: AuditEntry) -> SafeString | str:
        if entry.target_type == "task":
            return link(admin_url("tasks_task_changelist", query={"public_id": entry.target_id}),
                        f"task {entry.target_id}")
        return f"{entry.target_type} {entry.target_id}"

    @admin.display(description="details")
    def details_excerpt(self, entry: AuditEntry) -> str:
        return short_json(entry.details)
