"""Tenants: quotas an operator may set (through tasks.actions) and each tenant's task counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.safestring import SafeString

from tasks import actions, deletion, retention
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


def retention_field(data_class: str) -> str:
    return f"retention_{data_class}"


class TenantForm(forms.ModelForm):
    """The quotas, held to the system's ceilings (tasks.actions.check_quota), and the retention overrides,
    held to the same range and audit rule as the settings (tasks.retention.check_overrides), before
    anything is saved. An empty retention field follows the system's days."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kept = self.instance.retention if self.instance.pk else {}
        for data_class in retention.CLASSES:
            field = self.fields[retention_field(data_class)]
            field.initial = kept.get(data_class)
            system = retention.days(data_class)
            field.help_text = (f"Empty: the system's {f'{system} days' if system else 'for ever'}; "
                               "0 keeps them for ever.")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for name in actions.QUOTA_FIELDS:
            if name in self.changed_data and cleaned.get(name) is not None:
                try:
                    actions.check_quota(name, cleaned[name])
                except InvalidInput as exc:
                    self.add_error(name, str(exc))
        try:
            cleaned["retention"] = retention.check_overrides(self.retention_overrides(cleaned))
        except InvalidInput as exc:
            self.add_error(retention_field(exc.field) if exc.field in retention.CLASSES else None, str(exc))
        return cleaned

    def retention_overrides(self, cleaned: dict[str, Any]) -> dict[str, Any]:
        return {data_class: cleaned[retention_field(data_class)] for data_class in retention.CLASSES
                if cleaned.get(retention_field(data_class)) is not None}


# Declared on the class, so the admin's fieldsets may name them.
for _data_class in retention.CLASSES:
    TenantForm.base_fields[retention_field(_data_class)] = TenantForm.declared_fields[retention_field(_data_class)] = \
        forms.IntegerField(required=False, min_value=0, label=f"{_data_class.replace('_', ' ')} (days)")


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    form = TenantForm
    list_display = ("slug", "name", "max_running", "max_queued", "weight", "running", "queued", "failed")
    fieldsets = (
        (None, {"fields": ("slug", "name", "created_at")}),
        ("Quotas", {"fields": actions.QUOTA_FIELDS}),
        ("Retention", {"fields": tuple(retention_field(c) for c in retention.CLASSES),
                       "description": "How long this tenant's data is kept, per class, instead of the system's."}),
    )
    readonly_fields = ("slug", "name", "created_at")
    search_fields = ("slug", "name")
    actions = ("erase_data", "destroy_data_key")

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
        overrides = form.cleaned_data["retention"]
        if overrides != Tenant.objects.values_list("retention", flat=True).get(pk=obj.pk):
            actions.set_retention(obj, user=request.user, overrides=overrides)

    @admin.action(description="Erase the selected tenant's data…")
    def erase_data(self, request: HttpRequest, queryset: QuerySet) -> TemplateResponse | None:
        def erase(tenant: Tenant) -> str:
            done = deletion.erase_tenant(tenant, user=request.user)
            counts = ", ".join(f"{n} {name}" for name, n in done["deleted"].items()) or "nothing"
            later = f"; {done['tasks_pending']} running tasks are cancelled and go when they stop" \
                if done["tasks_pending"] else ""
            return f"Erased the data of {tenant.slug}: {counts}{later}."

        def described(tenant: Tenant) -> dict[str, Any]:
            threads, tasks = tenant.threads.count(), Task.objects.filter(tenant=tenant).count()
            messages_count = tenant.threads.aggregate(n=Count("messages"))["n"]
            return {"title": f"Erase the data of {tenant.slug}?", "button": f"Erase all of {tenant.slug}'s data",
                    "goes": [f"{threads} threads with {messages_count} messages;",
                             (f"{tasks} tasks with their events, checkpoints, calls, notifications and webhook "
                              "deliveries (running ones are cancelled first and go when they stop);"),
                             "the tenant's admission records."],
                    "stays": "The tenant, its members, its settings and the audit trail stay; the erasure itself "
                             "is audited."}

        return self.two_steps(request, queryset, "erase_data", described, erase)

    @admin.action(description="Destroy the selected tenant's data key…")
    def destroy_data_key(self, request: HttpRequest, queryset: QuerySet) -> TemplateResponse | None:
        def destroy(tenant: Tenant) -> str:
            versions = actions.destroy_data_key(tenant, user=request.user)
            return (f"Destroyed {versions} data key version{'s' if versions != 1 else ''} of {tenant.slug}: its "
                    "content reads as erased; new content gets a new key.")

        def described(tenant: Tenant) -> dict[str, Any]:
            return {"title": f"Destroy the data key of {tenant.slug}?", "button": f"Destroy {tenant.slug}'s key",
                    "goes": [("every version of the tenant's data key: task inputs and results, checkpoints, calls, "
                              "event details and messages sealed with it become unreadable for good, and show "
                              "“content erased” (crypto-shredding);"),
                             "tasks still running lose what they were working from."],
                    "stays": "The rows stay, with their statuses, times and counts; new content is sealed with a "
                             "new key. The destruction is audited."}

        return self.two_steps(request, queryset, "destroy_data_key", described, destroy)

    def two_steps(self, request: HttpRequest, queryset: QuerySet, action: str,
                  described: Callable[[Tenant], dict[str, Any]], act: Callable[[Tenant], str]) -> TemplateResponse | None:
        """What cannot be undone: a page saying what will go, then the tenant's slug typed to confirm.
        Superusers only, one tenant at a time."""
        if not request.user.is_superuser:
            messages.error(request, "Only a superuser may do this to a tenant's data.")
            return None
        if queryset.count() != 1:
            messages.error(request, "Select one tenant: this is done one tenant at a time.")
            return None
        tenant = queryset.get()
        typed = request.POST.get("confirm_slug")
        if typed is not None and typed.strip() == tenant.slug:
            messages.success(request, act(tenant))
            return None
        if typed is not None:
            messages.error(request, f"Nothing was done: type the slug {tenant.slug} exactly to confirm.")
        context = {**self.admin_site.each_context(request), "opts": self.model._meta, "tenant": tenant,
                   "action": action, **described(tenant)}
        return TemplateResponse(request, "admin/tasks/tenant/confirm_with_slug.html", context)

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
