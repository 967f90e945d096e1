"""Secrets and signatures per the Standard Webhooks specification, through the `standardwebhooks` package."""

from __future__ import annotations

import base64
import secrets
from datetime import UTC, datetime
from math import floor

from standardwebhooks import Webhook

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh signing secret in the spec's `whsec_<base64>` form."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def webhook_id(public_id: object) -> str:
    """The `webhook-id` of a delivery: stable across its attempts, unique across deliveries."""
    return f"msg_{getattr(public_id, 'hex', public_id)}"


def headers(*, message_id: str, at: datetime, body: str, signing_secrets: list[str]) -> dict[str, str]:
    """The three Standard Webhooks headers; one `v1,` signature per secret, space-separated (rotation overlap)."""
    at = at.astimezone(UTC)  # the package reads the time as UTC whatever its zone
    signatures = " ".join(Webhook(secret).sign(message_id, at, body) for secret in signing_secrets)
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(floor(at.timestamp())),
        "webhook-signature": signatures,
        "content-type": "application/json",
    }
