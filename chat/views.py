"""Chat pages: server-rendered shells that the page's ES module brings to life."""

from __future__ import annotations

from uuid import UUID

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from chat.models import Thread


def _threads(request: HttpRequest):
    return Thread.objects.filter(tenant=request.tenant, owner=request.user, deleted=False).order_by("-updated_at")


@login_required
def chat_page(request: HttpRequest) -> HttpResponse:
    return render(request, "chat/page.html", {"threads": _threads(request)[:100], "tenant": request.tenant,
                                              "thread": None})


@login_required
def thread_page(request: HttpRequest, thread_id: UUID) -> HttpResponse:
    """A thread of the user's own; any other (another tenant's, deleted, unknown) is a 404."""
    thread = _threads(request).filter(public_id=thread_id).first()
    if thread is None:
        raise Http404("no such thread")
    return render(request, "chat/page.html", {"threads": _threads(request)[:100], "tenant": request.tenant,
                                              "thread": thread})
