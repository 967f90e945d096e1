"""The MCP servers file: both formats, secrets from the environment, mistakes named."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from tasks.checks import mcp_servers_file
from tasks.mcp import config

TOML = """
[servers.reports]
transport = "http"
url = "https://reports.example.com/mcp"
headers_from_env = { Authorization = "REPORTS_AUTH" }
timeout_s = 12
tenants = ["acme"]
title = "Quarterly reports"
redact = ["reports-worker-7", "rpt-internal"]

[servers.render]
transport = "stdio"
command = ["render-mcp", "--quiet"]
env_from_env = { RENDER_TOKEN = "RENDER_TOKEN" }
"""


def write(tmp_path: Path, text: str, suffix: str = ".toml") -> Path:
    path = tmp_path / f"servers{suffix}"
    path.write_text(text)
    return path


def test_a_toml_file_names_servers_with_secrets_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REPORTS_AUTH", "Bearer s3cret")
    monkeypatch.setenv("RENDER_TOKEN", "r-token")
    servers = config.load(write(tmp_path, TOML))
    reports, render = servers["reports"], servers["render"]
    assert reports.config.transport == "http" and reports.config.url == "https://reports.example.com/mcp"
    assert reports.config.headers == {"Authorization": "Bearer s3cret"}
    assert reports.config.timeout_s == 12
    assert reports.allows("acme") and not reports.allows("globex")
    assert render.config.command == ("render-mcp", "--quiet") and render.config.env == {"RENDER_TOKEN": "r-token"}
    assert render.allows("globex"), "no tenants listed: every tenant"
    assert reports.title == "Quarterly reports" and render.title == "render", "the name, when no title is given"
    assert reports.redact == ("reports-worker-7", "rpt-internal") and render.redact == ()


def test_a_json_file_works_the_same(tmp_path):
    path = write(tmp_path, '{"servers": {"echo": {"transport": "http", "url": "http://127.0.0.1:9/mcp"}}}', ".json")
    assert config.load(path)["echo"].config.url == "http://127.0.0.1:9/mcp"


@pytest.mark.parametrize("text, words", [
    ('[servers.x]\ntransport = "ftp"', "transport must be"),
    ('[servers.x]\ntransport = "http"', "needs a url"),
    ('[servers.x]\ntransport = "stdio"\ncommand = []', "needs command"),
    ('[servers.x]\ntransport = "http"\nurl = "http://h/mcp"\ncolour = "red"', "unknown field 'colour'"),
    ('[servers.x]\ntransport = "http"\nurl = "http://h/mcp"\ntimeout_s = -1', "timeout_s"),
    ('[servers.x]\ntransport = "http"\nurl = "http://h/mcp"\nheaders_from_env = { A = "NOT_SET_ANYWHERE_42" }',
     "NOT_SET_ANYWHERE_42 is not set"),
    ('[servers.x]\ntransport = "http"\nurl = "http://h/mcp"\ntitle = ""', "title must be text"),
    ('[servers.x]\ntransport = "http"\nurl = "http://h/mcp"\nredact = "node-7"', "redact must be a list"),
    ('[servers.x]\ntransport = "http"\nurl = "http://h/mcp"\nredact = ["x"]', "at least 2 characters"),
    ('[other]\nx = 1', "`servers` table"),
    ('[servers.x\n', "not valid toml"),
])
def test_mistakes_name_the_server_and_the_field(tmp_path, text, words):
    with pytest.raises(ImproperlyConfigured) as caught:
        config.load(write(tmp_path, text))
    assert words in str(caught.value)


def test_the_system_check_reports_a_broken_file(tmp_path, settings):
    settings.LONGHAUL_MCP_SERVERS = str(write(tmp_path, '[servers.x]\ntransport = "ftp"'))
    errors = mcp_servers_file()
    assert [e.id for e in errors] == ["longhaul.E001"] and "transport must be" in errors[0].msg
    settings.LONGHAUL_MCP_SERVERS = str(tmp_path / "missing.toml")
    assert "cannot read" in mcp_servers_file()[0].msg
    settings.LONGHAUL_MCP_SERVERS = ""
    assert mcp_servers_file() == []


def test_a_file_broken_while_running_keeps_the_servers_read_before(tmp_path, settings, caplog):
    path = write(tmp_path, '[servers.a]\ntransport = "http"\nurl = "http://127.0.0.1:9/mcp"')
    settings.LONGHAUL_MCP_SERVERS = str(path)
    assert list(config.servers()) == ["a"]
    path.write_text('[servers.a]\ntransport = "ftp"')
    import os
    os.utime(path, (path.stat().st_atime + 5, path.stat().st_mtime + 5))  # a new version, whatever the clock
    assert list(config.servers()) == ["a"], "the last good servers"
    assert "transport must be" in caplog.text
    settings.LONGHAUL_MCP_SERVERS = str(tmp_path / "gone.toml")
    assert config.servers() == {}
