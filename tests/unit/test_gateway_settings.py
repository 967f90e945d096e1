"""Gateway settings: project settings first, then the environment; a bad value names its variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from tasks.gateway.corpus import corpus_path
from tasks.gateway.fetch import visit_settings
from tasks.gateway.providers import get_provider, model_settings
from tasks.gateway.providers.offline import OfflineProvider
from tasks.gateway.providers.openai import OpenAIProvider
from tasks.gateway.tools import search_url

pytestmark = pytest.mark.smoke

NAMES = (
    "LONGHAUL_MODEL_PROVIDER", "LONGHAUL_MODEL_BASE_URL", "LONGHAUL_MODEL_API_KEY", "LONGHAUL_MODEL",
    "LONGHAUL_MODEL_TIMEOUT_S", "LONGHAUL_OFFLINE_LATENCY_MS", "LONGHAUL_SEARCH_URL",
    "LONGHAUL_ALLOW_PRIVATE_FETCH", "LONGHAUL_VISIT_MAX_BYTES", "LONGHAUL_VISIT_TIMEOUT_S", "LONGHAUL_CORPUS_PATH",
)


@pytest.fixture
def from_env(settings, monkeypatch):
    """Read every gateway setting from the environment, as before settings.py names them."""
    for name in NAMES:
        delattr(settings, name)
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_it_defaults_to_the_offline_provider(from_env, settings):
    config = model_settings()

    assert config.provider == "offline"
    assert config.timeout_s == 60.0
    assert config.offline_latency_ms == 0
    assert isinstance(get_provider(), OfflineProvider)
    assert visit_settings().allow_private is False
    assert visit_settings().max_bytes == 2_000_000
    assert visit_settings().timeout_s == 15.0
    assert search_url() == ""
    assert corpus_path() == Path(settings.VAR_DIR) / "corpus.sqlite3"


def test_it_builds_the_openai_provider_from_the_environment(from_env):
    from_env.setenv("LONGHAUL_MODEL_PROVIDER", "OpenAI")
    from_env.setenv("LONGHAUL_MODEL_BASE_URL", "http://127.0.0.1:11434/v1/")
    from_env.setenv("LONGHAUL_MODEL_API_KEY", "sk-secret-value")
    from_env.setenv("LONGHAUL_MODEL", "llama3.2")
    from_env.setenv("LONGHAUL_MODEL_TIMEOUT_S", "12.5")

    provider = get_provider()

    assert isinstance(provider, OpenAIProvider)
    assert provider.config.base_url == "http://127.0.0.1:11434/v1"
    assert provider.config.timeout_s == 12.5
    assert provider.model == "llama3.2"
    assert "sk-secret-value" not in repr(provider.config)


def test_project_settings_win_over_the_environment(from_env, settings):
    from_env.setenv("LONGHAUL_VISIT_MAX_BYTES", "5000")
    settings.LONGHAUL_VISIT_MAX_BYTES = 9000

    assert visit_settings().max_bytes == 9000


@pytest.mark.parametrize(("name", "value"), [
    ("LONGHAUL_MODEL_PROVIDER", "anthropic"),
    ("LONGHAUL_MODEL_BASE_URL", "ftp://models"),
    ("LONGHAUL_MODEL_TIMEOUT_S", "soon"),
    ("LONGHAUL_OFFLINE_LATENCY_MS", "-1"),
])
def test_it_refuses_a_bad_model_setting_naming_it(from_env, name, value):
    from_env.setenv(name, value)

    with pytest.raises(ImproperlyConfigured, match=name):
        model_settings()


@pytest.mark.parametrize(("name", "value"), [
    ("LONGHAUL_ALLOW_PRIVATE_FETCH", "sometimes"),
    ("LONGHAUL_VISIT_MAX_BYTES", "10"),
    ("LONGHAUL_VISIT_TIMEOUT_S", "0"),
])
def test_it_refuses_a_bad_visit_setting_naming_it(from_env, name, value):
    from_env.setenv(name, value)

    with pytest.raises(ImproperlyConfigured, match=name):
        visit_settings()


def test_it_refuses_a_search_url_that_is_not_http(from_env):
    from_env.setenv("LONGHAUL_SEARCH_URL", "file:///etc/passwd")

    with pytest.raises(ImproperlyConfigured, match="LONGHAUL_SEARCH_URL"):
        search_url()


@pytest.mark.parametrize(("missing", "name"), [("LONGHAUL_MODEL_BASE_URL", "LONGHAUL_MODEL_BASE_URL"),
                                               ("LONGHAUL_MODEL", "LONGHAUL_MODEL must")])
def test_the_openai_provider_needs_a_url_and_a_model(from_env, missing, name):
    from_env.setenv("LONGHAUL_MODEL_PROVIDER", "openai")
    from_env.setenv("LONGHAUL_MODEL_BASE_URL", "http://127.0.0.1:8080/v1")
    from_env.setenv("LONGHAUL_MODEL", "m")
    from_env.delenv(missing)

    with pytest.raises(ImproperlyConfigured, match=name):
        get_provider()
