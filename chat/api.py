"""The thread REST API. Thin: parse, authorize, call chat.runs or tasks.actions."""

from __future__ import annotations

from django.db.models import Count, OuterRef, QuerySet, Subquery, Window
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from chat import deletion, proposals, runs
from chat.models import Message, Proposal, Run, Thread
from chat.serializers import (
    DecisionSerializer,
    MessagePageSerializer,
    MessageSerializer,
    PanelPageSerializer,
    PanelTaskSerializer,
    PostMessageSerializer,
    ProposalSerializer,
    RunSerializer,
    ThreadPageSerializer,
    ThreadSerializer,
    ThreadWriteSerializer,
)
from project.api_errors import ApiError, get_by_public_id
from project.throttles import MessageThrottle, ThreadThrottle
from tasks.api import (
    CURSOR,
    ERRORS,
    IDEMPOTENCY_KEY,
    IDEMPOTENCY_KEY_PARAMETER,
    READ_ERRORS,
    _int_param,
    request_tenant,
)
from tasks.models import Task, TaskEvent
from tasks.statuses import TERMINAL

THREAD_ID = OpenApiParameter("thread_id", OpenApiTypes.UUID, OpenApiParameter.PATH)
PROPOSAL_ID = OpenApiParameter("proposal_id", OpenApiTypes.UUID, OpenApiParameter.PATH)
MAX_MESSAGES_PAGE = 500
PANEL_LIMIT, MAX_PANEL_LIMIT = 50, 200
PHASES = ("admitted", "planning", "searching", "source_read", "evidence_added", "drafting", "waiting_tool",
          "retry_scheduled", "input_required", "step_done", "recovered", "paused", "cancel_requested",
          "remote_started", "progress", "answer_sent", "cancelling_remote", "remote_cancel_sent")


def owned_threads(request: Request) -> QuerySet[Thread]:
    return Thread.objects.filter(tenant=request_tenant(request), owner=request.user)


def get_thread(request: Request, thread_id: str) -> Thread:
    return get_by_public_id(owned_threads(request), thread_id, noun="thread")


def panel_tasks(thread: Thread, *, limit: int = PANEL_LIMIT) -> tuple[list[Task], int]:
    """The thread's tasks for the panel, at most `limit`: active ones first, then the recently
    ended, newest first in each, with each one's latest phase; and how many of its tasks are active,
    listed or not (the badge, which also sets how soon the panel looks again).

    The count comes with the active rows, from the same statement, so it counts every active task
    listed; the ended ones are read after, leaving out those listed: a task that ended between the two
    reads is listed once, as active, until the next look. (Read apart, it was listed twice, and could be
    counted apart from its row.)
    """
    latest_phase = TaskEvent.objects.filter(task=OuterRef("pk"), kind__in=PHASES).order_by("-seq").values("kind")[:1]
    tasks = Task.objects.filter(thread=thread).annotate(latest_phase=Subquery(latest_phase)).order_by("-created_at")
    active = list(tasks.exclude(status__in=TERMINAL).annotate(active_in_thread=Window(Count("pk")))[:limit])
    ended = (list(tasks.filter(status__in=TERMINAL).exclude(pk__in=[task.pk for task in active])[:limit - len(active)])
             if len(active) < limit else [])
    return active + ended, active[0].active_in_thread if active else 0


def proposals_of(thread: Thread, messages: list[Message]) -> dict[str, Proposal]:
    """The proposals these messages show or decide, by public id: one query for a page of messages."""
    ids = {str(m.data.get(key)) for m in messages if isinstance(m.data, dict)
           for key in ("proposal", "decides") if m.data.get(key)}
    rows = Proposal.objects.filter(thread=thread, public_id__in=ids) if ids else []
    return {str(p.public_id): p for p in rows}


class ThreadList(APIView):
    throttle_classes = (ThreadThrottle,)  # POST only

    @extend_schema(operation_id="threads_list", responses={200: ThreadPageSerializer, 401: ERRORS[401], 403: ERRORS[403]})
    def get(self, request: Request) -> Response:
        threads = owned_threads(request).order_by("-updated_at")[:200]
        return Response({"results": ThreadSerializer(threads, many=True).data})

    @extend_schema(request=ThreadWriteSerializer, responses={201: ThreadSerializer, **ERRORS})
    def post(self, request: Request) -> Response:
        body = ThreadWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        thread = Thread.objects.create(tenant=request_tenant(request), owner=request.user,
                                       title=body.validated_data["title"].strip())
        return Response(ThreadSerializer(thread).data, status=status.HTTP_201_CREATED)


