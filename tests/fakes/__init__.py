"""Loopback fakes of outside services: each an HTTP server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 refuses a burst of concurrent connections.
    request_queue_size = 256
    owner: Any = None


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that does not log every request to stderr."""

    @property
    def owner(self) -> Any:
        return self.server.owner  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopbackServer:
    """A ThreadingHTTPServer on 127.0.0.1 and a free port; `with` starts and stops it."""

    handler_class: type[QuietHandler] = QuietHandler

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self._server = _Server(("127.0.0.1", 0), self.handler_class)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()  # wakes handlers that are waiting out a scripted delay
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def port(self) -> int:
        assert self._server is not None, "the server is not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, seconds: float) -> None:
        """Sleep inside a handler, cut short when the server stops."""
        self.stopping.wait(seconds)


class RecordingSleep:
    """An `async sleep` that returns at once and records the delays asked for."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
