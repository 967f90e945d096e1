"""What signed a WebSocket in, and whether it still does: checked again while the socket is open.

A socket is authenticated once, at the handshake (AuthMiddlewareStack for a browser's session,
project/ws_auth.py for an API token), and may stay open for hours. Signing out deletes the
session; an admin can delete a token or deactivate a user; a password change invalidates the
other sessions. The stream consumers ask `still_signed_in` on a cadence and close the socket
when the answer turns to no. The functions here query the database: call them in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Literal

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model, load_backend
from django.utils.crypto import constant_time_compare
from rest_framework.authtoken.models import Token


@dataclass(frozen=True)
class Credential:
    """A session key or an API token key; the key stays out of reprs and so out of logs."""

    kind: Literal["session", "token"]
    key: str = field(repr=False)


def credential_of(scope: dict[str, Any], user: Any) -> Credential | None:
    """What authenticated `user` on this socket, or None when the scope does not say (a test's own scope)."""
    session = scope.get("session")
    # The session wins over a token in the handshake (project/asgi.py), so it is asked first.
    if session is not None and session.session_key and session.get(SESSION_KEY) == str(user.pk):
        return Credential("session", session.session_key)
    header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin1")
    kind, _, key = header.partition(" ")
    if kind.lower() == "token" and key.strip():
        return Credential("token", key.strip())
    return None


def still_signed_in(credential: Credential | None, user_id: int) -> bool:
    """Whether the credential still signs in this user, who is still active."""
    if credential is None:
        return get_user_model().objects.filter(pk=user_id, is_active=True).exists()
    if credential.kind == "token":
        return Token.objects.filter(key=credential.key, user_id=user_id, user__is_active=True).exists()
    return _session_signs_in(credential.key, user_id)


def _session_signs_in(session_key: str, user_id: int) -> bool:
    # django.contrib.auth.get_user's checks, without its side effects: on a fallback secret it
    # cycles the session key, which a socket cannot hand back to the browser.
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key).load()  # {} once deleted
    backend_path = session.get(BACKEND_SESSION_KEY)
    if str(session.get(SESSION_KEY)) != str(user_id) or backend_path not in settings.AUTHENTICATION_BACKENDS:
        return False
    user = load_backend(backend_path).get_user(user_id)  # None for an inactive user (ModelBackend)
    if user is None:
        return False
    if not hasattr(user, "get_session_auth_hash"):
        return True
    session_hash = session.get(HASH_SESSION_KEY)
    if not session_hash:
        return False
    hashes = [user.get_session_auth_hash(), *user.get_session_auth_fallback_hash()]
    return any(constant_time_compare(session_hash, known) for known in hashes)
