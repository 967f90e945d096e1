"""/api/webhooks: a tenant's endpoints. Thin: parse, authorize, call webhooks.endpoints, shape the answer.

A member registers endpoints that hear of their own tasks and sees only those; a tenant admin's
endpoints hear of all the tenant's tasks, and a tenant admin sees all the tenant's endpoints
(the same rule as tasks.tenancy.visible_tasks). Anything else answers 404.
"""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from project.api_errors import get_by_public_id
from tasks.api import ERRORS, READ_ERRORS, request_tenant
from tasks.models import Membership, Tenant
from webhooks import endpoints
from webhooks.models import Endpoint
from webhooks.serializers import (
    ChangeSerializer,
    DeliverySerializer,
    EndpointSerializer,
    EndpointWithSecretSerializer,
    RegisterSerializer,
)

ENDPOINT_ID = OpenApiParameter("endpoint_id", OpenApiTypes.UUID, OpenApiParameter.PATH)
DELIVERIES_SHOWN = 50


def _is_tenant_admin(request: Request, tenant: Tenant) -> bool:
    return Membership.objects.filter(user=request.user, tenant=tenant, role=Membership.Role.ADMIN).exists()


def visible_endpoints(request: Request) -> QuerySet[Endpoint]:
    tenant = request_tenant(request)
    rows = Endpoint.objects.filter(tenant=tenant)
    return rows if _is_tenant_admin(request, tenant) else rows.filter(owner=request.user)


def get_visible_endpoint(request: Request, endpoint_id: str) -> Endpoint:
    return get_by_public_id(visible_endpoints(request), endpoint_id, noun="webhook")


def with_secret(endpoint: Endpoint, secret: str) -> dict:
    return EndpointWithSecretSerializer(endpoint, context={"secret": secret}).data


EndpointList = inline_serializer(name="WebhookList", fields={"results": EndpointSerializer(many=True)})
DeliveryList = inline_serializer(name="WebhookDeliveryList", fields={"results": DeliverySerializer(many=True)})


class WebhookListCreate(APIView):
    @extend_schema(operation_id="webhooks_list", responses={200: EndpointList, 401: ERRORS[401], 403: ERRORS[403]})
    def get(self, request: Request) -> Response:
        """The webhook endpoints the caller may see (their secrets are never shown again)."""
        return Response({"results": EndpointSerializer(visible_endpoints(request), many=True).data})

    @extend_schema(request=RegisterSerializer, responses={201: EndpointWithSecretSerializer, **ERRORS})
    def post(self, request: Request) -> Response:
        """Register an endpoint; the answer carries its signing secret, shown this once."""
        tenant = request_tenant(request)
        body = RegisterSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        endpoint, secret = endpoints.register(
            tenant=tenant, actor=request.user, url=data["url"], events=data["events"],
            owner=None if _is_tenant_admin(request, tenant) else request.user,
            description=data["description"], enabled=data["enabled"])
        response = Response(with_secret(endpoint, secret), status=status.HTTP_201_CREATED)
        response["Location"] = f"/api/webhooks/{endpoint.public_id}"
        return response


class WebhookDetail(APIView):
    @extend_schema(parameters=[ENDPOINT_ID], responses={200: EndpointSerializer, **READ_ERRORS})
    def get(self, request: Request, endpoint_id: str) -> Response:
        return Response(EndpointSerializer(get_visible_endpoint(request, endpoint_id)).data)

    @extend_schema(parameters=[ENDPOINT_ID], request=ChangeSerializer,
                   responses={200: EndpointSerializer, 400: ERRORS[400], **READ_ERRORS})
    def patch(self, request: Request, endpoint_id: str) -> Response:
        """Change the events, the description or the enabled flag."""
        endpoint = get_visible_endpoint(request, endpoint_id)
        body = ChangeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        endpoint = endpoints.change(endpoint, actor=request.user, events=data.get("events"),
                                    enabled=data.get("enabled"), description=data.get("description"))
        return Response(EndpointSerializer(endpoint).data)

    @extend_schema(parameters=[ENDPOINT_ID], responses={204: None, **READ_ERRORS})
    def delete(self, request: Request, endpoint_id: str) -> Response:
        """Remove the endpoint; nothing more is sent to it."""
        endpoints.remove(get_visible_endpoint(request, endpoint_id), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookRotateSecret(APIView):
    @extend_schema(parameters=[ENDPOINT_ID], request=None,
                   responses={200: EndpointWithSecretSerializer, 409: ERRORS[409], **READ_ERRORS})
    def post(self, request: Request, endpoint_id: str) -> Response:
        """A new signing secret, shown this once; the old one keeps signing (a second signature) through
        the overlap (LONGHAUL_WEBHOOK_SECRET_OVERLAP_SECONDS)."""
        endpoint = get_visible_endpoint(request, endpoint_id)
        secret = endpoints.rotate(endpoint, actor=request.user)
        return Response(with_secret(endpoint, secret))


class WebhookDeliveries(APIView):
    @extend_schema(parameters=[ENDPOINT_ID], responses={200: DeliveryList, **READ_ERRORS})
    def get(self, request: Request, endpoint_id: str) -> Response:
        """The endpoint's newest deliveries and how they went."""
        endpoint = get_visible_endpoint(request, endpoint_id)
        rows = endpoint.deliveries.select_related("task").order_by("-created_at", "-id")[:DELIVERIES_SHOWN]
        return Response({"results": DeliverySerializer(rows, many=True).data})
