"""Which webhook destinations are allowed: the URL rules shown when an endpoint is saved, the
table of refused addresses, and the check after DNS resolution."""

from __future__ import annotations

import ipaddress

import pytest

from tracon_jobs.webhooks.addresses import (
    DestinationRefused,
    Destinations,
    address_refusal,
    literal_address,
    refused_address,
    resolve,
    url_problem,
)

STRICT = Destinations()
OPEN = Destinations(allow_http=True, allow_private_networks=True)
PRIVATE_REFUSED = "must not be a private, loopback or link-local address"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("https://hooks.example.com/tracon", None),
        ("https://hooks.example.com:8443/a/b?c=d#e", None),
        ("https://bücher.example/hook", None),
        ("https://93.184.216.34/hook", None),
        ("https://[2606:4700:4700::1111]/hook", None),
        ("http://hooks.example.com/", "must be an https URL (Webhooks.AllowHttp is off)"),
        ("ftp://hooks.example.com/", "must be an https URL"),
        ("hooks.example.com/tracon", "must be an https URL"),
        ("https://user:pass@hooks.example.com/", "must not contain credentials"),
        ("https://token@hooks.example.com/", "must not contain credentials"),
        ("https:///path", "must have a host"),
        ("https://example.com/" + "a" * 2000, "must be at most 2000 characters long"),
        ("https://127.0.0.1/", f"{PRIVATE_REFUSED} (127.0.0.1)"),
        ("https://10.1.2.3:8080/", f"{PRIVATE_REFUSED} (10.1.2.3)"),
        ("https://169.254.169.254/latest/meta-data/", f"{PRIVATE_REFUSED} (169.254.169.254)"),
        ("https://192.168.1.20/", f"{PRIVATE_REFUSED} (192.168.1.20)"),
        ("https://172.16.0.5/", f"{PRIVATE_REFUSED} (172.16.0.5)"),
        ("https://100.64.0.1/", f"{PRIVATE_REFUSED} (100.64.0.1)"),
        ("https://0.0.0.0/", f"{PRIVATE_REFUSED} (0.0.0.0)"),
        ("https://[::1]/", f"{PRIVATE_REFUSED} (::1)"),
        ("https://[::1]:9000/", f"{PRIVATE_REFUSED} (::1)"),
        ("https://[fc00::1]/", f"{PRIVATE_REFUSED} (fc00::1)"),
        ("https://[fe80::1]/", f"{PRIVATE_REFUSED} (fe80::1)"),
        ("https://[::ffff:127.0.0.1]/", f"{PRIVATE_REFUSED} (::ffff:7f00:1)"),
        # spellings the resolver reads as 127.0.0.1 although they are no dotted quad
        ("https://127.1/", f"{PRIVATE_REFUSED} (127.0.0.1)"),
        ("https://0x7f.1/", f"{PRIVATE_REFUSED} (127.0.0.1)"),
        ("https://2130706433/", f"{PRIVATE_REFUSED} (127.0.0.1)"),
        # a URL parser's trick: the backslash is userinfo to httpx2, the host is 127.0.0.1
        ("https://evil.example\\@127.0.0.1/", "must not contain credentials"),
    ],
)
def test_url_problems_of_the_strict_policy(url: str, problem: str | None) -> None:
    assert url_problem(url, STRICT) == problem


@pytest.mark.parametrize(
    "url", ["https://[::1/", "https://0177.0.0.1/", "https://exa\x00mple.com/"]
)
def test_a_url_httpx2_cannot_parse_is_invalid(url: str) -> None:
    # httpx2 is the sender's parser: what it refuses could never be delivered
    problem = url_problem(url, OPEN)
    assert problem is not None and problem.startswith("must be a valid URL (")


@pytest.mark.parametrize(
    ("url", "policy", "problem"),
    [
        ("http://hooks.example.com/", Destinations(allow_http=True), None),
        ("http://10.1.2.3/", Destinations(allow_http=True), f"{PRIVATE_REFUSED} (10.1.2.3)"),
        ("https://10.1.2.3/", Destinations(allow_private_networks=True), None),
        ("http://127.0.0.1:8080/", OPEN, None),
        ("http://[::1]:8080/", OPEN, None),
        ("ftp://hooks.example.com/", OPEN, "must be an http or https URL"),
        ("http://u:p@127.0.0.1/", OPEN, "must not contain credentials"),
        ("http://localhost/", STRICT, "must be an https URL (Webhooks.AllowHttp is off)"),
    ],
)
def test_url_problems_as_the_policy_allows(
    url: str, policy: Destinations, problem: str | None
) -> None:
    assert url_problem(url, policy) == problem


