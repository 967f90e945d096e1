"""The client's address: REMOTE_ADDR, or behind trusted proxies the right-most untrusted X-Forwarded-For hop."""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django.http import HttpRequest

Network = IPv4Network | IPv6Network
Address = IPv4Address | IPv6Address


def trusted_networks(name: str, entries: Iterable[str]) -> tuple[Network, ...]:
    """The networks in a list of IP addresses and CIDR networks; a bad entry stops the start, naming the variable."""
    networks = []
    for entry in entries:
        try:
            # strict=False: "10.0.0.7/8" means 10.0.0.0/8, the way operators write it.
            networks.append(ip_network(entry, strict=False))
        except ValueError:
            raise ImproperlyConfigured(f"{name} must list IP addresses or CIDR networks, got {entry!r}") from None
    return tuple(networks)


def client_address(remote_addr: str | None, forwarded_for: str, trusted: tuple[Network, ...]) -> str | None:
    """Who sent the request: the first address, walking in from the socket's end, that is not a trusted proxy.

    Each proxy appends the address it received the request from, so X-Forwarded-For reads, left to right,
    client-written entries, then the real client, then proxies. Only entries added by trusted proxies are
    believed: the walk goes from the right and stops at the first untrusted one. The left-most entry is
    whatever the client chose to send and is never used.
    """
    nearest = _parse(remote_addr)
    if nearest is None or not _is_trusted(nearest, trusted):
        return remote_addr
    for entry in reversed([part.strip() for part in forwarded_for.split(",") if part.strip()]):
        hop = _parse(entry)
        if hop is None:
            # A trusted proxy passed on something that is not an address: believe nothing further left.
            break
        nearest = hop
        if not _is_trusted(hop, trusted):
            break
    # Every hop trusted (or the header missing): the farthest proxy seen is the best we know.
    return str(nearest)


def client_ip_for_request(request: HttpRequest) -> str | None:
    """django-axes' AXES_CLIENT_IP_CALLABLE: the client address under LONGHAUL_TRUSTED_PROXIES."""
    meta = request.META
    return client_address(meta.get("REMOTE_ADDR"), meta.get("HTTP_X_FORWARDED_FOR", ""),
                          settings.LONGHAUL_TRUSTED_PROXIES)


def _parse(value: str | None) -> Address | None:
    try:
        address = ip_address(value or "")
    except ValueError:
        return None
    # A dual-stack socket reports IPv4 clients as ::ffff:a.b.c.d; compare them with IPv4 networks as IPv4.
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_trusted(address: Address, trusted: tuple[Network, ...]) -> bool:
    return any(address in network for network in trusted)
