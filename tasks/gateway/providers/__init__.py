"""Model providers behind one interface: an offline extractive provider (the default, offline.py)
and any OpenAI-compatible chat-completions server (openai.py) (DESIGN §9).

A call has a purpose (plan, extract, draft, chat) with a payload and an output shape of
its own, described in shapes.py; both providers return the same shapes. This module holds
the call and result types, the provider interface, the settings, and `get_provider`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx2
from django.core.exceptions import ImproperlyConfigured

from project.env import envfloat, envint, envstr
from tasks.gateway import configured
from tasks.gateway.retry import RetryBudget, Sleep

PURPOSES = ("plan", "extract", "draft", "chat")
PROVIDERS = ("offline", "openai")
# Recorded on a task at start with the model: a change of prompts is a change of behaviour.
PROMPT_VERSION = "2"


@dataclass(frozen=True)
class ModelCall:
    purpose: str  # "plan" | "extract" | "draft" | "chat"
    payload: dict[str, Any]


@dataclass(frozen=True)
class ModelResult:
    output: dict[str, Any]
    usage: dict[str, int]  # {"prompt_tokens": n, "completion_tokens": m}
    model: str


class ModelProvider(Protocol):
    name: str
    model: str

    async def run(self, call: ModelCall, *, client: httpx2.AsyncClient, budget: RetryBudget) -> ModelResult: ...


# --- Settings -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSettings:
    provider: str
    base_url: str
    api_key: str = field(repr=False)
    model: str
    timeout_s: float
    offline_latency_ms: int


def _number(name: str, value: Any, *, minimum: float) -> float:
    """A numeric setting checked the same way whether it came from settings.py or the environment."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ImproperlyConfigured(f"{name} must be a number of at least {minimum:g}, got {value!r}")
    return value


def model_settings() -> ModelSettings:
    """The model gateway's settings; raises ImproperlyConfigured naming the variable on a bad value."""
    provider = str(configured("LONGHAUL_MODEL_PROVIDER", lambda n: envstr(n, "offline"))).strip().lower()
    if provider not in PROVIDERS:
        raise ImproperlyConfigured(f"LONGHAUL_MODEL_PROVIDER must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    base_url = str(configured("LONGHAUL_MODEL_BASE_URL", lambda n: envstr(n, ""))).strip()
    if base_url and not re.match(r"https?://[^/\s]+", base_url):
        raise ImproperlyConfigured(f"LONGHAUL_MODEL_BASE_URL must be an http(s) URL, got {base_url!r}")
    timeout = configured("LONGHAUL_MODEL_TIMEOUT_S", lambda n: envfloat(n, 60.0, minimum=0.001))
    latency = configured("LONGHAUL_OFFLINE_LATENCY_MS", lambda n: envint(n, 0, minimum=0))
    return ModelSettings(
        provider=provider,
        base_url=base_url.rstrip("/"),
        api_key=str(configured("LONGHAUL_MODEL_API_KEY", lambda n: envstr(n, ""))).strip(),
        model=str(configured("LONGHAUL_MODEL", lambda n: envstr(n, ""))).strip(),
        timeout_s=float(_number("LONGHAUL_MODEL_TIMEOUT_S", timeout, minimum=0.001)),
        offline_latency_ms=int(_number("LONGHAUL_OFFLINE_LATENCY_MS", latency, minimum=0)),
    )


def model_label() -> str:
    """The provider and model the settings name, as tasks and operations record them ("openai:gpt-4o"),
    at most 200 characters. "model:misconfigured" when the settings are wrong: the calls say why, on
    their task; recording what was pinned must not fail a submission or a call's outcome."""
    from tasks.gateway.providers.offline import OFFLINE_MODEL

    try:
        config = model_settings()
    except ImproperlyConfigured:
        return "model:misconfigured"
    return (f"openai:{config.model}" if config.provider == "openai" else f"offline:{OFFLINE_MODEL}")[:200]


def get_provider(*, sleep: Sleep = asyncio.sleep) -> ModelProvider:
    """The provider the settings name."""
    # Imported here: each provider module imports the types above.
    from tasks.gateway.providers.offline import OfflineProvider
    from tasks.gateway.providers.openai import OpenAIProvider

    config = model_settings()
    if config.provider == "openai":
        if not config.base_url:
            raise ImproperlyConfigured("LONGHAUL_MODEL_BASE_URL must be set when LONGHAUL_MODEL_PROVIDER=openai")
        if not config.model:
            raise ImproperlyConfigured("LONGHAUL_MODEL must name a model when LONGHAUL_MODEL_PROVIDER=openai")
        return OpenAIProvider(config, sleep=sleep)
    return OfflineProvider(latency_ms=config.offline_latency_ms, sleep=sleep)
