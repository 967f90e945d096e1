"""The fallback corpus where the Python documentation is not installed: pydoc's reference topics and docstrings.

CPython ships both, so this corpus exists on every machine; it is smaller and terser than
the documentation (no glossary, tutorial or how-tos), and the report says when it answered.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

from tasks.gateway.corpus import _UNDERLINE, MODULE_PREFIX, reflow

TOPIC_PREFIX = "corpus://topic/"


# Packages before their submodules, so a re-exported object is named by its public path
# (asyncio.Task, not asyncio.tasks.Task); each object is indexed once.
MODULES = (
    "asyncio", "asyncio.tasks", "asyncio.futures", "asyncio.exceptions", "asyncio.timeouts",
    "asyncio.taskgroups", "asyncio.locks", "asyncio.queues", "asyncio.events", "asyncio.base_events",
    "asyncio.streams", "asyncio.subprocess", "asyncio.runners", "asyncio.coroutines", "asyncio.threads",
    "concurrent.futures", "threading", "multiprocessing", "queue", "contextlib", "contextvars",
    "json", "pathlib", "os", "os.path", "shutil", "tempfile", "io", "functools", "itertools",
    "operator", "collections", "collections.abc", "heapq", "bisect", "typing", "dataclasses", "enum",
    "abc", "types", "inspect", "logging", "logging.handlers", "warnings", "traceback", "subprocess",
    "signal", "selectors", "socket", "ssl", "http", "http.client", "http.server", "http.cookies",
    "urllib", "urllib.parse", "urllib.request", "urllib.error", "email.message", "sqlite3", "re",
    "string", "textwrap", "difflib", "datetime", "time", "zoneinfo", "calendar", "unittest",
    "unittest.mock", "doctest", "argparse", "csv", "hashlib", "hmac", "secrets", "random",
    "statistics", "math", "decimal", "fractions", "uuid", "base64", "struct", "pickle", "copy",
    "weakref", "gc", "zipfile", "tarfile", "gzip", "shlex", "glob", "fnmatch", "sched", "importlib",
    "pprint", "timeit", "sys",
)


def topic_documents() -> Iterator[tuple[str, str, str]]:
    """(url, title, text) of each language reference topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return
    for name in sorted(topics):
        raw = topics[name]
        lines = raw.split("\n", 2)
        title = name
        if len(lines) > 1 and _UNDERLINE.fullmatch(lines[1]) and lines[0].strip():
            title = lines[0].strip()
        yield TOPIC_PREFIX + name, title, reflow(raw)


def _signature(name: str, obj: Any) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    # Default values can print memory addresses ("<weakref at 0x7f...>"): the index must not vary by run.
    signature = re.sub(r" at 0x[0-9a-fA-F]+", "", signature)
    return name + (signature if len(signature) <= 300 else signature[:299] + "…)")


def _own_doc(obj: Any) -> str:
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _public_members(module: Any) -> list[tuple[str, Any]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    members = []
    for name in sorted(set(names)):
        obj = getattr(module, name, None)
        if obj is None or inspect.ismodule(obj):
            continue
        home = getattr(obj, "__module__", "") or ""
        # Without __all__, skip names a module merely imported from elsewhere.
        if not hasattr(module, "__all__") and home.lstrip("_").split(".")[0] != module.__name__.split(".")[0]:
            continue
        if inspect.isclass(obj) or callable(obj):
            members.append((name, obj))
    return members


def _class_members(cls: type) -> Iterator[tuple[str, Any]]:
    for name, attr in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        target = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        if callable(target) or isinstance(attr, property):
            yield name, target


def module_documents() -> Iterator[tuple[str, str, str]]:
    """(url, title, text) of each standard-library module and its documented public classes and functions."""
    seen: set[int] = set()

    def document(dotted: str, obj: Any, *, signature: bool) -> tuple[str, str, str] | None:
        if id(obj) in seen:
            return None
        seen.add(id(obj))
        doc = _own_doc(obj)
        if len(doc) < 15:
            return None
        head = _signature(dotted, obj) if signature else dotted
        return MODULE_PREFIX + dotted, dotted, f"{head}\n\n{reflow(doc)}"

    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a build without ssl, sqlite3, ...: index what there is
            continue
        entry = document(module_name, module, signature=False)
        if entry:
            yield entry
        for name, obj in _public_members(module):
            dotted = f"{module_name}.{name}"
            first_time = id(obj) not in seen
            entry = document(dotted, obj, signature=not inspect.isclass(obj))
            if entry:
                yield entry
            if inspect.isclass(obj) and first_time:
                for member_name, member in _class_members(obj):
                    entry = document(f"{dotted}.{member_name}", member, signature=False)
                    if entry:
                        yield entry


def documents() -> Iterator[tuple[str, str, str]]:
    """Every document of the corpus."""
    yield from topic_documents()
    yield from module_documents()
