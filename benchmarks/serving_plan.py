"""The serving benchmark's plain data and arithmetic: planned requests, results, SLOs,
percentiles per lane and prompt-length bucket, the knee of a rate sweep. No I/O, so
tests check it directly (bench_serving.py drives servers with it)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from traces.make_trace import TraceRecord
from workload import percentile

LANE_HEADER = "x-loraplex-lane"
BUCKET_EDGES = (128, 512, 2048)  # prompt-length bucket upper bounds; the last bucket is open
TOKEN_RANGE = (1000, 9000)  # ids used for synthetic prompts: ordinary tokens in any 32k+ vocabulary


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.2


@dataclass
class Target:
    url: str
    keys: dict[str, str]  # tenant -> API key
    model: str = ""  # the base model's id
    adapters: list[str] = field(default_factory=list)
    lanes: dict[str, str] = field(default_factory=dict)  # tenant -> the lane it is reported under
    sent: int = 0  # requests sent so far: no two share a prompt, so no prefix-cache hits between runs


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the run starts
    tenant: str
    adapter: str | None  # None: the base model
    lane: str | None  # None: the tenant's lane
    prompt_tokens: int
    output_tokens: int


@dataclass
class Result:
    tenant: str
    lane: str
    adapter: str | None
    prompt_tokens: int
    output_tokens: int = 0
    sent: float = 0.0  # seconds after the run starts
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    error: str | None = None


# -- pure helpers ---------------------------------------------------------------------
def prompt_ids(length: int, seed: int) -> list[int]:
    """A deterministic prompt of exactly `length` token ids."""
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def poisson_times(rate: float, n: int, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def bucket_of(prompt_tokens: int, edges: tuple[int, ...] = BUCKET_EDGES) -> str:
    lo = 1
    for hi in edges:
        if prompt_tokens <= hi:
            return f"{lo}-{hi}"
        lo = hi + 1
    return f">{edges[-1]}"


def meets_slo(r: Result, slo: SLO) -> bool:
    return (r.error is None and r.ttft is not None and r.ttft <= slo.ttft_s
            and (r.tpot is None or r.tpot <= slo.tpot_s))


def summarize(results: list[Result], slo: SLO, duration: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    good = sum(meets_slo(r, slo) for r in results)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        **{f"ttft_p{p}": percentile(ttft, p) for p in (50, 90, 99)},
        **{f"tpot_p{p}": percentile(tpot, p) for p in (50, 90, 99)},
        "goodput_fraction": good / len(results) if results else float("nan"),
        "goodput_rps": good / duration if duration > 0 else float("nan"),
        "throughput_rps": len(ok) / duration if duration > 0 else float("nan"),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration if duration > 0 else float("nan"),
    }


def grouped(results: list[Result], slo: SLO, duration: float) -> dict[str, dict[str, dict]]:
    by: dict[str, dict[str, list[Result]]] = {"lane": {}, "prompt_bucket": {}}
    for r in results:
        by["lane"].setdefault(r.lane, []).append(r)
        by["prompt_bucket"].setdefault(bucket_of(r.prompt_tokens), []).append(r)
    out = {kind: {k: summarize(v, slo, duration) for k, v in sorted(groups.items())}
           for kind, groups in by.items()}
    out["all"] = {"all": summarize(results, slo, duration)}
    return out


def knee(points: list[tuple[float, float]], slo_ttft: float) -> float | None:
    """The highest swept rate up to which every rate's p99 TTFT stays within the SLO."""
    best = None
    for rate, p99 in sorted(points):
        if not p99 <= slo_ttft:  # NaN (nothing answered) is a miss too
            break
        best = rate
    return best


def plan_poisson(rate: float, n: int, tenants: list[str], seed: int, prompt_tokens: int,
                 output_tokens: int) -> list[Planned]:
    return [Planned(t, tenants[i % len(tenants)], None, None, prompt_tokens, output_tokens)
            for i, t in enumerate(poisson_times(rate, n, seed))]


def plan_trace(records: list[TraceRecord], speedup: float = 1.0, limit: int | None = None) -> list[Planned]:
    records = records[:limit] if limit else records
    t0 = records[0].timestamp
    return [Planned((r.timestamp - t0) / speedup, r.tenant, r.adapter, r.lane, r.prompt_tokens, r.output_tokens)
            for r in records]


def map_adapters(plan: list[Planned], available: list[str]) -> list[Planned]:
    """Trace adapters, most requested first, onto the server's adapters in turn (none: base)."""
    counts: dict[str, int] = {}
    for p in plan:
        if p.adapter is not None:
            counts[p.adapter] = counts.get(p.adapter, 0) + 1
    ranked = sorted(counts, key=lambda a: (-counts[a], a))
    to = {a: available[i % len(available)] if available else None for i, a in enumerate(ranked)}
    return [Planned(p.at, p.tenant, to.get(p.adapter) if p.adapter else None, p.lane, p.prompt_tokens,
                    p.output_tokens) for p in plan]


# -- the open-loop runner ----------------------------------------------------------------