class ThreadDetail(APIView):
    @extend_schema(parameters=[THREAD_ID], responses={200: ThreadSerializer, **READ_ERRORS})
    def get(self, request: Request, thread_id: str) -> Response:
        return Response(ThreadSerializer(get_thread(request, thread_id)).data)

    @extend_schema(request=ThreadWriteSerializer, parameters=[THREAD_ID], responses={200: ThreadSerializer, **ERRORS})
    def patch(self, request: Request, thread_id: str) -> Response:
        thread = get_thread(request, thread_id)
        body = ThreadWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        thread.title = body.validated_data["title"].strip()
        thread.save(update_fields=["title", "updated_at"])
        return Response(ThreadSerializer(thread).data)

    @extend_schema(parameters=[THREAD_ID], responses={204: None, **READ_ERRORS},
                   description="Delete the thread with its messages, runs and tasks. Its active tasks are "
                               "cancelled first; they disappear at once and are deleted when they end.")
    def delete(self, request: Request, thread_id: str) -> Response:
        deletion.delete_thread(get_thread(request, thread_id), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ThreadMessages(APIView):
    throttle_classes = (MessageThrottle,)  # POST only

    @extend_schema(parameters=[THREAD_ID, OpenApiParameter("after", CURSOR),
                               OpenApiParameter("limit", {"type": "integer", "minimum": 1,
                                                          "maximum": MAX_MESSAGES_PAGE})],
                   responses={200: MessagePageSerializer, 400: ERRORS[400], **READ_ERRORS})
    def get(self, request: Request, thread_id: str) -> Response:
        thread = get_thread(request, thread_id)
        after = _int_param(request, "after", 0, low=0, high=2**62)
        limit = _int_param(request, "limit", 100, low=1, high=MAX_MESSAGES_PAGE)
        # Busy first: a run that ends between the two reads is then still called busy and its reply comes
        # with the next poll. The other way round, the page could lack the reply and say not busy, and the
        # chat page, which fetches again only while busy (a run's end sends nothing on its socket), would
        # wait for ever.
        busy = Run.objects.filter(thread=thread, status__in=runs.ACTIVE).exists()
        messages = list(Message.objects.filter(thread=thread, hidden=False, seq__gt=after)
                        .select_related("run").order_by("seq")[:limit])
        context = {"proposals": proposals_of(thread, messages)}
        return Response({"results": MessageSerializer(messages, many=True, context=context).data,
                         "next_after": messages[-1].seq if messages else after, "busy": busy})

    @extend_schema(request=PostMessageSerializer,
                   parameters=[THREAD_ID, IDEMPOTENCY_KEY_PARAMETER],
                   responses={202: RunSerializer, 200: RunSerializer, **ERRORS})
    def post(self, request: Request, thread_id: str) -> Response:
        thread = get_thread(request, thread_id)
        body = PostMessageSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key")
        if key is not None and not IDEMPOTENCY_KEY.match(key):
            raise ApiError("Idempotency-Key must be 1 to 255 printable ASCII characters without spaces",
                           code="invalid_input", field="Idempotency-Key")
        scoped_key = f"chat:{request.user.pk}:{key}" if key else None
        run, created = runs.start_run(thread, kind=Run.Kind.CHAT, user_text=body.validated_data["content"],
                                      hidden=False, key=scoped_key)
        if created and not thread.title and run.messages.filter(role=Message.Role.USER, seq=1).exists():
            # The thread's first message names it (only the request that wrote message 1 gets here; a title the
            # user set meanwhile wins: it is read above, and a rename after this replaces it anyway).
            Thread.objects.filter(pk=thread.pk).update(title=body.validated_data["content"][:60])
        return Response(RunSerializer(run).data, status=status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK)


class ThreadTasks(APIView):
    @extend_schema(parameters=[THREAD_ID, OpenApiParameter("limit", {"type": "integer", "minimum": 1,
                                                                     "maximum": MAX_PANEL_LIMIT})],
                   responses={200: PanelPageSerializer, 400: ERRORS[400], **READ_ERRORS})
    def get(self, request: Request, thread_id: str) -> Response:
        thread = get_thread(request, thread_id)
        limit = _int_param(request, "limit", PANEL_LIMIT, low=1, high=MAX_PANEL_LIMIT)
        tasks, active = panel_tasks(thread, limit=limit)
        return Response({"results": PanelTaskSerializer(tasks, many=True).data, "active": active})


class ProposalDetail(APIView):
    """A side effect the model proposed in a thread (chat/proposals.py), and the user's decision on it."""

    @extend_schema(parameters=[THREAD_ID, PROPOSAL_ID], responses={200: ProposalSerializer, **READ_ERRORS})
    def get(self, request: Request, thread_id: str, proposal_id: str) -> Response:
        return Response(ProposalSerializer(get_proposal(request, thread_id, proposal_id)).data)

    @extend_schema(request=DecisionSerializer, parameters=[THREAD_ID, PROPOSAL_ID],
                   responses={200: ProposalSerializer, **ERRORS})
    def post(self, request: Request, thread_id: str, proposal_id: str) -> Response:
        proposal = get_proposal(request, thread_id, proposal_id)
        body = DecisionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        decided = proposals.decide(proposal, user=request.user, decision=body.validated_data["decision"])
        return Response(ProposalSerializer(decided).data)


def get_proposal(request: Request, thread_id: str, proposal_id: str) -> Proposal:
    """A proposal of one of the user's own threads; any other is the same 404 as an unknown one."""
    thread = get_thread(request, thread_id)
    return get_by_public_id(Proposal.objects.filter(thread=thread), proposal_id, noun="proposal")
