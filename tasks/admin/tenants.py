"""Tenants: quotas an operator may set (through tasks.actions) and each tenant's task counts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest
from django.utils.safestring import SafeString

from tasks import actions
from tasks.admin.display import admin_url, link
from tasks.admin.scoping import TenantScopedAdmin, operator_tenant_ids
from tasks.errors import InvalidInput
from tasks.models import Task, Tenant
from tasks.statuses import HOLDS_SLOT, TaskStatus


def tasks_of_tenant(statuses: Iterable[str]) -> Coalesce:
    """A per-tenant count as a correlated subquery: one query for the page, and each
    count can use its partial index (task_slot_idx, task_queued_idx)."""
    counted = (Task.objects.filter(tenant=OuterRef("pk"), status__in=sorted(statuses)).order_by()
               .values("tenant").annotate(n=Count("pk")).values("n"))
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


class QuotaForm(forms.ModelForm):
    """The quotas, held to the system's ceilings (tasks.actions.check_quota) before anything is saved."""

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for name in actions.QUOTA_FIELDS:
            if name in self.changed_data and cleaned.get(name) is not None:
                try:
                    actions.check_quota(name, cleaned[name])
                except InvalidInput as exc:
                    self.add_error(name, str(exc))
        return cleaned


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    form = QuotaForm
    list_display = ("slug", "name", "max_running", "max_queued", "weight", "running", "queued", "failed")
    fields = ("slug", "name", "created_at", *actions.QUOTA_FIELDS)
    readonly_fields = ("slug", "name", "created_at")
    search_fields = ("slug", "name")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        ids = operator_tenant_ids(request)
        tenants = Tenant.objects.all() if ids is None else Tenant.objects.filter(pk__in=ids)
        return tenants.annotate(running_count=tasks_of_tenant(HOLDS_SLOT),
                                queued_count=tasks_of_tenant({TaskStatus.QUEUED}),
                                failed_count=tasks_of_tenant({TaskStatus.FAILED}))

    def tenant_id_of(self, obj: Any) -> int | None:
        return obj.pk

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        quotas = {name: getattr(obj, name) for name in actions.QUOTA_FIELDS if name in form.changed_data}
        if quotas:
            actions.set_quotas(obj, user=request.user, quotas=quotas)

    @admin.display(description="running (slots held)", ordering="running_count")
    def running(self, tenant: Tenant) -> int:
        return tenant.running_count  # type: ignore[attr-defined]

    @admin.display(description="queued", ordering="queued_count")
    def queued(self, tenant: Tenant) -> int:
        return tenant.queued_count  # type: ignore[attr-defined]

    @admin.display(description="failed", ordering="failed_count")
    def failed(self, tenant: Tenant) -> SafeString | str:
        url = admin_url("tasks_task_changelist", query={"tenant__id__exact": tenant.pk, "status__exact": "failed"})
        return link(url, str(tenant.failed_count))  # type: ignore[attr-defined]
