"""Webhooks in the operators' admin, scoped to the operator's tenants (tasks.admin.scoping).

Endpoints can be registered and changed here (their secret is shown once, in the message after
saving, and never in a form); deliveries are read-only rows that change only through the outbox,
with an action that retries dead letters. Actions go through webhooks.endpoints and webhooks.outbox.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import HttpRequest

from tasks import clock
from tasks.admin.display import admin_url, link
from tasks.admin.scoping import OperatorTenantFilter, ReadOnlyAdmin, TenantScopedAdmin, operator_tenant_ids
from tasks.errors import InvalidInput
from tasks.models import AuditEntry, Tenant
from webhooks import destinations, endpoints, outbox
from webhooks.models import Delivery, DeliveryStatus, Endpoint


class EndpointForm(forms.ModelForm):
    events = forms.MultipleChoiceField(choices=[(e, e) for e in endpoints.ALL_EVENTS],
                                       widget=forms.CheckboxSelectMultiple)

    class Meta:
        model = Endpoint
        fields = ("tenant", "owner", "url", "events", "description", "enabled")

    def clean_url(self) -> str:
        url = self.cleaned_data["url"]
        if self.instance.pk and url == self.instance.url:
            return url
        try:
            return destinations.validate_url(url)
        except InvalidInput as exc:
            raise forms.ValidationError(str(exc)) from exc

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        owner, tenant = data.get("owner"), data.get("tenant")
        if not self.instance.pk and owner is not None and tenant is not None \
                and not owner.memberships.filter(tenant=tenant).exists():
            self.add_error("owner", "the owner must belong to the tenant")
        return data


@admin.register(Endpoint)
class EndpointAdmin(TenantScopedAdmin):
    form = EndpointForm
    list_display = ("url", "tenant", "scope", "event_list", "enabled", "created_by", "created_at", "deliveries_link")
    list_filter = ("enabled", ("tenant", OperatorTenantFilter))
    list_select_related = ("tenant", "owner", "created_by")
    search_fields = ("url", "description")
    readonly_fields = ("public_id", "created_by", "created_at", "secret_rotated_at", "previous_secret_expires_at")
    actions = ("rotate_secrets", "enable", "disable")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # The tenant and owner decide whose tasks it hears of; fixed once registered.
        return (*self.readonly_fields, "tenant", "owner", "url") if obj else self.readonly_fields

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        ids = operator_tenant_ids(request)
        if db_field.name == "tenant" and ids is not None:
            kwargs["queryset"] = Tenant.objects.filter(pk__in=ids)
        if db_field.name == "owner" and ids is not None:
            kwargs["queryset"] = get_user_model().objects.filter(memberships__tenant_id__in=ids).distinct()
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    @admin.display(description="hears of")
    def scope(self, endpoint: Endpoint) -> str:
        return f"{endpoint.owner}'s tasks" if endpoint.owner_id else "all the tenant's tasks"

    @admin.display(description="events")
    def event_list(self, endpoint: Endpoint) -> str:
        return ", ".join(endpoint.events)

    @admin.display(description="deliveries")
    def deliveries_link(self, endpoint: Endpoint) -> Any:
        return link(admin_url("webhooks_delivery_changelist", query={"endpoint__id__exact": endpoint.pk}), "view")

    def save_model(self, request: HttpRequest, obj: Endpoint, form: Any, change: bool) -> None:
        data = form.cleaned_data
        if change:
            endpoints.change(obj, actor=request.user, events=data["events"], enabled=data["enabled"],
                             description=data["description"])
            return
        endpoint, secret = endpoints.register(tenant=data["tenant"], actor=request.user, url=data["url"],
                                              events=data["events"], owner=data["owner"],
                                              description=data["description"], enabled=data["enabled"])
        obj.pk = endpoint.pk  # so the admin's redirect and log find the new row
        self.message_user(request, f"Signing secret for {endpoint.url} (shown only now, store it): {secret}",
                          messages.WARNING)

    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None  # the AuditEntry written by endpoints.register is the record

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) and (obj is None or self.in_scope(request, obj))

    def delete_model(self, request: HttpRequest, obj: Endpoint) -> None:
        endpoints.remove(obj, actor=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        for endpoint in queryset:
            endpoints.remove(endpoint, actor=request.user)

    @admin.action(description="Rotate the signing secret of selected endpoints", permissions=["operate"])
    def rotate_secrets(self, request: HttpRequest, queryset: QuerySet) -> None:
        for endpoint in queryset:
            secret = endpoints.rotate(endpoint, actor=request.user)
            self.message_user(request, f"New signing secret for {endpoint.url} (shown only now, store it; the old "
                              f"one signs too until {endpoint.previous_secret_expires_at:%Y-%m-%d %H:%M} UTC): "
                              f"{secret}", messages.WARNING)

    @admin.action(description="Enable selected endpoints", permissions=["operate"])
    def enable(self, request: HttpRequest, queryset: QuerySet) -> None:
        for endpoint in queryset:
            endpoints.change(endpoint, actor=request.user, enabled=True)
        self.message_user(request, f"{queryset.count()} endpoint(s) enabled", messages.SUCCESS)

    @admin.action(description="Disable selected endpoints", permissions=["operate"])
    def disable(self, request: HttpRequest, queryset: QuerySet) -> None:
        for endpoint in queryset:
            endpoints.change(endpoint, actor=request.user, enabled=False)
        self.message_user(request, f"{queryset.count()} endpoint(s) disabled", messages.SUCCESS)


class DeadLetterFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(s.value, s.label) for s in DeliveryStatus]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(status=self.value()) if self.value() else queryset


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "event_type", "tenant", "task", "endpoint", "status", "attempts",
                    "next_attempt_at", "last_status_code", "last_error_shown", "webhook_id")
    list_filter = (DeadLetterFilter, "event_type", ("tenant", OperatorTenantFilter))
    list_select_related = ("tenant", "task", "endpoint")
    search_fields = ("webhook_id",)
    exclude = ("body",)  # the payload is the task's public shape, but it is the tenant's data: not browsed here
    actions = ("retry_dead_letters",)

    @admin.display(description="last error")
    def last_error_shown(self, delivery: Delivery) -> str:
        return delivery.last_error[:200]

    @admin.action(description="Retry selected dead letters", permissions=["operate"])
    def retry_dead_letters(self, request: HttpRequest, queryset: QuerySet) -> None:
        now = clock.now()
        retried = 0
        for delivery in queryset.filter(status=DeliveryStatus.DEAD_LETTER):
            if outbox.retry_dead_letter(delivery, now=now):
                retried += 1
                AuditEntry.objects.create(tenant_id=delivery.tenant_id, actor=request.user,
                                          action="webhook.delivery_retried", target_type="webhook_delivery",
                                          target_id=delivery.webhook_id, at=now, details={})
        skipped = queryset.count() - retried
        text = f"{retried} dead letter(s) will be sent again"
        if skipped:
            text += f"; {skipped} selected row(s) were not dead letters and were left alone"
        self.message_user(request, text, messages.SUCCESS if retried else messages.WARNING)
