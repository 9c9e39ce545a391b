"""Which destinations a webhook may be sent to: the guard against server-side request forgery.

An endpoint's URL is chosen by a tenant, and our workers sit inside the operator's network,
next to databases, admin ports and the cloud's metadata service (169.254.169.254). So a URL
is checked twice: `url_problem` when the endpoint is created or changed (the scheme, no
credentials, no literal address of a private network: an answer the user sees at once), and
`resolve` at every delivery attempt, after DNS, since a name's addresses can change at any
time. The sender then connects to the very addresses `resolve` returned (see `sender`).

Both parse URLs with httpx2's parser, the one the sender uses, so the host checked is the
host connected to (two URL parsers that disagree are a classic way around such a check).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import httpx2

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2000
"""Characters of an endpoint URL at most: what every browser and proxy carries."""

_SHARED = ipaddress.ip_network("100.64.0.0/10")
"""RFC 6598's shared space (carrier-grade NAT): neither private nor global to `ipaddress`."""

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
"""RFC 6052's well-known NAT64 prefix: its last 32 bits are the IPv4 address reached."""

_NUMERIC_HOST = set("0123456789abcdefxABCDEFX.")
"""The characters of the legacy IPv4 spellings (`127.1`, `0x7f.1`, `2130706433`) that
`getaddrinfo` reads as addresses although `ipaddress` does not."""


@dataclass(frozen=True)
class Destinations:
    """The installation's policy (`Webhooks.AllowHttp`, `Webhooks.AllowPrivateNetworks`):
    both off by default, since webhooks normally leave the network over TLS; a development
    or in-cluster setup turns them on."""

    allow_http: bool = False
    allow_private_networks: bool = False


class DestinationRefused(Exception):
    """A destination the policy forbids, or one whose name does not resolve; `reason` names
    the host and the address, to be shown to the endpoint's owner."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def url_problem(url: str, policy: Destinations) -> str | None:
    """The rule `url` breaks, worded to follow the field's name ("url must have a host"), or
    None. DNS is not consulted: a name may resolve elsewhere at delivery, where `resolve`
    checks it again."""
    if len(url) > MAX_URL_LENGTH:
        return f"must be at most {MAX_URL_LENGTH} characters long"
    try:
        parsed = httpx2.URL(url)
    except httpx2.InvalidURL as exc:
        return f"must be a valid URL ({exc})"
    return (
        _scheme_problem(parsed.scheme, policy)
        or ("must not contain credentials" if parsed.userinfo else None)
        or ("must have a host" if not parsed.host else None)
        or _host_problem(parsed.host, policy)
    )


def _scheme_problem(scheme: str, policy: Destinations) -> str | None:
    if scheme == "https" or (scheme == "http" and policy.allow_http):
        return None
    if scheme == "http":
        return "must be an https URL (Webhooks.AllowHttp is off)"
    return "must be an http or https URL" if policy.allow_http else "must be an https URL"


def _host_problem(host: str, policy: Destinations) -> str | None:
    address = literal_address(host)
    if address is None or policy.allow_private_networks or not refused_address(address):
        return None
    return f"must not be a private, loopback or link-local address ({address})"


def literal_address(host: str) -> IPAddress | None:
    """The address a host names by itself (`10.0.0.1`, `::1`, and the legacy forms such as
    `0x7f.1` that the resolver reads as 127.0.0.1), or None for a DNS name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if not set(host) <= _NUMERIC_HOST:
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def refused_address(ip: IPAddress) -> bool:
    """Whether `ip` is anything but a globally routable unicast address."""
    return address_refusal(ip) is not None


def address_refusal(ip: IPAddress) -> str | None:
    """What kind of non-public address `ip` is ("a loopback address"), or None when it is
    public. An IPv6 address that stands for an IPv4 one (IPv4-mapped, NAT64) is judged by the
    IPv4 address, since that is where the packets go; a 6to4 one is also refused when the
    IPv4 address of its gateway is."""
    if isinstance(ip, ipaddress.IPv6Address):
        translated = ip.ipv4_mapped or (
            ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None
        )
        if translated is not None:
            inner = address_refusal(translated)
            return None if inner is None else f"an IPv6 form of {translated}, {inner}"
        gateway = ip.sixtofour
        if gateway is not None and (inner := address_refusal(gateway)) is not None:
            return f"a 6to4 form of {gateway}, {inner}"
    return _kind(ip)


def _kind(ip: IPAddress) -> str | None:
    """The first kind that fits, most specific first (a loopback address is also private)."""
    kinds = (
        (ip.is_unspecified, "an unspecified address"),
        (ip.is_loopback, "a loopback address"),
        (ip.is_link_local, "a link-local address"),
        (ip.is_multicast, "a multicast address"),
        (ip in _SHARED, "a shared (carrier-grade NAT) address"),
        (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local, "a site-local address"),
        (ip.is_reserved, "a reserved address"),
        (ip.is_private, "a private address"),
        (not ip.is_global, "an address that is not globally routable"),
    )
    return next((kind for applies, kind in kinds if applies), None)


def resolve(host: str, port: int, policy: Destinations) -> list[IPAddress]:
    """The addresses of `host` to connect to, in the resolver's order of preference;
    DestinationRefused when it does not resolve, or when any of its addresses is refused by
    the policy (one bad address is enough: the name's owner chose to list it)."""
    addresses = _lookup(host, port)
    if not policy.allow_private_networks:
        for address in addresses:
            kind = address_refusal(address)
            if kind is not None:
                raise DestinationRefused(_refusal(host, address, kind))
    return addresses


def _refusal(host: str, address: IPAddress, kind: str) -> str:
    if literal_address(host) == address:
        return f"{host} is {kind}"
    return f"{host} resolves to {address}, {kind}"


def _lookup(host: str, port: int) -> list[IPAddress]:
    try:
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DestinationRefused(f"{host} does not resolve ({reason})") from None
    addresses: list[IPAddress] = []
    for family, _type, _proto, _name, sockaddr in found:
        if family in (socket.AF_INET, socket.AF_INET6):
            address = ipaddress.ip_address(sockaddr[0])
            if address not in addresses:
                addresses.append(address)
    if not addresses:
        raise DestinationRefused(f"{host} has no IPv4 or IPv6 address")
    return addresses
