"""Which addresses a webhook may reach.

The engines, Redis, PostgreSQL and the node agents listen on loopback and private addresses:
a webhook URL a tenant chooses must never reach them. A URL's host is resolved when the
notification is sent (a name that resolved to a public address when the channel was saved may
not any more), every address it resolves to is checked, and the request goes to the address
that was checked (no second lookup a rebinding DNS server could answer differently). Only a
platform channel marked `allow_private_targets` skips the check. Saving a channel already
refuses a host that is a private address literally (`127.0.0.1`, `[::1]`, `localhost`).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


class TargetRefused(Exception):
    """The URL's host is (or resolves to) an address a webhook may not reach."""


@dataclass(frozen=True)
class Target:
    """Where to connect: the checked `address`, and the `host` to name in Host and TLS SNI."""

    scheme: str
    host: str
    address: str
    port: int
    path: str

    @property
    def url(self) -> str:
        """The URL to request: the checked address in place of the name."""
        address = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{address}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def why_private(address: str) -> str:
    """Why `address` may not be reached ("" when it may): loopback, private, link-local..."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for flag, reason in (
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_private", "a private address"),
        ("is_multicast", "a multicast address"),
        ("is_unspecified", "an unspecified address"),
        ("is_reserved", "a reserved address"),
    ):
        if getattr(ip, flag):
            return reason
    if not ip.is_global:
        return "not a public address"
    return ""


def _split(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise TargetRefused("only http:// and https:// URLs")
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise TargetRefused("the URL has no host")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as exc:
        raise TargetRefused("the URL's port is not a number") from exc
    path = parts.path or "/"
    if parts.query:
        path += f"?{parts.query}"
    return scheme, host, port, path


def literal_target_error(url: str) -> str:
    """A field error for a URL whose host is a private address as written ("" otherwise)."""
    try:
        _, host, _, _ = _split(url)
    except TargetRefused as exc:
        return f"Refused: {exc}."
    if host in LOCAL_NAMES or host.endswith(".localhost"):
        return f"Refused: {host} is this machine."
    try:
        reason = why_private(host)
    except ValueError:
        return ""  # a name: checked when a notification is sent
    return f"Refused: {host} is {reason}." if reason else ""


def resolve(url: str, *, allow_private: bool) -> Target:
    """Resolve the URL's host now; every address must be one a webhook may reach (unless
    `allow_private`). Raises TargetRefused."""
    scheme, host, port, path = _split(url)
    if (host in LOCAL_NAMES or host.endswith(".localhost")) and not allow_private:
        raise TargetRefused(f"{host} is this machine")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TargetRefused(f"{host} does not resolve ({exc.strerror})") from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise TargetRefused(f"{host} does not resolve")
    if not allow_private:
        for address in addresses:
            reason = why_private(address)
            if reason:
                raise TargetRefused(f"{host} resolves to {address}, {reason}")
    return Target(scheme=scheme, host=host, address=addresses[0], port=port, path=path)
