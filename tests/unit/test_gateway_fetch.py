"""visit's address policy, per-hop checks and HTML to text, without touching the network.

Hops are answered by httpx2.MockTransport and names by a fake resolver, so a refused
address is proven refused before any connection: the transport records every request.
"""

from __future__ import annotations

import ipaddress

import httpx2
import pytest

from tasks.errors import PermanentError
from tasks.gateway.fetch import VisitSettings, address_refusal, fetch_page, html_to_text
from tasks.gateway.retry import RetryBudget

pytestmark = pytest.mark.smoke

PRIVATE_OFF = VisitSettings(allow_private=False, max_bytes=100_000, timeout_s=5.0)
PRIVATE_ON = VisitSettings(allow_private=True, max_bytes=100_000, timeout_s=5.0)


@pytest.mark.parametrize(("address", "off", "on"), [
    ("169.254.169.254", "link-local", "link-local"),  # cloud metadata: refused even with private fetch on
    ("fe80::1", "link-local", "link-local"),
    ("::ffff:169.254.169.254", "link-local", "link-local"),
    ("2002:a9fe:a9fe::1", "link-local", "link-local"),  # 6to4 wrapping of the metadata address
    ("224.0.0.1", "multicast", "multicast"),
    ("0.0.0.0", "unspecified", "unspecified"),
    ("0.1.2.3", "unspecified", "unspecified"),
    ("240.0.0.1", "reserved", "reserved"),
    ("127.0.0.1", "loopback", None),
    ("::1", "loopback", None),
    ("10.0.0.1", "private", None),
    ("172.16.5.4", "private", None),
    ("192.168.1.1", "private", None),
    ("::ffff:10.0.0.1", "private", None),
    ("fd00::1", "private", None),
    ("100.64.0.1", "private", None),
    ("8.8.8.8", None, None),
    ("2606:4700:4700::1111", None, None),
])
def test_the_address_policy(address, off, on):
    ip = ipaddress.ip_address(address)

    assert address_refusal(ip, allow_private=False) == off
    assert address_refusal(ip, allow_private=True) == on


class Site:
    """A MockTransport web: answers by the pinned address, records every request it is sent."""

    def __init__(self, routes: dict[tuple[str, str], httpx2.Response]) -> None:
        self.routes = routes
        self.requests: list[httpx2.Request] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        return self.routes[(request.url.host, request.url.path)]


NAMES = {
    "public.test": ["8.8.8.8"],
    "internal.test": ["10.0.0.5"],
    "split.test": ["8.8.4.4", "192.168.0.10"],
}


async def fake_resolver(host: str, port: int) -> list:
    return [ipaddress.ip_address(address) for address in NAMES[host]]


async def visit(url: str, site: Site, config: VisitSettings) -> dict:
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(site.handle)) as client:
        return await fetch_page(url, client=client, budget=RetryBudget(3), resolver=fake_resolver, config=config)


def html(body: str) -> httpx2.Response:
    return httpx2.Response(200, headers={"Content-Type": "text/html; charset=utf-8"}, text=body)


def redirect(location: str) -> httpx2.Response:
    return httpx2.Response(302, headers={"Location": location})


async def test_it_connects_to_the_checked_address_with_the_host_name_kept():
    site = Site({("8.8.8.8", "/doc"): html("<title>Doc</title><p>Hello there.</p>")})

    page = await visit("http://public.test/doc", site, PRIVATE_OFF)

    assert page["title"] == "Doc" and page["text"] == "Hello there."
    (request,) = site.requests
    assert request.url.host == "8.8.8.8"  # pinned: a second DNS answer cannot change the target
    assert request.headers["host"] == "public.test"


@pytest.mark.parametrize("target", ["http://internal.test/admin", "http://10.0.0.1/", "http://[::1]:8080/",
                                    "http://169.254.169.254/latest/meta-data/"])
async def test_a_redirect_to_a_private_address_is_refused_before_connecting(target):
    site = Site({("8.8.8.8", "/start"): redirect(target)})

    with pytest.raises(PermanentError, match="resolves to a"):
        await visit("http://public.test/start", site, PRIVATE_OFF)

    assert [request.url.host for request in site.requests] == ["8.8.8.8"]


async def test_a_redirect_to_the_metadata_address_is_refused_even_with_private_fetch_on():
    site = Site({("10.0.0.5", "/start"): redirect("http://169.254.169.254/latest/meta-data/")})

    with pytest.raises(PermanentError, match="link-local"):
        await visit("http://internal.test/start", site, PRIVATE_ON)

    assert [request.url.host for request in site.requests] == ["10.0.0.5"]


async def test_a_name_with_any_private_answer_is_refused():
    site = Site({})

    with pytest.raises(PermanentError, match=r"split\.test"):
        await visit("http://split.test/", site, PRIVATE_OFF)

    assert site.requests == []


async def test_a_redirect_to_another_scheme_is_refused():
    site = Site({("8.8.8.8", "/start"): redirect("file:///etc/passwd")})

    with pytest.raises(PermanentError, match="'file' scheme"):
        await visit("http://public.test/start", site, PRIVATE_OFF)


async def test_redirects_are_followed_relative_to_the_current_page():
    site = Site({
        ("8.8.8.8", "/a"): redirect("/b"),
        ("8.8.8.8", "/b"): html("<p>Arrived here at last.</p>"),
    })

    page = await visit("http://public.test/a", site, PRIVATE_OFF)

    assert page["url"] == "http://public.test/a"
    assert page["final_url"] == "http://public.test/b"
    assert page["text"] == "Arrived here at last."


def test_html_to_text_keeps_what_a_reader_sees():
    content = """<html><head><title> The  Title </title><style>p{}</style></head><body>
    <nav>Menu</nav><h1>Heading</h1><p>First <b>bold</b> words.<br>Next line.</p>
    <p hidden>HIDDEN-A</p><span aria-hidden="true">HIDDEN-B</span><div style="visibility: hidden">HIDDEN-C</div>
    <noscript>NOSCRIPT</noscript><form><button>Click</button></form><!-- COMMENT -->
    <p>Caf\u00e9 &amp; cr\u00e8me</p></body></html>""".encode("utf-8")

    title, text = html_to_text(content, "utf-8")

    assert title == "The Title"
    assert text == "Heading\nFirst bold words.\nNext line.\nCaf\u00e9 & cr\u00e8me"


def test_html_to_text_detects_a_declared_charset():
    content = '<meta charset="iso-8859-1"><p>na\u00efve caf\u00e9</p>'.encode("iso-8859-1")

    title, text = html_to_text(content, None)

    assert text == "na\u00efve caf\u00e9"
    assert title == "na\u00efve caf\u00e9"  # no <title>: the first line stands in
