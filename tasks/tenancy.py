"""Which tenant a signed-in user acts for. Every query of user data is scoped by it."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from tasks.models import Membership, Task, Tenant

TENANT_HEADER = "HTTP_X_LONGHAUL_TENANT"


def tenant_for(user: Any, *, slug: str | None = None) -> Tenant | None:
    """The tenant the user acts for: the one named by slug, else their oldest membership."""
    if not getattr(user, "is_authenticated", False):
        return None
    memberships = Membership.objects.filter(user=user).select_related("tenant").order_by("created_at", "pk")
    if slug:
        memberships = memberships.filter(tenant__slug=slug)
    membership = memberships.first()
    return membership.tenant if membership else None


def visible_tasks(user: Any, tenant: Tenant) -> QuerySet[Task]:
    """Tasks this user may see in this tenant: their own, or all of the tenant's for a tenant
    admin. The API and the streams answer 404 for anything else: knowing an id grants nothing."""
    tasks = Task.objects.filter(tenant=tenant, delete_requested_at__isnull=True)  # deleted, ending (deletion.py)
    is_admin = Membership.objects.filter(user=user, tenant=tenant, role=Membership.Role.ADMIN).exists()
    return tasks if is_admin else tasks.filter(owner=user)


class TenantMiddleware:
    """Sets request.tenant for signed-in users. Pages for a user without a membership
    answer with an explanation instead of failing later on a missing tenant."""

    EXEMPT_PREFIXES = ("/accounts/", "/admin/", "/static/", "/healthz", "/api/", "/metrics")

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request.tenant = tenant_for(request.user, slug=request.META.get(TENANT_HEADER))
        if (
            request.user.is_authenticated
            and request.tenant is None
            and not request.path.startswith(self.EXEMPT_PREFIXES)
        ):
            return render(request, "no_tenant.html", status=403)
        return self.get_response(request)
