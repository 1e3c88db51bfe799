"""The worker's one config dataclass."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.errors import ConfigError
from loraplex.platform.settings import DEFAULT_ADAPTER_CACHE_BYTES
from loraplex.platform.fleet.wire import TOKEN_ENV, internal_token


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker listens, authenticates and reaches the adapter store.

    `adapter_store`: a database URL (the `adapter_blobs` table) or `s3://bucket/prefix`;
    fetched blobs are cached under `cache_dir`, at most `cache_max_bytes` of them (None:
    unbounded; the least recently used go first). `cache_dir` is this worker's alone: the
    cache assumes one process per folder. `internal_token`: None reads
    $LORAPLEX_INTERNAL_TOKEN (or the file $LORAPLEX_INTERNAL_TOKEN_FILE names); without
    one the worker listens on loopback only. `metrics_port`: `/metrics` (still behind the
    token) on a listener of its own at `metrics_host`, so scrapers can be let in to that
    port and not to the internal API's; None: on `port` with the internal API.
    """

    adapter_store: str
    cache_dir: Path
    cache_max_bytes: int | None = DEFAULT_ADAPTER_CACHE_BYTES
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    internal_token: str | None = None
    s3_endpoint_url: str | None = None
    drain_timeout_s: float = 600.0  # SIGTERM: the longest it waits for running requests
    prefix_keys: int = 64  # recent prefix keys reported to routers

    @property
    def token(self) -> str | None:
        return internal_token(self.internal_token)

    def check(self) -> None:
        """Refuse a token too short to be a secret, and to listen beyond loopback without one."""
        token = self.token  # reading it refuses a short one
        hosts = [self.host] + ([self.metrics_host] if self.metrics_port is not None else [])
        for host in hosts:
            if token is None and not is_loopback(host):
                raise ConfigError(f"refusing to listen on {host} without ${TOKEN_ENV}: set the shared secret "
                                  "(the gateways send it), or listen on 127.0.0.1")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ConfigError(f"the metrics port must differ from the worker's port ({self.port})")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
