"""One signed POST to an endpoint: the address checked and pinned as visit does, no redirects,
a time limit and a cap on how much of the answer is read."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx2
from django.conf import settings

from tasks.errors import PermanentError
from webhooks import destinations

USER_AGENT = "Longhaul-webhooks/0.1"
SHOWN_RESPONSE_CHARS = 500
UNDECODABLE = "(a body that does not decode)"  # an answer whose Content-Encoding lies, as shown


class SendFailed(Exception):
    """The attempt did not deliver; `permanent` when sending again cannot help (a refused address)."""

    def __init__(self, message: str, *, status_code: int | None = None, permanent: bool = False) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.permanent = permanent


@dataclass(frozen=True)
class Sent:
    status_code: int


async def post(url: str, *, body: str, headers: dict[str, str]) -> Sent:
    """Send `body`; Sent for a 2xx answer, SendFailed for anything else."""
    try:
        parsed, address = await destinations.checked(url)
    except PermanentError as exc:
        raise SendFailed(f"refused: {destinations.reason(exc)}", permanent=True) from exc
    timeout = float(settings.LONGHAUL_WEBHOOK_TIMEOUT_S)
    # Connect to the address that was checked, with the Host header and TLS server name kept,
    # so a second DNS answer cannot slip past the check (as visit does).
    pinned = parsed.copy_with(host=str(address))
    extensions = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
    all_headers = {**headers, "Host": parsed.netloc.decode("ascii"), "User-Agent": USER_AGENT}
    try:
        async with asyncio.timeout(timeout), httpx2.AsyncClient(timeout=timeout, trust_env=False) as client:
            request = client.build_request("POST", pinned, content=body.encode("utf-8"), headers=all_headers,
                                           extensions=extensions)
            response = await client.send(request, stream=True, follow_redirects=False)
            try:
                text = await _read_capped(response)
            finally:
                await response.aclose()
    except (TimeoutError, httpx2.TimeoutException) as exc:
        raise SendFailed(f"no answer within {timeout:g} s") from exc
    except httpx2.TransportError as exc:
        raise SendFailed(f"could not connect: {type(exc).__name__}") from exc
    status = response.status_code
    if 200 <= status < 300:
        return Sent(status)
    if 300 <= status < 400:
        raise SendFailed(f"answered HTTP {status}: redirects are refused", status_code=status)
    raise SendFailed(f"answered HTTP {status}: {text[:SHOWN_RESPONSE_CHARS]}".rstrip(": "), status_code=status)


async def _read_capped(response: httpx2.Response) -> str:
    """At most LONGHAUL_WEBHOOK_MAX_RESPONSE_BYTES of the answer: a receiver cannot make us read a flood."""
    cap = int(settings.LONGHAUL_WEBHOOK_MAX_RESPONSE_BYTES)
    content = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            content += chunk[: cap - len(content)]
            if len(content) >= cap:
                break
    except httpx2.DecodingError:  # read for its message only: the status decides
        return UNDECODABLE
    return content.decode("utf-8", errors="replace")
