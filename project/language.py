"""The language of the pages: the browser's, unless the signed-in person chose one with the switch.

LocaleMiddleware reads the switch's cookie or Accept-Language first; UserLanguageMiddleware
then applies a signed-in person's own choice (chat.models.LanguagePreference), so the choice
follows them to any browser, and notes what their pages were shown in, for the replies the
workers write (reply_language).
"""

from __future__ import annotations

from django.conf import settings
from django.db import IntegrityError
from django.http import HttpRequest, HttpResponse
from django.utils import translation
from django.views.decorators.http import require_POST
from django.views.i18n import set_language as django_set_language

from chat.models import LanguagePreference


def supported(code: str) -> str | None:
    """The language of LANGUAGES that `code` names ("zh-hans", "zh-cn" -> "zh-hans"), or None."""
    try:
        return translation.get_supported_language_variant(code)
    except LookupError:
        return None


def remember(user_id: int, **fields: str) -> None:
    """Store `chosen` and/or `last_shown` for this person; a row appears on first use."""
    if LanguagePreference.objects.filter(user_id=user_id).update(**fields):
        return
    try:
        LanguagePreference.objects.create(user_id=user_id, **fields)
    except IntegrityError:  # another request created it meanwhile
        LanguagePreference.objects.filter(user_id=user_id).update(**fields)


def reply_language(user_id: int) -> str:
    """The language the assistant writes to this person in: their choice, else what their pages were last shown in."""
    row = LanguagePreference.objects.filter(user_id=user_id).values_list("chosen", "last_shown").first()
    code = (row[0] or row[1]) if row else ""
    return (supported(code) if code else None) or settings.LANGUAGE_CODE


# The pages whose language the assistant's replies follow: where people read them.
CHAT_PAGES = frozenset({"chat", "thread"})


def _is_chat_page(request: HttpRequest) -> bool:
    match = getattr(request, "resolver_match", None)
    return request.method == "GET" and match is not None and match.url_name in CHAT_PAGES


class UserLanguageMiddleware:
    """After authentication: a signed-in person's chosen language wins over the browser's."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = getattr(request, "user", None)
        # The page's own API calls (polled every few seconds) skip the lookup: the cookie set below carries the choice.
        signed_in = user is not None and user.is_authenticated and not request.path.startswith("/api/")
        row = None
        chosen = ""
        if signed_in:
            row = LanguagePreference.objects.filter(user_id=user.pk).values_list("chosen", "last_shown").first()
            chosen = supported(row[0]) if row and row[0] else ""
            if chosen:
                translation.activate(chosen)
                request.LANGUAGE_CODE = chosen
        response = self.get_response(request)
        if signed_in and not chosen and _is_chat_page(request) and (row is None or row[1] != request.LANGUAGE_CODE):
            remember(user.pk, last_shown=request.LANGUAGE_CODE)
        name = settings.LANGUAGE_COOKIE_NAME
        if chosen and request.COOKIES.get(name) != chosen and name not in response.cookies:
            # Signed out later, this browser keeps showing the pages in the person's language.
            _set_cookie(response, chosen)
        return response


def _set_cookie(response: HttpResponse, code: str) -> None:
    response.set_cookie(
        settings.LANGUAGE_COOKIE_NAME, code,
        max_age=settings.LANGUAGE_COOKIE_AGE, path=settings.LANGUAGE_COOKIE_PATH,
        domain=settings.LANGUAGE_COOKIE_DOMAIN, secure=settings.LANGUAGE_COOKIE_SECURE,
        httponly=settings.LANGUAGE_COOKIE_HTTPONLY, samesite=settings.LANGUAGE_COOKIE_SAMESITE,
    )


@require_POST
def set_language(request: HttpRequest) -> HttpResponse:
    """The header's switch: Django's set_language (cookie, then back to `next`), remembered for a signed-in person."""
    response = django_set_language(request)
    code = supported(request.POST.get("language", ""))
    if code and request.user.is_authenticated:
        remember(request.user.pk, chosen=code)
    return response
