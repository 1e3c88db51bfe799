"""The gateway's one config dataclass for talking to the engine workers."""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.platform.routing import RouterConfig
from loraplex.platform.fleet.wire import internal_token


@dataclass(frozen=True)
class FleetConfig:
    """Where the workers are (`workers`: "http://h:p,..." or `workers_dns`: "NAME:PORT"),
    how to reach them, and how to route over them."""

    workers: str | None = None
    workers_dns: str | None = None
    # The shared secret of the internal API; None: $LORAPLEX_INTERNAL_TOKEN or the file
    # $LORAPLEX_INTERNAL_TOKEN_FILE names (neither: none sent).
    internal_token: str | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    connect_timeout_s: float = 2.0
    # Longest silence allowed on a response (a queued request waits that long at most).
    read_timeout_s: float = 600.0
    max_connections: int = 256  # per gateway, to all workers together
    max_keepalive: int = 64
    # How long `gateway` start waits for a first worker to describe the model.
    startup_wait_s: float = 300.0

    @property
    def token(self) -> str | None:
        return internal_token(self.internal_token)

    def headers(self) -> dict[str, str]:
        token = self.token
        return {"authorization": f"Bearer {token}"} if token else {}
