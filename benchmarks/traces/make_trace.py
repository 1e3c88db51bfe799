"""Request traces for bench_serving: the JSONL format, and a seeded synthetic generator.

One JSON object a line:
    {"timestamp": 0.42, "tenant": "t0", "adapter": "a03", "lane": "interactive",
     "prompt_tokens": 812, "output_tokens": 64}
timestamp: seconds from the trace's start (non-decreasing); adapter: null for the base
model; lane: null for the tenant's own lane. bench_serving maps the trace's tenants to
API keys and its adapters (by popularity) onto the adapters the server lists.

The synthetic trace is shaped like public chat traces: bursty arrivals (gamma
inter-arrival times with a coefficient of variation above 1), log-normal prompt and
output lengths with long tails, Zipf adapter and tenant popularity.

    python benchmarks/traces/make_trace.py --out benchmarks/traces/synthetic_chat.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

LANES = ("interactive", "standard", "batch")


class TraceError(ValueError):
    """A trace file line that is not a valid record (the message names the line)."""


@dataclass(frozen=True)
class TraceRecord:
    timestamp: float
    tenant: str
    adapter: str | None
    lane: str | None
    prompt_tokens: int
    output_tokens: int


def parse_record(line: str, where: str = "trace") -> TraceRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a record must be a JSON object")
    missing = {"timestamp", "tenant", "prompt_tokens", "output_tokens"} - obj.keys()
    if missing:
        raise TraceError(f"{where}: missing {', '.join(sorted(missing))}")
    ts, tenant, adapter, lane = obj["timestamp"], obj["tenant"], obj.get("adapter"), obj.get("lane")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0")
    if not isinstance(tenant, str) or not tenant:
        raise TraceError(f"{where}: tenant must be a non-empty string")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise TraceError(f"{where}: adapter must be a non-empty string or null")
    if lane is not None and lane not in LANES:
        raise TraceError(f"{where}: lane must be one of {', '.join(LANES)} or null")
    for key in ("prompt_tokens", "output_tokens"):
        v = obj[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise TraceError(f"{where}: {key} must be an integer >= 1")
    return TraceRecord(float(ts), tenant, adapter, lane, obj["prompt_tokens"], obj["output_tokens"])


def read_trace(path: str | Path) -> list[TraceRecord]:
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                rec = parse_record(line, f"{path}:{i}")
                if records and rec.timestamp < records[-1].timestamp:
                    raise TraceError(f"{path}:{i}: timestamps must not decrease")
                records.append(rec)
    if not records:
        raise TraceError(f"{path}: no records")
    return records


def write_trace(records: list[TraceRecord], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (i + 1) ** s for i in range(n)]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(rng.lognormvariate(math.log(median), sigma))))


def generate(n: int = 600, seed: int = 0, rate: float = 4.0, cv: float = 2.0, num_tenants: int = 6,
             num_adapters: int = 16, zipf_s: float = 1.1, base_fraction: float = 0.2,
             prompt_median: int = 256, output_median: int = 48, max_prompt: int = 4096,
             max_output: int = 1024) -> list[TraceRecord]:
    """`n` requests at `rate` per second on average, inter-arrival CV `cv` (1: Poisson)."""
    if n < 1 or rate <= 0 or cv <= 0:
        raise ValueError("n, rate and cv must be positive")
    rng = random.Random(seed)
    shape = 1 / cv ** 2  # gamma inter-arrivals: CV = 1/sqrt(shape)
    tenants = [f"t{i}" for i in range(num_tenants)]
    # Tenant 0 is interactive, the last one batch, the rest standard (their own lanes).
    lanes = {t: "interactive" if i == 0 else "batch" if i == num_tenants - 1 and i else None
             for i, t in enumerate(tenants)}
    adapters = [f"a{i:02d}" for i in range(num_adapters)]
    tw, aw = zipf_weights(num_tenants, zipf_s), zipf_weights(num_adapters, zipf_s)
    t, out = 0.0, []
    for _ in range(n):
        tenant = rng.choices(tenants, tw)[0]
        adapter = None if not adapters or rng.random() < base_fraction else rng.choices(adapters, aw)[0]
        batch = lanes[tenant] == "batch"
        out.append(TraceRecord(round(t, 4), tenant, adapter, lanes[tenant],
                               _lognormal_int(rng, prompt_median * (4 if batch else 1), 1.0, 4, max_prompt),
                               _lognormal_int(rng, output_median, 0.9, 1, max_output)))
        t += rng.gammavariate(shape, 1 / (shape * rate))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("-n", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=4.0, help="mean requests per second")
    p.add_argument("--cv", type=float, default=2.0, help="inter-arrival coefficient of variation (1: Poisson)")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--prompt-median", type=int, default=256)
    p.add_argument("--output-median", type=int, default=48)
    a = p.parse_args(argv)
    records = generate(a.n, a.seed, a.rate, a.cv, a.tenants, a.adapters, a.zipf,
                       prompt_median=a.prompt_median, output_median=a.output_median)
    write_trace(records, a.out)
    print(f"wrote {len(records)} requests over {records[-1].timestamp:.1f} s to {a.out}")


if __name__ == "__main__":
    main()
