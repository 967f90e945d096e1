"""GET /api/features: what the page may offer, per tenant."""

from __future__ import annotations

import json

import pytest

from tests.conftest import api_client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def servers_file(tmp_path, settings):
    """One remote MCP server, for acme only."""
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"reports": {
        "transport": "http", "url": "http://127.0.0.1:9/mcp", "title": "Report Studio", "tenants": ["acme"]}}}))
    settings.LONGHAUL_MCP_SERVERS = str(path)
    return path


def test_it_says_what_a_plain_deployment_offers(alice_api, settings):
    settings.LONGHAUL_MCP_SERVERS = ""
    settings.LONGHAUL_SEARCH_URL = ""
    settings.LONGHAUL_MODEL_PROVIDER = "offline"
    response = alice_api.get("/api/features")
    assert response.status_code == 200
    assert response.json() == {"task_panel": True, "remote_tools": False,
                               "research": {"provider": "offline", "corpus": True}}


def test_remote_tools_are_on_only_for_a_tenant_with_a_server(servers_file, alice_api, charlie):
    assert alice_api.get("/api/features").json()["remote_tools"] is True
    assert api_client_for(charlie).get("/api/features").json()["remote_tools"] is False


def test_it_says_when_the_task_panel_is_off(alice_api, settings):
    settings.LONGHAUL_TASK_PANEL = False
    assert alice_api.get("/api/features").json()["task_panel"] is False


def test_research_over_the_web_has_no_corpus(alice_api, settings):
    settings.LONGHAUL_SEARCH_URL = "https://search.example.com/search"
    settings.LONGHAUL_MODEL_PROVIDER = "openai"
    assert alice_api.get("/api/features").json()["research"] == {"provider": "openai", "corpus": False}


def test_it_answers_only_a_signed_in_member(client, db):
    assert client.get("/api/features").status_code in (401, 403)
