"""Tenant-fair waiting queue: the Virtual Token Counter (Sheng et al., OSDI'24).

Inside one lane the engine is shared between tenants by the service they receive, not
by arrival order. Each tenant has a counter of the weighted tokens it was served,
divided by its weight; the next request comes from the backlogged tenant with the
smallest counter, oldest request first. A tenant that becomes backlogged has its
counter lifted to the smallest counter among the backlogged tenants (or to the counter
of the last tenant that left an empty queue), so idle time earns no credit, while the
queue never idles when someone waits (work-conserving). With input cost `w_in`, output
cost `w_out`, longest prompt L and at most M tokens in a running batch, two tenants that
stay backlogged over an interval receive weighted service that differs by at most
2·max(w_in·L, w_out·M) over it (the paper's Theorem 4.4).

Plain data: no torch, no I/O, no clock. The scheduler calls `charge()` with the tokens
it computes for a tenant (prefill chunks, recomputation it chooses to bill, sampled
tokens); `pop()` and `remove()` charge nothing.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from ..errors import EngineOverloadedError, InvalidRequestError, TenantShareExceededError


class FairRequest(Protocol):
    """What the queue reads from a request: who sent it, when, and its prompt size."""

    tenant: str
    arrival_time: float
    num_prompt_tokens: int


@dataclass(frozen=True)
class FairnessConfig:
    # Cost of one prompt token and one generated token (the paper's w_p = 1, w_q = 2:
    # a decode token holds the batch for a whole step).
    input_weight: float = 1.0
    output_weight: float = 2.0
    # Places in the waiting queue, all tenants together.
    max_waiting: int = 4096
    # The fraction of max_waiting one tenant of weight 1 may fill; a tenant's share
    # scales with its weight, and is at least one place.
    tenant_share: float = 0.25
    default_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.input_weight < 0 or self.output_weight < 0 or self.input_weight + self.output_weight == 0:
            raise ValueError("input_weight and output_weight must be >= 0 and not both 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if not 0 < self.tenant_share <= 1:
            raise ValueError("tenant_share must be in (0, 1]")
        _check_weight(self.default_weight)

    def tenant_limit(self, weight: float) -> int:
        """Places in the waiting queue a tenant of this weight may fill."""
        return max(1, min(self.max_waiting, int(self.max_waiting * self.tenant_share * weight)))


def _check_weight(weight: float) -> None:
    if not (math.isfinite(weight) and weight > 0):
        raise InvalidRequestError(f"a tenant weight must be a finite number > 0, got {weight!r}")


class FairQueue:
    """The waiting requests of one lane, handed out in virtual-token-counter order.

    Contract of the request queue the scheduler uses: `push` admits (or raises),
    `peek`/`pop` give the next request (None when empty), `remove` takes out a given
    request (admitted out of order, aborted, timed out), `len` counts, iteration yields
    every waiting request in the order `pop` would give them if nothing were charged
    but their prompts, as the queue was when the iteration began (requests removed
    meanwhile are still yielded; a caller that removes while iterating skips them).
    """

    def __init__(self, config: FairnessConfig | None = None, weights: dict[str, float] | None = None) -> None:
        self.config = config or FairnessConfig()
        self._weights: dict[str, float] = {}
        for tenant, w in (weights or {}).items():
            self.set_weight(tenant, w)
        self._counters: dict[str, float] = {}
        self._queues: dict[str, deque[FairRequest]] = {}  # backlogged tenants only
        self._len = 0
        self._last_left: float = 0.0  # counter of the last tenant whose queue emptied

    # -- weights and counters ---------------------------------------------------
    def set_weight(self, tenant: str, weight: float) -> None:
        _check_weight(weight)
        self._weights[tenant] = float(weight)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self.config.default_weight)

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """Service of these tokens before the tenant's weight divides it."""
        return self.config.input_weight * input_tokens + self.config.output_weight * output_tokens

    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Bill tokens computed for `tenant` (a running request's, queued or not)."""
        if input_tokens < 0 or output_tokens < 0:
            raise ValueError("token counts must be >= 0")
        self._counters[tenant] = self.counter(tenant) + self.cost(input_tokens, output_tokens) / self.weight(tenant)

    def tenant_limit(self, tenant: str) -> int:
        return self.config.tenant_limit(self.weight(tenant))

    def waiting_of(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q else 0

    def backlogged(self) -> list[str]:
        return list(self._queues)

    # -- the request-queue interface --------------------------------------------
    def check(self, tenant: str) -> None:
        """Raise when a new request of `tenant` may not join the queue now."""
        if self._len >= self.config.max_waiting:
            raise EngineOverloadedError(f"{self._len} requests are already waiting; try again later")
        limit = self.tenant_limit(tenant)
        if self.waiting_of(tenant) >= limit:
            raise TenantShareExceededError(tenant, self.waiting_of(tenant), limit)

    def push(self, request: FairRequest, *, requeue: bool = False) -> None:
        """Queue a new request (refused by `check`), or with `requeue` one that was already
        admitted once (preempted): never refused, and back in its arrival place."""
        tenant = request.tenant
        if not requeue:
            self.check(tenant)
        q = self._queues.get(tenant)
        if q is None:
            self._lift(tenant)
            q = self._queues[tenant] = deque()
        if requeue and q and q[-1].arrival_time > request.arrival_time:
            q.insert(next(i for i, r in enumerate(q) if r.arrival_time > request.arrival_time), request)
        else:
            q.append(request)
        self._len += 1

    def _lift(self, tenant: str) -> None:
        floor = min((self.counter(t) for t in self._queues), default=self._last_left)
        self._counters[tenant] = max(self.counter(tenant), floor)

    def peek(self) -> FairRequest | None:
        tenant = self._next_tenant()
        return None if tenant is None else self._queues[tenant][0]

    def pop(self) -> FairRequest | None:
        tenant = self._next_tenant()
        if tenant is None:
            return None
        q = self._queues[tenant]
        request = q.popleft()
        self._len -= 1
        if not q:
            self._drop(tenant)
        return request

    def remove(self, request: FairRequest) -> None:
        """Take out `request` (identity, not equality); ValueError when it is not waiting."""
        q = self._queues.get(request.tenant)
        i = next((i for i, r in enumerate(q or ()) if r is request), None)
        if i is None:
            raise ValueError("request is not waiting in this queue")
        del q[i]
        self._len -= 1
        if not q:
            self._drop(request.tenant)

    def _drop(self, tenant: str) -> None:
        del self._queues[tenant]
        self._last_left = self.counter(tenant)

    def _next_tenant(self) -> str | None:
        # Ties go to the tenant whose head request is oldest.
        return min(self._queues, key=lambda t: (self.counter(t), self._queues[t][0].arrival_time), default=None)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[FairRequest]:
        # Over a copy of each tenant's queue (a C-speed copy, then a lazy merge): the
        # iteration sees the queue as it was when it began, whatever is removed meanwhile.
        snap = {t: list(q) for t, q in self._queues.items()}
        weights = {t: self.weight(t) for t in snap}
        heap = [(self.counter(t), q[0].arrival_time, t, 0) for t, q in snap.items()]
        heapq.heapify(heap)
        while heap:
            virtual, _, tenant, i = heapq.heappop(heap)
            q = snap[tenant]
            request = q[i]
            yield request
            if i + 1 < len(q):
                virtual += self.cost(request.num_prompt_tokens, 0) / weights[tenant]
                heapq.heappush(heap, (virtual, q[i + 1].arrival_time, tenant, i + 1))

    def unordered(self) -> Iterator[FairRequest]:
        """Every waiting request, in no particular order (cheaper than iterating)."""
        for q in self._queues.values():
            yield from q
