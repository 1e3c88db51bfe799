"""Admission planning: the counter changes one request needs, and the 429 naming the
limit it hit."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.platform.errors import RateLimitedError
from loraplex.platform.quotas.limits import LIMIT_NAMES, Limits
from loraplex.platform.quotas.windows import minute_start, period_bounds

# (scope, kind, window_start, amount) of everything a request took to give back or settle (not rpm).
Charges = list[tuple[str, str, int, int]]


@dataclass
class Reservation:
    """What one admitted request took; settled exactly once."""

    request_id: str
    charges: Charges
    leased: bool
    settled: bool = False


@dataclass
class Check:
    scope: str
    label: str  # "tenant acme" / "key lpx_ab12..."
    kind: str
    window: int
    amount: int
    limit: int
    retry_after: float


def plan_admission(scopes: Iterable[tuple[str, str, Limits]], tokens: int, now: float) -> list[Check]:
    """The counter changes admitting one request needs, or RateLimitedError right away
    when the request could never fit (more tokens than a whole limit, a zero limit)."""
    checks: list[Check] = []
    m = minute_start(now)
    to_minute = m + 60 - now
    for scope, label, lim in scopes:
        if lim.rpm is not None:
            checks.append(Check(scope, label, "rpm", m, 1, lim.rpm, to_minute))
        if lim.tpm is not None:
            checks.append(Check(scope, label, "tpm", m, tokens, lim.tpm, to_minute))
        if lim.token_budget is not None:
            a, b = period_bounds(lim.budget_period or "month", now)
            checks.append(Check(scope, label, "budget", a, tokens, lim.token_budget, b - now))
        if lim.max_concurrency is not None:
            checks.append(Check(scope, label, "conc", 0, 1, lim.max_concurrency, 1.0))
    for c in checks:
        if c.amount > c.limit:
            if c.kind in ("tpm", "budget"):
                err = RateLimitedError(
                    f"{c.label}: this request needs up to {c.amount} tokens (prompt + max_tokens), more than its "
                    f"whole {LIMIT_NAMES[c.kind]} of {c.limit}; lower max_tokens", c.retry_after)
            else:
                err = RateLimitedError(f"{c.label} has a {LIMIT_NAMES[c.kind]} limit of {c.limit}", c.retry_after)
            err.limit = c.kind
            raise err
    checks.sort(key=lambda c: (c.scope, c.kind, c.window))
    return checks


def rejection(failed: list[Check]) -> RateLimitedError:
    order = {"budget": 0, "conc": 1, "tpm": 2, "rpm": 3}
    worst = min(failed, key=lambda c: order[c.kind])
    retry = max(c.retry_after for c in failed)
    what = LIMIT_NAMES[worst.kind]
    if worst.kind == "budget":
        msg = f"{worst.label} has used its token budget of {worst.limit} for this period"
    elif worst.kind == "conc":
        msg = f"{worst.label} is at its max-concurrency limit of {worst.limit} requests in flight"
    else:
        msg = f"{worst.label} is over its {what} limit of {worst.limit}"
    err = RateLimitedError(f"{msg}; retry after {max(1, round(retry))} s", retry)
    err.limit = worst.kind  # for metrics
    return err



def full_rejection(checks: list[Check], used: dict) -> RateLimitedError:
    """The rejection when some counter was full; `used` read after the fact names which."""
    full = [c for c in checks if used.get((c.scope, c.kind, c.window), 0) + c.amount > c.limit]
    return rejection(full or checks)



def settle_moves(charges, tokens_used: int, live: bool) -> list[tuple[str, str, int, int]]:
    moves = []
    for scope, kind, window, amount in charges:
        if kind == "conc":
            if live:
                moves.append((scope, kind, window, -amount))
        else:  # tpm, budget: the reservation becomes the actual use
            moves.append((scope, kind, window, tokens_used - amount if live else tokens_used))
    return moves



def charges_of(value) -> Charges:
    if isinstance(value, str):  # some drivers hand JSON back as text
        value = json.loads(value)
    return [(s, k, int(w), int(a)) for s, k, w, a in value]
