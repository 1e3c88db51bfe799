"""Where quotas and metering plug into the gateway: one request as they see it
(`RequestContext`), and the contract they keep (`Hooks`)."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field

from loraplex.engine.output import RequestOutput
from loraplex.engine.request import Lane

from loraplex.platform.observability.request_id import current_request_id
from loraplex.platform.serving.auth import Principal


@dataclass
class RequestContext:
    """One request as admission/metering hooks see it."""

    request_id: str
    principal: Principal
    model: str  # what the client sees: the base model's name or the adapter's
    adapter: str | None
    lane: Lane
    num_prompt_tokens: int
    max_tokens: int
    received_at: float = field(default_factory=time.time)
    # Filled in as the request runs.
    first_token_at: float | None = None
    finished_at: float | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Prompt tokens the engine processed (billed even if no token came out).
    num_processed_prompt_tokens: int = 0
    # stop | length | abort (client left or cancelled) | error
    finish_reason: str | None = None
    # The adapter version (content digest) the engine runs: the one metered.
    adapter_digest: str | None = None
    # What admission hooks keep for finish (a quota reservation); the gateway never reads it.
    hook_state: object = None
    # The HTTP request's x-request-id (logs, traces, the worker hop); not unique.
    correlation_id: str | None = field(default_factory=current_request_id)


class Hooks(ABC):
    """Where quotas and metering plug in.

    Per request: `admit` runs before the engine sees the request and may raise
    RateLimitedError (429 with Retry-After); `finish` runs exactly once for every admitted
    request, on every path (success, stop, disconnect, engine error, shutdown), with the
    final counts. `admit` raising (CancelledError included: the client left while it ran)
    means "not admitted": `finish` will not run, so admit must undo whatever it took
    before raising. `finish` should not raise; it runs inside the request's cleanup.

    Per app: `start` runs once in the app's event loop before the first request;
    `register_metrics` adds the hooks' series to the app's Prometheus registry; `close`
    runs once at shutdown, after the server stopped taking requests (it may finish the
    requests still open). The defaults do nothing.
    """

    @abstractmethod
    async def admit(self, ctx: RequestContext) -> None: ...

    @abstractmethod
    async def finish(self, ctx: RequestContext) -> None: ...

    def progress(self, ctx: RequestContext, out: RequestOutput) -> Awaitable[None] | None:
        """Each engine output, before the gateway hands it on (`ctx` still counts only what
        was handed on before it). An awaitable returned is awaited first (a checkpoint)."""
        return None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def register_metrics(self, registry) -> None:
        return None

    def quotas_changed(self, tenant_id: int | None = None) -> None:
        """Limits were changed in this process (the admin API; None: any tenant's): the
        next admission must not use limits cached before."""
        return None
