"""What a task left behind: its events, checkpoints and operations, reached from its change page."""

from __future__ import annotations

from django.contrib import admin

from tasks.admin.display import short_json
from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin
from tasks.models import Checkpoint, Operation, TaskEvent


class TaskRowAdmin(ReadOnlyAdmin):
    """Rows that belong to a task: reached from the task's page through `?task__id__exact=`."""

    tenant_lookup = "task__tenant"
    list_select_related = ("task",)
    show_full_result_count = False


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyAdmin):
    list_display = ("task", "seq", "kind", "status", "at", "data_excerpt")
    list_filter = (("tenant", OperatorTenantFilter), "status")
    list_select_related = ("task",)
    search_fields = ("=kind",)
    show_full_result_count = False

    @admin.display(description="data")
    def data_excerpt(self, event: TaskEvent) -> str:
        return short_json(event.data)


@admin.register(Checkpoint)
class CheckpointAdmin(TaskRowAdmin):
    list_display = ("task", "step", "schema_version", "fencing_token", "at")
    list_filter = (("task__tenant", OperatorTenantFilter),)


@admin.register(Operation)
class OperationAdmin(TaskRowAdmin):
    list_display = ("key", "task", "kind", "name", "status", "attempts", "error_class", "has_side_effects",
                    "version", "created_at", "finished_at")
    list_filter = (("task__tenant", OperatorTenantFilter), "status", "kind")
    search_fields = ("=key", "name")
