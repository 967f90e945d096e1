"""The task REST API. Thin: parse, authorize, call tasks.actions, shape the answer."""

from __future__ import annotations

import re
import uuid
from typing import Any

from django.apps import apps
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import exceptions, generics, serializers, status
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from project.api_errors import ApiError, get_by_public_id
from project.env import envbool
from project.throttles import AnswerThrottle, SubmitThrottle
from tasks import actions, deletion, tenancy
from tasks.gateway import configured
from tasks.mcp import config as mcp_config
from tasks.models import Task, Tenant
from tasks.serializers import (
    AnswerSerializer,
    CancelSerializer,
    ErrorSerializer,
    EventPageSerializer,
    EventSerializer,
    PauseSerializer,
    ResultSerializer,
    ResumeSerializer,
    SubmitSerializer,
    TaskSerializer,
)
from tasks.statuses import TaskStatus
from tasks.tenancy import TENANT_HEADER, tenant_for

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
MAX_EVENTS_PAGE = 1000
ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 403, 404, 409, 429)}
# What any authenticated read may answer besides 200: no credentials, no tenant, no such object.
READ_ERRORS = {code: ERRORS[code] for code in (401, 403, 404)}
# Ids are UUIDs; the routes take any string so a malformed id answers the same 404 as a missing one.
TASK_ID = OpenApiParameter("task_id", OpenApiTypes.UUID, OpenApiParameter.PATH)
STATUS_LIST = "^({0})(,({0}))*$".format("|".join(TaskStatus.values))
CURSOR = {"type": "integer", "minimum": 0, "maximum": 2**62}
IDEMPOTENCY_KEY_PARAMETER = OpenApiParameter(
    "Idempotency-Key", {"type": "string", "pattern": IDEMPOTENCY_KEY.pattern}, OpenApiParameter.HEADER,
    description="Same key and same request: the same answer, not a second one. 1 to 255 printable ASCII "
                "characters without spaces.")


def request_tenant(request: Request) -> Tenant:
    tenant = tenant_for(request.user, slug=request.META.get(TENANT_HEADER))
    if tenant is None:
        raise ApiError("your account belongs to no tenant; ask an administrator to add you", code="no_tenant",
                       status_code=403)
    return tenant


def visible_tasks(request: Request) -> QuerySet[Task]:
    """Tasks this user may see: their own, or all of the tenant's for a tenant admin.
    Anything else answers 404: knowing a task id grants nothing."""
    return tenancy.visible_tasks(request.user, request_tenant(request)).select_related("thread")


