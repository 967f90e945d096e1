"""WebSocket handshakes authenticated by the API's token (`Authorization: Token <key>`), for clients
that are not browsers (longhaul.client). A browser's session (AuthMiddlewareStack) is tried first and
wins; a browser cannot set this header on a WebSocket, so it opens no cross-site door."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware


@database_sync_to_async
def user_for_token(key: str) -> Any:
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    return token.user if token is not None and token.user.is_active else None


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if not getattr(scope.get("user"), "is_authenticated", False):
            header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin1")
            kind, _, key = header.partition(" ")
            if kind.lower() == "token" and key.strip():
                user = await user_for_token(key.strip())
                if user is not None:
                    scope = dict(scope, user=user)
        return await super().__call__(scope, receive, send)
