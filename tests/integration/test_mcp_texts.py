"""What Longhaul keeps of an MCP server's texts (tasks/mcp/calls.py): sizes measured once, redaction that
hides the server's internals without rewriting a tool's result, and no unbounded text from the server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tasks.errors import PermanentError
from tasks.mcp import calls, client, config
from tasks.mcp.client import InputNeeded, InputRequest, RemoteTask, ServerConfig, ToolResult

URL = "http://reports.internal:8080/mcp"
SECRET = "Bearer s3cret-token-value"
INTERNAL = "node-7.cluster"
LONG_HANDLE = "task-7f3a9c2e41"


@pytest.fixture
def server(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """A server named "tools" with a secret header, its own internal node name listed under `redact`."""
    monkeypatch.setenv("TOOLS_AUTHORIZATION", SECRET)
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"servers": {"tools": {
        "transport": "http", "url": URL, "headers_from_env": {"Authorization": "TOOLS_AUTHORIZATION"},
        "redact": [INTERNAL]}}}))
    settings.LONGHAUL_MCP_SERVERS = str(path)
    return config.servers()["tools"].config


def question(message: str, schema: dict[str, Any] | None = None) -> InputRequest:
    raw = {"method": "elicitation/create", "params": {"mode": "form", "message": message, "requestedSchema": schema}}
    return InputRequest(key="q", method="elicitation/create", message=message, schema=schema, raw=raw)


# --- sizes ----------------------------------------------------------------------------------------


def test_a_question_is_measured_once_so_one_of_40_kib_is_kept(server: ServerConfig) -> None:
    (stored,) = calls.input_requests([question("x" * 40_000)], server=server)

    assert stored["message"] == "x" * 40_000


def test_a_question_over_64_kib_is_refused(server: ServerConfig) -> None:
    with pytest.raises(calls.TooBig, match="over the limit of 64 KiB"):
        calls.input_requests([question("x" * 70_000)], server=server)


def asked_first(server: ServerConfig, monkeypatch: pytest.MonkeyPatch, request_state: str) -> dict[str, Any]:
    """What a tools/call stores when the server asks before it starts, sending `request_state` back."""
    async def call_tool_async(*args: Any, **kwargs: Any) -> InputNeeded:
        return InputNeeded(requests=(question("Really start?"),), request_state=request_state)

    monkeypatch.setattr(client, "call_tool_async", call_tool_async)
    return asyncio.run(calls._call_tool(server, {"server": "tools", "tool": "build", "arguments": {}}))


def test_a_request_state_over_64_kib_is_a_protocol_error(server: ServerConfig,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PermanentError, match="protocol error") as raised:
        asked_first(server, monkeypatch, "s" * 70_000)

    assert "64 KiB" in str(raised.value)
    assert "sss" not in str(raised.value)


def test_a_request_state_under_64_kib_is_kept(server: ServerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    stored = asked_first(server, monkeypatch, "s" * 60_000)

    assert stored["input_needed"]["request_state"] == "s" * 60_000


# --- redaction --------------------------------------------------------------------------------------


def test_a_results_words_are_not_scrubbed_by_the_servers_name(server: ServerConfig) -> None:
    result = ToolResult(text="Found 3 tools for you.", content=[], is_error=False,
                        structured={"kind": "tools", "names": ["tools", "hammer"]})

    stored = calls.tool_result(result, server=server, handle=LONG_HANDLE)

    assert stored["text"] == "Found 3 tools for you."
    assert stored["structured"] == {"kind": "tools", "names": ["tools", "hammer"]}


def test_a_result_still_loses_urls_hosts_secrets_internal_names_and_a_long_handle(server: ServerConfig) -> None:
    text = f"{LONG_HANDLE} ran on {INTERNAL} behind {URL} (host reports.internal) with {SECRET}"
    result = ToolResult(text=text, content=[], is_error=False, structured={"log": text})

    stored = calls.tool_result(result, server=server, handle=LONG_HANDLE)

    expected = "[remote task] ran on [server] behind [server] (host [server]) with [server]"
    assert stored["text"] == expected
    assert stored["structured"] == {"log": expected}


def test_what_the_server_says_of_itself_is_still_scrubbed_of_its_name(server: ServerConfig) -> None:
    task = RemoteTask(task_id=LONG_HANDLE, status="failed", status_message="tools is busy", poll_interval_ms=None,
                      ttl_ms=None, result=None, error=f"tools crashed on {INTERNAL}", input_requests=())

    stored = calls.remote_task(task, server=server)

    assert stored["status_message"] == "[server] is busy"
    assert stored["error"] == "[server] crashed on [server]"


@pytest.mark.parametrize("handle", ["42", "job-7", "abc1234"])
def test_a_handle_shorter_than_8_characters_is_never_replaced(server: ServerConfig, handle: str) -> None:
    text = f"step {handle} of {handle}: {handle}"
    result = ToolResult(text=text, content=[], is_error=False, structured={"id": handle})
    task = RemoteTask(task_id=handle, status="completed", status_message=text, poll_interval_ms=None, ttl_ms=None,
                      result=result, error=None, input_requests=())

    stored = calls.remote_task(task, server=server)

    assert stored["status_message"] == text
    assert stored["result"]["text"] == text and stored["result"]["structured"] == {"id": handle}
    assert calls.redact(text, handle=handle) == text


def test_a_handle_of_8_characters_is_replaced() -> None:
    assert calls.redact("job abcd1234 failed", handle="abcd1234") == "job [remote task] failed"


def test_a_questions_choices_are_scrubbed_like_its_titles(server: ServerConfig) -> None:
    schema = {"type": "object", "properties": {
        "node": {"type": "string", "title": f"Node ({INTERNAL})", "enum": [INTERNAL, "spare"],
                 "enumNames": [f"the {INTERNAL} node", "spare"], "default": INTERNAL},
        "route": {"type": "string", "oneOf": [{"const": URL, "title": f"via {URL}"}, {"const": "direct"}]},
    }}

    (stored,) = calls.input_requests([question("Where should it run?", schema)], server=server, handle=LONG_HANDLE)

    node, route = stored["schema"]["properties"]["node"], stored["schema"]["properties"]["route"]
    assert node == {"type": "string", "title": "Node ([server])", "enum": ["[server]", "spare"],
                    "enumNames": ["the [server] node", "spare"], "default": "[server]"}
    assert route["oneOf"] == [{"const": "[server]", "title": "via [server]"}, {"const": "direct"}]
    assert INTERNAL not in json.dumps(stored) and URL not in json.dumps(stored)