def _uuid(raw: str, *, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise ApiError(f"{field} must be a UUID", code="invalid_input", field=field) from None


def get_visible_task(request: Request, task_id: str) -> Task:
    return get_by_public_id(visible_tasks(request), task_id, noun="task")


def _int_param(request: Request, name: str, default: int, *, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(f"{name} must be an integer", code="invalid_input", field=name) from None
    if not low <= value <= high:
        raise ApiError(f"{name} must be between {low} and {high}", code="invalid_input", field=name)
    return value


class TaskPagination(CursorPagination):
    ordering = "-id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def get_page_size(self, request: Request) -> int:
        # DRF falls back to the default on a bad limit; a client asking for limit=abc should hear about it.
        return _int_param(request, self.page_size_query_param, self.page_size, low=1, high=self.max_page_size)

    def decode_cursor(self, request: Request) -> Any:
        # DRF answers a bad cursor with 404, as if the list were missing; it is bad input.
        try:
            return super().decode_cursor(request)
        except exceptions.NotFound:
            raise ApiError("cursor is not one this API handed out", code="invalid_input", field="cursor") from None


def features(tenant: Tenant) -> dict[str, Any]:
    """What this deployment offers the tenant: the page shows only what is on."""
    from tasks.gateway.providers import model_settings
    from tasks.gateway.tools import search_url

    return {
        "task_panel": bool(configured("LONGHAUL_TASK_PANEL", lambda name: envbool(name, True))),
        "remote_tools": bool(mcp_config.for_tenant(tenant.slug)),
        "research": {"provider": model_settings().provider, "corpus": not search_url()},
    }


FeaturesSchema = inline_serializer(name="Features", fields={
    "task_panel": serializers.BooleanField(help_text="The chat page's background-task panel (LONGHAUL_TASK_PANEL)."),
    "remote_tools": serializers.BooleanField(help_text="MCP servers are configured for this tenant."),
    "research": inline_serializer(name="ResearchFeatures", fields={
        "provider": serializers.CharField(help_text="The model provider: offline or openai."),
        "corpus": serializers.BooleanField(help_text="Searches go to the bundled offline corpus, not the web."),
    }),
})


class Features(APIView):
    @extend_schema(responses={200: FeaturesSchema, 401: ERRORS[401], 403: ERRORS[403]})
    def get(self, request: Request) -> Response:
        """Which capabilities are on for the caller's tenant."""
        return Response(features(request_tenant(request)))


class TaskListCreate(generics.ListAPIView):
    serializer_class = TaskSerializer
    throttle_classes = (SubmitThrottle,)  # POST only
    pagination_class = TaskPagination

    def get_queryset(self) -> QuerySet[Task]:
        tasks = visible_tasks(self.request)
        params = self.request.query_params
        # Present but empty is bad input like any other value, not "no filter".
        if (status_filter := params.get("status")) is not None:
            wanted = status_filter.split(",")
            unknown = sorted(set(wanted) - set(TaskStatus.values))
            if unknown:
                raise ApiError(f"unknown status {unknown[0]!r}", code="invalid_input", field="status")
            tasks = tasks.filter(status__in=wanted)
        if kind := params.get("kind"):
            tasks = tasks.filter(kind=kind)
        if (thread := params.get("thread")) is not None:
            tasks = tasks.filter(thread__public_id=_uuid(thread, field="thread"))
        return tasks

    @extend_schema(
        parameters=[
            OpenApiParameter("status", {"type": "string", "pattern": STATUS_LIST},
                             description="Comma-separated statuses"),
            OpenApiParameter("kind", str),
            OpenApiParameter("thread", OpenApiTypes.UUID),
            OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": TaskPagination.max_page_size}),
        ],
        responses={200: TaskSerializer(many=True), 400: ERRORS[400], 401: ERRORS[401], 403: ERRORS[403]},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    @extend_schema(
        request=SubmitSerializer,
        parameters=[IDEMPOTENCY_KEY_PARAMETER],
        responses={201: TaskSerializer, 200: TaskSerializer, **ERRORS},
    )
    def post(self, request: Request) -> Response:
        tenant = request_tenant(request)
        key = request.headers.get("Idempotency-Key")
        if key is not None and not IDEMPOTENCY_KEY.match(key):
            raise ApiError("Idempotency-Key must be 1 to 255 printable ASCII characters without spaces",
                           code="invalid_input", field="Idempotency-Key")
        body = SubmitSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        thread_id = None
        if data["thread"] is not None:
            thread = apps.get_model("chat", "Thread").objects.filter(
                public_id=data["thread"], tenant=tenant, owner=request.user).first()
            if thread is None:
                raise ApiError("no such thread", code="invalid_input", field="thread")
            thread_id = thread.pk
        task, created = actions.submit(
            tenant=tenant,
            user=request.user,
            submission=actions.Submission(
                kind=data["kind"], input=data["input"], name=data["name"], budget=data["budget"],
                priority=data["priority"], thread_id=thread_id, idempotency_key=key,
            ),
        )
        response = Response(TaskSerializer(task).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)
        response["Location"] = f"/api/tasks/{task.public_id}"
        return response


class TaskDetail(APIView):
    @extend_schema(parameters=[TASK_ID], responses={200: TaskSerializer, **READ_ERRORS})
    def get(self, request: Request, task_id: str) -> Response:
        return Response(TaskSerializer(get_visible_task(request, task_id)).data)

    @extend_schema(parameters=[TASK_ID], responses={204: None, 409: ERRORS[409], **READ_ERRORS},
                   description="Delete a task that has ended (or stopped partial) with everything derived from "
                               "it; 409 `task_active` while it may still run: cancel it first.")
    def delete(self, request: Request, task_id: str) -> Response:
        deletion.delete_task(get_visible_task(request, task_id), user=request.user)
        return Response(status=204)


class TaskEvents(APIView):
    @extend_schema(
        parameters=[TASK_ID, OpenApiParameter("after", CURSOR, description="Last seq seen; 0 for all"),
                    OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": MAX_EVENTS_PAGE})],
        responses={200: EventPageSerializer, 400: ERRORS[400], **READ_ERRORS},
    )
    def get(self, request: Request, task_id: str) -> Response:
        task = get_visible_task(request, task_id)
        after = _int_param(request, "after", 0, low=0, high=2**62)
        limit = _int_param(request, "limit", 100, low=1, high=MAX_EVENTS_PAGE)
        events = list(task.events.filter(seq__gt=after).order_by("seq")[:limit])
        return Response({
            "results": EventSerializer(events, many=True).data,
            "next_after": events[-1].seq if events else after,
        })


class TaskResult(APIView):
    @extend_schema(parameters=[TASK_ID], responses={200: ResultSerializer, 409: ERRORS[409], **READ_ERRORS})
    def get(self, request: Request, task_id: str) -> Response:
        task = get_visible_task(request, task_id)
        if task.result_version == 0:
            raise ApiError(f"the task is {task.status} and has no result yet", code="not_ready", status_code=409)
        return Response({"id": task.public_id, "status": task.status, "result": task.result,
                         "result_version": task.result_version})


class TaskCommand(APIView):
    """POST /api/tasks/{id}/<verb>: validate the body, call one action, answer 202 with the task."""

    body: type[serializers.Serializer]

    def perform(self, task: Task, user: Any, data: dict[str, Any]) -> Task:
        raise NotImplementedError

    def post(self, request: Request, task_id: str) -> Response:
        task = get_visible_task(request, task_id)
        body = self.body(data=request.data)
        body.is_valid(raise_exception=True)
        task = self.perform(task, request.user, body.validated_data)
        return Response(TaskSerializer(task).data, status=status.HTTP_202_ACCEPTED)


def _command_schema(body: type[serializers.Serializer]) -> Any:
    return extend_schema_view(post=extend_schema(request=body, parameters=[TASK_ID],
                                                 responses={202: TaskSerializer, **ERRORS}))


@_command_schema(CancelSerializer)
class TaskCancel(TaskCommand):
    body = CancelSerializer

    def perform(self, task: Task, user: Any, data: dict[str, Any]) -> Task:
        return actions.request_cancel(task, user=user, reason=data["reason"], keep_results=data["keep_results"])


@_command_schema(PauseSerializer)
class TaskPause(TaskCommand):
    body = PauseSerializer

    def perform(self, task: Task, user: Any, data: dict[str, Any]) -> Task:
        return actions.request_pause(task, user=user, reason=data["reason"])


@_command_schema(ResumeSerializer)
class TaskResume(TaskCommand):
    body = ResumeSerializer

    def perform(self, task: Task, user: Any, data: dict[str, Any]) -> Task:
        return actions.resume(task, user=user, budget=data["budget"])


@_command_schema(AnswerSerializer)
class TaskAnswer(TaskCommand):
    body = AnswerSerializer
    throttle_classes = (AnswerThrottle,)

    def perform(self, task: Task, user: Any, data: dict[str, Any]) -> Task:
        answer = data["answer"]
        if isinstance(answer, str):
            return actions.answer(task, user=user, text=answer)
        return actions.answer(task, user=user, data=answer)
