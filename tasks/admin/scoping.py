"""Tenant scoping: an operator sees and acts only within the tenants they administer."""

from __future__ import annotations

from typing import Any, ClassVar

from django.contrib import admin
from django.contrib.auth import get_permission_codename
from django.db.models import QuerySet
from django.http import HttpRequest

from tasks.models import Membership, Tenant


def operator_tenant_ids(request: HttpRequest) -> frozenset[int] | None:
    """The tenants this admin user operates; None means all (a superuser).

    Only admin memberships count: a tenant's plain member who also has is_staff (for
    another tenant, say) must not see that tenant's other users' tasks and audit log.
    """
    user = request.user
    if user.is_superuser:
        return None
    cached: frozenset[int] | None = getattr(request, "_operator_tenant_ids", None)
    if cached is None:
        cached = frozenset(
            Membership.objects.filter(user=user, role=Membership.Role.ADMIN).values_list("tenant_id", flat=True)
        )
        request._operator_tenant_ids = cached  # type: ignore[attr-defined]
    return cached


def scoped(queryset: QuerySet, tenant_lookup: str, request: HttpRequest) -> QuerySet:
    ids = operator_tenant_ids(request)
    return queryset if ids is None else queryset.filter(**{f"{tenant_lookup}__in": ids})


class OperatorTenantFilter(admin.RelatedFieldListFilter):
    """Offers only the operator's tenants, read from the small tenant table (the stock
    related-only filter would scan the big table for its distinct tenants)."""

    def field_choices(self, field: Any, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[Any, str]]:
        tenants = Tenant.objects.order_by("slug")
        ids = operator_tenant_ids(request)
        if ids is not None:
            tenants = tenants.filter(pk__in=ids)
        return [(tenant.pk, str(tenant)) for tenant in tenants]


class TenantScopedAdmin(admin.ModelAdmin):
    """Rows outside the operator's tenants are absent from lists, change views and actions.

    `operate` is the permission the runtime actions ask for: the model's change
    permission within scope. It is separate from has_change_permission so that the
    change form can stay read-only while actions are allowed.
    """

    tenant_lookup: ClassVar[str] = "tenant"

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return scoped(super().get_queryset(request), self.tenant_lookup, request)

    def tenant_id_of(self, obj: Any) -> int | None:
        *hops, last = self.tenant_lookup.split("__")
        for hop in hops:
            obj = getattr(obj, hop)
        return getattr(obj, f"{last}_id")

    def in_scope(self, request: HttpRequest, obj: Any) -> bool:
        ids = operator_tenant_ids(request)
        return ids is None or self.tenant_id_of(obj) in ids

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) and (obj is None or self.in_scope(request, obj))

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and (obj is None or self.in_scope(request, obj))

    def has_operate_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = self.opts
        allowed = request.user.has_perm(f"{opts.app_label}.{get_permission_codename('change', opts)}")
        return allowed and (obj is None or self.in_scope(request, obj))


class ReadOnlyAdmin(TenantScopedAdmin):
    """Runtime rows are written only through transitions: no add, no edit, no delete here."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
