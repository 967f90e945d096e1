"""A visit over TLS goes to the address it checked, and verifies the certificate of the name in its URL: the
gateway's transport (tasks/gateway/transport.py) hands the name to TLS (SNI and certificate check) while it
connects to the pinned address. A loopback HTTPS site with a certificate for docs.test, issued by a CA of this
test's own that the client is told to trust."""

from __future__ import annotations

import ipaddress
import ssl
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Self

import httpx2
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tasks.errors import TransientError
from tasks.gateway.fetch import VisitSettings, fetch_page
from tasks.gateway.retry import RetryBudget
from tasks.gateway.transport import AiohttpTransport
from tests.fakes import RecordingSleep
from tests.fakes.http_site import HttpSite

NAME = "docs.test"


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, *, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey]
                 | None = None, ca: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, signer = issuer or (name, key)
    now = datetime.now(UTC)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
               .not_valid_after(now + timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
    return builder.sign(signer, hashes.SHA256())


class TlsSite(HttpSite):
    """The test site of tests/fakes/http_site.py over TLS, with a certificate for NAME; `server_names` are the
    names clients asked for in their handshakes (SNI)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca = _certificate("Longhaul test CA", ca_key, ca=True)
        leaf = _certificate(NAME, key, issuer=(ca.subject, ca_key))
        self.ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
        (directory / "site.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        self.server_names: list[str | None] = []
        self._names_lock = threading.Lock()
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(directory / "site.pem")
        self._context.sni_callback = self._heard

    def _heard(self, _socket: ssl.SSLObject, server_name: str | None, _context: ssl.SSLContext) -> None:
        with self._names_lock:
            self.server_names.append(server_name)

    def __enter__(self) -> Self:
        super().__enter__()
        assert self._server is not None
        self._server.socket = self._context.wrap_socket(self._server.socket, server_side=True)
        return self


@pytest.fixture
def tls_site(tmp_path: Path) -> Iterator[TlsSite]:
    with TlsSite(tmp_path) as site:
        yield site


def trusting(ca_pem: str) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.load_verify_locations(cadata=ca_pem)
    return context


async def visit_over_tls(site: TlsSite, *, trust: str, names: dict[str, str]) -> dict:
    async def resolver(host: str, port: int) -> list:
        return [ipaddress.ip_address(names[host])]

    transport = AiohttpTransport(limit=10, ssl_context=trusting(trust))
    async with httpx2.AsyncClient(follow_redirects=False, transport=transport) as client:
        return await fetch_page(f"https://{NAME}:{site.port}/page", client=client, budget=RetryBudget(0),
                                sleep=RecordingSleep(), resolver=resolver,
                                config=VisitSettings(allow_private=True, max_bytes=100_000, timeout_s=5.0))


async def test_a_visit_over_tls_connects_to_the_checked_address_and_verifies_the_name(tls_site):
    page = await visit_over_tls(tls_site, trust=tls_site.ca_pem, names={NAME: "127.0.0.1"})

    assert page["title"] == "Cancellation in depth"
    assert page["final_url"] == f"https://{NAME}:{tls_site.port}/page"
    assert tls_site.server_names == [NAME]
    assert tls_site.paths == ["/page"]


async def test_a_certificate_from_an_untrusted_issuer_is_refused(tls_site, tmp_path):
    (tmp_path / "other").mkdir()
    stranger = TlsSite(tmp_path / "other")  # its CA, which did not issue tls_site's certificate

    with pytest.raises(TransientError, match="could not fetch"):
        await visit_over_tls(tls_site, trust=stranger.ca_pem, names={NAME: "127.0.0.1"})

    assert tls_site.paths == []
