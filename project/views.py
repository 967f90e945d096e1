"""Small project-wide views: health, and JSON errors for API paths."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.forms import AuthenticationForm
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def healthz(request: HttpRequest) -> JsonResponse:
    """200 when the database answers; load balancers and `make run` poll it."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any database failure means unhealthy
        return JsonResponse({"status": "unhealthy", "database": type(exc).__name__}, status=503)
    return JsonResponse({"status": "ok", "database": connection.vendor})


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith("/api/"):
        return JsonResponse({"error": "not found", "code": "not_found"}, status=404)
    return render(request, "404.html", status=404)


def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith("/api/"):
        return JsonResponse({"error": "internal error", "code": "internal"}, status=500)
    return render(request, "500.html", status=500)


def sign_in_locked_out(request: HttpRequest, original_response: HttpResponse | None = None,
                       credentials: dict[str, Any] | None = None) -> HttpResponse:
    """django-axes lockout response: the sign-in page again, saying how long to wait (429, Retry-After)."""
    # Set by project.sign_in_backoff; axes' async middleware passes the credentials in the wrong argument,
    # so nothing here relies on them.
    wait = getattr(request, "sign_in_wait_seconds", 1)
    form = AuthenticationForm(request, initial={"username": request.POST.get("username", "")})
    response = render(request, "registration/login.html", {
        "form": form, "wait_seconds": wait, "next": request.POST.get("next", ""),
    }, status=429)
    response["Retry-After"] = str(wait)
    return response
