"""GET /api/me: who the caller is, as a whitelist (never another user's memberships)."""

from __future__ import annotations

from typing import TypedDict

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from tasks.models import Membership
from tasks.serializers import ErrorSerializer
from tasks.tenancy import TENANT_HEADER, tenant_for


class TenantRef(TypedDict):
    slug: str
    name: str


class MembershipRef(TypedDict):
    tenant: str
    role: str


class Me(TypedDict):
    username: str
    tenant: TenantRef | None
    memberships: list[MembershipRef]


MeSchema = inline_serializer(
    name="Me",
    fields={
        "username": serializers.CharField(),
        "tenant": inline_serializer(
            name="MeTenant",
            fields={"slug": serializers.CharField(), "name": serializers.CharField()},
            allow_null=True,
        ),
        "memberships": inline_serializer(
            name="MeMembership",
            fields={"tenant": serializers.CharField(), "role": serializers.CharField()},
            many=True,
        ),
    },
)


class MeView(APIView):
    """The signed-in user's identity, the tenant they act for, and their own memberships."""

    @extend_schema(responses={200: MeSchema, 401: ErrorSerializer, 403: ErrorSerializer})
    def get(self, request: Request) -> Response:
        """Your username, the workspace you act for (null if none) and your own memberships."""
        tenant = tenant_for(request.user, slug=request.META.get(TENANT_HEADER))
        memberships = (
            Membership.objects.filter(user=request.user)
            .select_related("tenant")
            .order_by("created_at", "pk")
        )
        body: Me = {
            "username": request.user.get_username(),
            # None rather than 403: a user without a workspace may still ask who they are.
            "tenant": {"slug": tenant.slug, "name": tenant.name} if tenant else None,
            "memberships": [{"tenant": m.tenant.slug, "role": m.role} for m in memberships],
        }
        return Response(body)
