"""The client address behind trusted proxies, and the sign-in backoff's delays: pure logic."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory, override_settings

from project.client_ip import client_address, client_ip_for_request, trusted_networks
from project.sign_in_backoff import delay_seconds

pytestmark = pytest.mark.smoke
BALANCER = trusted_networks("LONGHAUL_TRUSTED_PROXIES", ["10.0.0.0/8"])
TWO_TIERS = trusted_networks("LONGHAUL_TRUSTED_PROXIES", ["10.0.0.0/8", "192.0.2.10", "2001:db8::/32"])


def test_it_uses_remote_addr_when_no_proxy_is_trusted():
    assert client_address("203.0.113.9", "198.51.100.7", ()) == "203.0.113.9"


def test_it_ignores_x_forwarded_for_from_a_peer_that_is_not_a_trusted_proxy():
    assert client_address("203.0.113.9", "198.51.100.7", BALANCER) == "203.0.113.9"


def test_it_takes_the_address_a_trusted_proxy_appended():
    assert client_address("10.0.0.2", "198.51.100.7", BALANCER) == "198.51.100.7"


def test_it_never_takes_the_left_most_entry_which_the_client_wrote():
    # The client sent "X-Forwarded-For: 1.2.3.4"; the balancer appended the address it saw.
    assert client_address("10.0.0.2", "1.2.3.4, 198.51.100.7", BALANCER) == "198.51.100.7"


def test_it_walks_past_every_trusted_proxy_to_the_right_most_untrusted_hop():
    forwarded = "1.2.3.4, 198.51.100.7, 192.0.2.10, 10.1.2.3"
    assert client_address("10.0.0.2", forwarded, TWO_TIERS) == "198.51.100.7"


def test_it_stops_at_an_entry_that_is_not_an_address():
    assert client_address("10.0.0.2", "198.51.100.7, unknown, 10.1.2.3", BALANCER) == "10.1.2.3"


def test_it_falls_back_to_the_farthest_proxy_when_every_hop_is_trusted():
    assert client_address("10.0.0.2", "10.9.9.9, 10.1.2.3", BALANCER) == "10.9.9.9"
    assert client_address("10.0.0.2", "", BALANCER) == "10.0.0.2"


def test_it_handles_ipv6_and_ipv4_mapped_peers():
    assert client_address("2001:db8::1", "2001:db8::2, 2001:db9::5", TWO_TIERS) == "2001:db9::5"
    assert client_address("::ffff:10.0.0.2", "198.51.100.7", BALANCER) == "198.51.100.7"


def test_it_answers_for_a_request_without_an_address():
    assert client_address(None, "198.51.100.7", BALANCER) is None


def test_it_reads_the_trusted_proxies_from_settings():
    request = RequestFactory().get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="1.2.3.4, 198.51.100.7")
    with override_settings(LONGHAUL_TRUSTED_PROXIES=BALANCER):
        assert client_ip_for_request(request) == "198.51.100.7"
    with override_settings(LONGHAUL_TRUSTED_PROXIES=()):
        assert client_ip_for_request(request) == "10.0.0.2"


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "proxy.internal", "10.0.0.300", ""])
def test_it_refuses_an_entry_that_is_not_an_address_or_network_naming_the_variable(entry):
    with pytest.raises(ImproperlyConfigured, match="LONGHAUL_TRUSTED_PROXIES") as raised:
        trusted_networks("LONGHAUL_TRUSTED_PROXIES", ["10.0.0.1", entry])
    assert repr(entry) in str(raised.value)


def test_the_sign_in_delay_starts_at_the_limit_doubles_and_stops_at_the_cap():
    delays = [delay_seconds(failures, free=5, cap=300) for failures in range(1, 16)]
    assert delays == [0, 0, 0, 0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert delay_seconds(10**9, free=5, cap=300) == 300
