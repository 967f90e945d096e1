"""API tokens, scoped like everything else: DRF's own token admin lists every tenant's tokens with
their whole keys. An operator sees the tokens of users who belong only to tenants they administer
(a user shared with another tenant is that tenant's business too); a key is shown by its prefix."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from rest_framework.authtoken.admin import TokenAdmin
from rest_framework.authtoken.models import TokenProxy

from tasks.admin.scoping import operator_tenant_ids
from tasks.models import Membership

KEY_PREFIX_CHARS = 6


def manageable_users(request: HttpRequest) -> Q:
    """Users all of whose tenants this operator administers (every user, for a superuser)."""
    ids = operator_tenant_ids(request)
    if ids is None:
        return Q()
    elsewhere = Membership.objects.exclude(tenant_id__in=ids).values("user_id")
    return Q(pk__in=Membership.objects.filter(tenant_id__in=ids).values("user_id")) & ~Q(pk__in=elsewhere)


if admin.site.is_registered(TokenProxy):
    admin.site.unregister(TokenProxy)


@admin.register(TokenProxy)
class ScopedTokenAdmin(TokenAdmin):
    list_display = ("key_prefix", "user", "created")

    @admin.display(description="key")
    def key_prefix(self, token: TokenProxy) -> str:
        return f"{token.key[:KEY_PREFIX_CHARS]}…"

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        users = get_user_model().objects.filter(manageable_users(request)).values("pk")
        return super().get_queryset(request).filter(user__in=users)

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "user":
            kwargs["queryset"] = get_user_model().objects.filter(manageable_users(request))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)
