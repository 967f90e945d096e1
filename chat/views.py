"""Chat pages: server-rendered shells that the page's ES module brings to life."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from chat.models import Thread


@login_required
def chat_page(request: HttpRequest) -> HttpResponse:
    threads = Thread.objects.filter(tenant=request.tenant, owner=request.user, deleted=False).order_by("-updated_at")
    return render(request, "chat/page.html", {"threads": threads[:100], "tenant": request.tenant})
