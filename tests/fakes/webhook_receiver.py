"""A loopback webhook receiver that verifies Standard Webhooks signatures with `standardwebhooks`.

    with WebhookReceiver(secrets=[secret]) as receiver:
        url = receiver.url + "/hook"
        ...
        [message] = receiver.accepted()

It answers 200 to a request whose signature verifies with one of its secrets and 401 to one that
does not; `answer_with(500)` scripts a failing receiver, `down()` stops listening (connections are
refused) and `up()` listens again on the same port, `hang()` holds requests until `release()`.
Every request is recorded, verified or not.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from tests.fakes import LoopbackServer, QuietHandler, _Server


@dataclass
class Received:
    headers: dict[str, str]
    body: str
    verified_by: list[int] = field(default_factory=list)  # indexes of the secrets whose signature matched
    status: int = 0

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)

    @property
    def signatures(self) -> list[str]:
        return self.headers["webhook-signature"].split(" ")


def verified_by(secrets: list[str], body: str, headers: dict[str, str]) -> list[int]:
    """Which of `secrets` the request's signature header verifies with."""
    matched = []
    for index, secret in enumerate(secrets):
        try:
            Webhook(secret).verify(body, headers)
        except WebhookVerificationError:
            continue
        matched.append(index)
    return matched


class _Handler(QuietHandler):
    protocol_version = "HTTP/1.0"

    def do_POST(self) -> None:
        receiver: WebhookReceiver = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode("utf-8")
        headers = {name.lower(): value for name, value in self.headers.items()}
        received = Received(headers=headers, body=body, verified_by=verified_by(receiver.secrets, body, headers))
        receiver.hold()
        status = receiver.scripted_status or (200 if received.verified_by else 401)
        received.status = status
        receiver.record(received)
        reply = b'{"ok": true}' if status < 300 else b'{"error": "no"}'
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if receiver.broken_encoding:  # the answer says it is gzip-encoded, and is not
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
        except (BrokenPipeError, ConnectionResetError):
            pass


class WebhookReceiver(LoopbackServer):
    handler_class = _Handler

    def __init__(self, secrets: list[str] | None = None) -> None:
        super().__init__()
        self.secrets: list[str] = list(secrets or [])
        self.scripted_status: int | None = None
        self.broken_encoding = False
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._held = threading.Event()
        self._held.set()
        self.arrived = threading.Event()  # set when a request arrives (for hang())
        self._port = 0

    def __enter__(self) -> Self:
        super().__enter__()
        self._port = self.port
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
        if self._server is not None:
            super().__exit__(*exc_info)

    def record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)

    def accepted(self) -> list[Received]:
        """Requests answered 2xx."""
        with self._lock:
            return [r for r in self.received if 200 <= r.status < 300]

    def answer_with(self, status: int | None) -> None:
        """Answer every request with `status` (None: 200 when the signature verifies, else 401)."""
        self.scripted_status = status

    def down(self) -> None:
        """Stop listening: connections to the port are refused."""
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None

    def up(self) -> None:
        """Listen again on the same port."""
        self._server = _Server(("127.0.0.1", self._port), self.handler_class)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=type(self).__name__, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def hang(self) -> None:
        """Hold each request before answering it, until release()."""
        self._held.clear()

    def release(self) -> None:
        self._held.set()

    def hold(self) -> None:
        self.arrived.set()
        while not self._held.wait(0.05):
            if self.stopping.is_set():
                return


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver
