"""Where the workers are: a static list, or every address of a DNS name (a Kubernetes
headless Service), re-resolved by the health poller."""
from __future__ import annotations

import ipaddress
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from loraplex.platform.routing.errors import DiscoveryError

Resolver = Callable[..., list[tuple[Any, ...]]]  # socket.getaddrinfo's signature


class Discovery(ABC):
    """Contract: `resolve()` returns the current worker URLs (sorted, distinct, each
    `scheme://host:port` without a path), or raises `DiscoveryError`; it may block (DNS),
    so the async poller runs it in a thread."""

    @abstractmethod
    def resolve(self) -> list[str]:
        """The worker URLs now."""


def normalize_url(url: str) -> str:
    """`http://h:p` from a worker URL; raises DiscoveryError naming what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise DiscoveryError(f"worker URL {url!r} must start with http:// or https://")
    try:
        port = parts.port
    except ValueError as exc:
        raise DiscoveryError(f"worker URL {url!r} has a bad port") from exc
    if not parts.hostname or port is None:
        raise DiscoveryError(f"worker URL {url!r} must name a host and a port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise DiscoveryError(f"worker URL {url!r} must not have a path")
    return f"{parts.scheme}://{_host(parts.hostname)}:{port}"


def _host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host.lower()


class StaticDiscovery(Discovery):
    """A fixed list (`--workers http://h:p,...`)."""

    def __init__(self, urls: Sequence[str] | str) -> None:
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        if not urls:
            raise DiscoveryError("no worker URLs given")
        self._urls = sorted({normalize_url(u) for u in urls})

    def resolve(self) -> list[str]:
        return list(self._urls)


class DnsDiscovery(Discovery):
    """Every address `host` resolves to, on `port` (`--workers-dns NAME:PORT`)."""

    def __init__(self, host: str, port: int, scheme: str = "http",
                 resolver: Resolver = socket.getaddrinfo) -> None:
        if not host or not 0 < port < 65536:
            raise DiscoveryError(f"worker DNS name needs a host and a port in 1-65535, "
                                 f"got {host!r}:{port}")
        self.host, self.port, self.scheme = host, port, scheme
        self._resolver = resolver

    @classmethod
    def parse(cls, spec: str, resolver: Resolver = socket.getaddrinfo) -> DnsDiscovery:
        """From `NAME:PORT`."""
        host, sep, port = spec.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise DiscoveryError(f"--workers-dns must be NAME:PORT, got {spec!r}")
        return cls(host, int(port), resolver=resolver)

    def resolve(self) -> list[str]:
        try:
            infos = self._resolver(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise DiscoveryError(f"cannot resolve worker DNS name {self.host!r}: {exc}") from exc
        addrs = {info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
        return sorted(f"{self.scheme}://{_host(a)}:{self.port}" for a in addrs)


def discovery_for(workers: str | None = None, workers_dns: str | None = None) -> Discovery:
    """The discovery `loraplex gateway --workers URL,... | --workers-dns NAME:PORT` asks for."""
    if bool(workers) == bool(workers_dns):
        raise DiscoveryError("give exactly one of --workers URL,... and --workers-dns NAME:PORT")
    return StaticDiscovery(workers) if workers else DnsDiscovery.parse(workers_dns or "")
