"""The remote MCP servers this deployment may call, read from LONGHAUL_MCP_SERVERS.

The setting names a TOML or JSON file (by its extension):

    [servers.reports]
    title = "Quarterly reports"  # optional: what users see (default: the name)
    transport = "http"
    url = "https://reports.example.com/mcp"
    headers_from_env = { Authorization = "REPORTS_AUTHORIZATION" }
    timeout_s = 30
    tenants = ["acme"]          # optional: only these tenants may use it
    redact = ["reports-worker-7"]  # optional: the server's own internal names, kept out of what users see
    confirm = true              # optional: a call the model proposes waits for the user's yes (default true)

    [servers.render]
    transport = "stdio"
    command = ["render-mcp", "--quiet"]
    env_from_env = { RENDER_TOKEN = "RENDER_TOKEN" }

Header and environment values come from this process's environment, never from the
file, so the file can be committed. A mistake names the server and the field.
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from tasks.mcp.client import ServerConfig

KNOWN_FIELDS = {"transport", "url", "command", "cwd", "headers_from_env", "env_from_env", "timeout_s", "tenants",
                "description", "title", "redact", "confirm"}
TITLE_CHARS = 100


@dataclass(frozen=True)
class Server:
    config: ServerConfig
    tenants: frozenset[str]  # slugs; empty: every tenant
    description: str
    # The display name users see; never the URL or command (defaults to the name).
    title: str = ""
    # Words the server says about itself (node names, internal hosts) that users must not see.
    redact: tuple[str, ...] = ()
    # A tool call the model proposes waits for the user's confirmation: a quoted page or a remote
    # tool's result can talk the model into calling. false trusts this server's tools to run unasked.
    confirm: bool = True

    def __post_init__(self) -> None:
        if not self.title:
            object.__setattr__(self, "title", self.config.name)

    @property
    def name(self) -> str:
        return self.config.name

    def allows(self, tenant_slug: str) -> bool:
        return not self.tenants or tenant_slug in self.tenants


log = logging.getLogger(__name__)
_cache: tuple[str, float, dict[str, Server]] | None = None


def servers() -> dict[str, Server]:
    """The configured servers by name, re-read when the file changes.

    A file broken while running (a half-saved edit, a variable unset) keeps the last good
    servers and logs the mistake, rather than failing every request that asks; the system
    check (tasks/checks.py) refuses to start with a broken file.
    """
    global _cache
    path = settings.LONGHAUL_MCP_SERVERS
    if not path:
        return {}
    last_good = _cache[2] if _cache is not None and _cache[0] == path else {}
    try:
        mtime = Path(path).stat().st_mtime
    except OSError as exc:
        log.error("LONGHAUL_MCP_SERVERS: cannot read %s (%s); keeping the servers read before", path, exc.strerror)
        return last_good
    if _cache is None or _cache[:2] != (path, mtime):
        try:
            fresh = read(path)
        except ImproperlyConfigured as exc:
            log.error("%s; keeping the servers read before", exc)
            fresh = last_good
        _cache = (path, mtime, fresh)  # a broken version is logged once, not on every call
    return _cache[2]


def read(path: str) -> dict[str, Server]:
    """The servers of the file at `path`; ImproperlyConfigured names what is wrong."""
    try:
        return load(Path(path))
    except OSError as exc:
        raise ImproperlyConfigured(f"LONGHAUL_MCP_SERVERS: cannot read {path}: {exc.strerror}") from None


def for_tenant(tenant_slug: str) -> list[Server]:
    return [s for s in servers().values() if s.allows(tenant_slug)]


def load(path: Path) -> dict[str, Server]:
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ImproperlyConfigured(f"LONGHAUL_MCP_SERVERS: {path} is not valid {path.suffix[1:] or 'JSON'}: {exc}")
    entries = raw.get("servers") if isinstance(raw, dict) else None
    if not isinstance(entries, dict):
        raise ImproperlyConfigured(f"LONGHAUL_MCP_SERVERS: {path} must have a `servers` table of named servers")
    return {name: _server(name, entry) for name, entry in entries.items()}


def _server(name: str, entry: Any) -> Server:
    def bad(message: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(f"LONGHAUL_MCP_SERVERS: server {name!r}: {message}")

    if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 64:
        raise bad("names are letters, digits, '-' and '_' (at most 64)")
    if not isinstance(entry, dict):
        raise bad("must be a table")
    unknown = sorted(set(entry) - KNOWN_FIELDS)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}")
    transport = entry.get("transport")
    timeout = entry.get("timeout_s", 30)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
        raise bad("timeout_s must be a number of seconds between 0 and 600")
    tenants = entry.get("tenants", [])
    if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
        raise bad("tenants must be a list of tenant slugs")
    description = entry.get("description", "")
    if not isinstance(description, str):
        raise bad("description must be text")
    title = entry.get("title", name)
    if not isinstance(title, str) or not title.strip() or len(title) > TITLE_CHARS:
        raise bad(f"title must be text of 1 to {TITLE_CHARS} characters")
    redact = entry.get("redact", [])
    if not isinstance(redact, list) or not all(isinstance(w, str) and len(w.strip()) >= 2 for w in redact):
        raise bad("redact must be a list of words of at least 2 characters")
    confirm = entry.get("confirm", True)
    if not isinstance(confirm, bool):
        raise bad("confirm must be true or false")
    if transport == "http":
        url = entry.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise bad("an http server needs a url starting with http:// or https://")
        config = ServerConfig(name=name, transport="http", url=url, timeout_s=float(timeout),
                              headers=_from_env(entry.get("headers_from_env", {}), "headers_from_env", bad))
    elif transport == "stdio":
        command = entry.get("command")
        if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
            raise bad("a stdio server needs command, a non-empty list of strings")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise bad("cwd must be a path")
        config = ServerConfig(name=name, transport="stdio", command=tuple(command), cwd=cwd, timeout_s=float(timeout),
                              env=_from_env(entry.get("env_from_env", {}), "env_from_env", bad))
    else:
        raise bad("transport must be \"http\" or \"stdio\"")
    return Server(config=config, tenants=frozenset(tenants), description=description, title=title.strip(),
                  redact=tuple(w.strip() for w in redact), confirm=confirm)


def _from_env(mapping: Any, field: str, bad: Any) -> Mapping[str, str]:
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise bad(f"{field} must map names to environment variable names")
    values = {}
    for key, variable in mapping.items():
        if variable not in os.environ:
            raise bad(f"{field}.{key}: environment variable {variable} is not set")
        values[key] = os.environ[variable]
    return values
