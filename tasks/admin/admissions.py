"""Admission records: each submission's arrival or refusal, admission, start, slot release and end, with
the policy in force (tasks/admission_records.py), as manage.py replay_schedule reads them."""

from __future__ import annotations

from django.contrib import admin

from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin
from tasks.models import AdmissionRecord


@admin.register(AdmissionRecord)
class AdmissionRecordAdmin(ReadOnlyAdmin):
    list_display = ("arrived_at", "tenant", "task_id", "kind", "priority", "refused", "rule", "admitted_at",
                    "slot_released_at", "finished_at", "outcome", "weight", "max_running")
    list_filter = (("tenant", OperatorTenantFilter), "refused", "rule", "kind", "outcome")
    list_select_related = ("tenant",)
    date_hierarchy = "arrived_at"
    search_fields = ("=task_id",)
