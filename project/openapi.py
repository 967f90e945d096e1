"""OpenAPI schema touches that depend on the deployment rather than on the code."""

from __future__ import annotations

from typing import Any


def document_task_kinds(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: a submission's kind is one of the kinds this server runs.

    The kinds depend on settings (debug drivers), so they are read when the schema is served.
    """
    from tasks.drivers import available_kinds

    kind = result.get("components", {}).get("schemas", {}).get("Submit", {}).get("properties", {}).get("kind")
    if kind is not None:
        kind["enum"] = available_kinds()
    return result