def test_a_name_is_not_resolved_when_an_endpoint_is_saved() -> None:
    # localhost is refused at every delivery, after resolution; saving does not ask DNS
    assert url_problem("https://localhost/", STRICT) is None
    assert url_problem("https://name.invalid/", STRICT) is None


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.255.0.9", "a loopback address"),
        ("10.0.0.1", "a private address"),
        ("172.16.0.1", "a private address"),
        ("172.31.255.255", "a private address"),
        ("192.168.0.1", "a private address"),
        ("169.254.169.254", "a link-local address"),  # the cloud's metadata service
        ("169.254.0.1", "a link-local address"),
        ("100.64.0.1", "a shared (carrier-grade NAT) address"),
        ("100.127.255.254", "a shared (carrier-grade NAT) address"),
        ("0.0.0.0", "an unspecified address"),
        ("0.1.2.3", "a private address"),
        ("224.0.0.1", "a multicast address"),
        ("239.255.255.250", "a multicast address"),
        ("240.0.0.1", "a reserved address"),
        ("255.255.255.255", "a reserved address"),
        ("192.0.2.10", "a private address"),  # documentation
        ("198.18.0.1", "a private address"),  # benchmarking
        ("::1", "a loopback address"),
        ("::", "an unspecified address"),
        ("fe80::1", "a link-local address"),
        ("fc00::1", "a private address"),
        ("fd12:3456::1", "a private address"),
        ("fec0::1", "a site-local address"),
        ("ff02::1", "a multicast address"),
        ("2001:db8::1", "a private address"),  # documentation
        ("2001::1", "a private address"),  # Teredo
        ("::ffff:127.0.0.1", "an IPv6 form of 127.0.0.1, a loopback address"),
        ("::ffff:169.254.169.254", "an IPv6 form of 169.254.169.254, a link-local address"),
        ("64:ff9b::a00:1", "an IPv6 form of 10.0.0.1, a private address"),
        ("2002:a00:1::1", "a 6to4 form of 10.0.0.1, a private address"),
        ("::127.0.0.1", "a reserved address"),  # IPv4-compatible, deprecated
        ("93.184.216.34", None),
        ("8.8.8.8", None),
        ("1.1.1.1", None),
        ("2606:4700:4700::1111", None),
        ("2a00:1450:4001:80b::200e", None),
        ("::ffff:8.8.8.8", None),  # mapped: the public IPv4 address is reached
        ("64:ff9b::808:808", None),  # NAT64 of a public address
    ],
)
def test_refused_addresses(address: str, kind: str | None) -> None:
    ip = ipaddress.ip_address(address)
    assert address_refusal(ip) == kind
    assert refused_address(ip) is (kind is not None)


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("10.0.0.1", "10.0.0.1"),
        ("::1", "::1"),
        ("[::1]", "::1"),
        ("127.1", "127.0.0.1"),
        ("0x7f.0.0.1", "127.0.0.1"),
        ("3232235777", "192.168.1.1"),
        ("hooks.example.com", None),
        ("cafe", None),
        ("1.2.3.4.5", None),
    ],
)
def test_literal_addresses(host: str, address: str | None) -> None:
    found = literal_address(host)
    assert (None if found is None else str(found)) == address


def test_a_name_resolving_to_loopback_is_refused_naming_both() -> None:
    with pytest.raises(DestinationRefused) as refused:
        resolve("localhost", 443, STRICT)
    assert refused.value.reason.startswith("localhost resolves to ")
    assert refused.value.reason.endswith(", a loopback address")


def test_a_literal_address_is_refused_as_itself() -> None:
    with pytest.raises(DestinationRefused, match=r"^10\.0\.0\.1 is a private address$"):
        resolve("10.0.0.1", 443, STRICT)
    with pytest.raises(DestinationRefused, match=r"^127\.1 is a loopback address$"):
        resolve("127.1", 443, STRICT)


def test_private_networks_allowed_resolve_to_their_addresses() -> None:
    assert resolve("127.0.0.1", 80, OPEN) == [ipaddress.ip_address("127.0.0.1")]
    assert ipaddress.ip_address("127.0.0.1") in resolve("localhost", 80, OPEN)


def test_a_name_that_does_not_resolve_is_refused() -> None:
    # .invalid never resolves (RFC 6761), with or without a network
    with pytest.raises(DestinationRefused, match=r"^no-such-host\.invalid does not resolve"):
        resolve("no-such-host.invalid", 443, OPEN)
