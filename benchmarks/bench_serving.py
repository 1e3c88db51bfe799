"""Open-loop traffic replay against a live OpenAI-compatible server: latency per lane, SLOs.

Requests go out at their planned times whatever the server's state (open loop), as
streaming /v1/completions with token-id prompts of the planned length (deterministic),
`ignore_eos` so each produces its planned output length, the lane in `x-loraplex-lane`,
each tenant with its own API key. Printed per lane and per prompt-length bucket: TTFT
and TPOT p50/p90/p99, goodput (requests within the SLO), throughput; for a rate sweep
the knee (the highest rate below which every swept rate keeps p99 TTFT within the SLO).
JSON results and PNG charts (latency vs rate per lane) go to --out.

Scenarios:
  poisson          Poisson arrivals at each of --rates (requests/s), --requests per rate.
  trace            replay --trace (JSONL, benchmarks/traces/make_trace.py), --speedup.
  mixed-lane       interactive tenants at --interactive-rate, alone and then with a batch
                   tenant sending at 2x the measured capacity; on a server with lanes and
                   on one without (every tenant in the standard lane, `--scheduling fcfs`).
  noisy-neighbour  tenant A floods at 2x capacity while B sends at --interactive-rate;
                   B's p99 TTFT with `--scheduling fair` vs `--scheduling fcfs`.

A server is either given (--url, --key TENANT=KEY ..., and --fcfs-url/--fcfs-key for the
comparison run) or started here (--model FOLDER: `loraplex serve` with the tenants each
scenario needs, in a fresh data folder; --serve-arg/--fcfs-serve-arg add options).

    python benchmarks/bench_serving.py --scenario mixed-lane --model /path/to/model
    python benchmarks/bench_serving.py --scenario trace --url http://127.0.0.1:8000 --key t0=lpx_...
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from traces.make_trace import TraceError, read_trace  # noqa: E402
from serve_process import ServeProcess, fill_models  # noqa: E402, F401
# The plan and its arithmetic live in serving_plan.py; named here too, as this module's API.
from serving_plan import (  # noqa: E402, F401
    LANE_HEADER,
    BUCKET_EDGES,
    TOKEN_RANGE,
    SLO,
    Target,
    Planned,
    Result,
    prompt_ids,
    poisson_times,
    bucket_of,
    meets_slo,
    summarize,
    grouped,
    knee,
    plan_poisson,
    plan_trace,
    map_adapters,
)

async def _one(client, model: str, p: Planned, lane_of: dict[str, str], seed: int, t_start: float) -> Result:
    res = Result(p.tenant, p.lane or lane_of.get(p.tenant, "default"), p.adapter, p.prompt_tokens)
    headers = {LANE_HEADER: p.lane} if p.lane else {}
    sent = time.perf_counter()
    res.sent = sent - t_start
    first = last = None
    n = 0
    try:
        stream = await client.completions.create(
            model=p.adapter or model, prompt=prompt_ids(p.prompt_tokens, seed), max_tokens=p.output_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, extra_headers=headers)
        usage = None
        async for chunk in stream:
            if chunk.choices:  # one chunk per step, even where a token's text is still incomplete
                last = time.perf_counter()
                first = first or last
                n += 1
            usage = chunk.usage or usage
        res.output_tokens = usage.completion_tokens if usage else n
    except Exception as e:  # a refused or failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {str(e)[:200]}"
    res.e2e = time.perf_counter() - sent
    if first is not None:
        res.ttft = first - sent
        if res.output_tokens > 1:
            res.tpot = (last - first) / (res.output_tokens - 1)
    return res


async def run_plan(target: Target, plan: list[Planned], seed: int = 0) -> tuple[list[Result], float]:
    """Send every planned request at its time; (results, wall seconds until the last finished)."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0))
    tenants = {p.tenant for p in plan}
    missing = {t for t in tenants if t not in target.keys and "*" not in target.keys}
    if missing:
        await http.aclose()
        raise SystemExit(f"bench_serving: no API key for tenant(s) {', '.join(sorted(missing))} (--key TENANT=KEY)")
    clients = {t: openai.AsyncOpenAI(base_url=f"{target.url}/v1", api_key=target.keys.get(t, target.keys.get("*")),
                                     max_retries=0, http_client=http) for t in tenants}
    t_start = time.perf_counter()
    tasks, first_seed = [], seed * 1_000_003 + target.sent
    target.sent += len(plan)
    try:
        for i, p in enumerate(sorted(plan, key=lambda p: p.at)):
            delay = t_start + p.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(clients[p.tenant], target.model, p, target.lanes, first_seed + i,
                                                  t_start)))
        results = await asyncio.gather(*tasks)
    finally:
        await http.aclose()
    return list(results), time.perf_counter() - t_start


async def measure_capacity(target: Target, tenant: str, n: int, prompt_tokens: int, output_tokens: int) -> float:
    """Requests per second the server completes when `n` arrive at once (a closed burst)."""
    results, wall = await run_plan(target, [Planned(0.0, tenant, None, None, prompt_tokens, output_tokens)] * n)
    done = sum(r.error is None for r in results)
    if not done:
        raise SystemExit(f"bench_serving: no request succeeded while measuring capacity: {results[0].error}")
    return done / wall


def _ms(v: float) -> str:
    return "     -" if v != v else f"{v * 1e3:6.0f}"


def print_run(name: str, summary: dict[str, dict[str, dict]]) -> None:
    print(f"\n== {name}")
    print(f"  {'group':24} {'n':>5} {'err':>4}  TTFT p50/p90/p99 ms     TPOT p50/p90/p99 ms    "
          f"goodput  req/s  tok/s")
    for kind in ("lane", "prompt_bucket", "all"):
        for key, s in summary[kind].items():
            label = key if kind == "all" else f"{kind.split('_')[-1]} {key}"
            print(f"  {label:24} {s['requests']:5d} {s['errors']:4d}  "
                  f"{_ms(s['ttft_p50'])} {_ms(s['ttft_p90'])} {_ms(s['ttft_p99'])}   "
                  f"{_ms(s['tpot_p50'])} {_ms(s['tpot_p90'])} {_ms(s['tpot_p99'])}   "
                  f"{s['goodput_fraction']:6.1%} {s['throughput_rps']:6.2f} {s['output_tokens_per_s']:6.1f}")


def plot(runs: list[dict], path: Path) -> None:
    """p99 TTFT and p99 TPOT vs offered rate, one line per (series, lane)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[tuple[str, str], list[tuple[float, dict]]] = {}
    for run in runs:
        for lane, s in run["summary"]["lane"].items():
            lines.setdefault((run["series"], lane), []).append((run["rate"], s))
    for ax, metric, title in ((axes[0], "ttft_p99", "p99 TTFT (s)"), (axes[1], "tpot_p99", "p99 TPOT (s)")):
        for (series, lane), pts in sorted(lines.items()):
            pts.sort(key=lambda p: p[0])
            ax.plot([p[0] for p in pts], [p[1][metric] for p in pts], marker="o", label=f"{series}: {lane}")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record(runs: list[dict], series: str, name: str, rate: float, results: list[Result], wall: float,
           slo: SLO) -> dict[str, dict[str, dict]]:
    summary = grouped(results, slo, wall)
    runs.append({"series": series, "name": name, "rate": rate, "duration_s": wall, "summary": summary,
                 "requests": [asdict(r) for r in results]})
    print_run(f"{name} (offered {rate:.2f} req/s, {wall:.1f} s)", summary)
    return summary


# -- scenarios ---------------------------------------------------------------------------
def _target(args, tenants: dict[str, str], reported: dict[str, str], fcfs: bool):
    """A context manager giving the Target: started here (--model) or the given URL.
    A server started here schedules `--scheduling fcfs` for the comparison run and
    `fair` otherwise, unless its serve args say."""
    import shlex

    if args.model:
        extra = shlex.split(args.fcfs_serve_args if fcfs else args.serve_args)
        if not any(a == "--scheduling" or a.startswith("--scheduling=") for a in extra):
            extra += ["--scheduling", "fcfs" if fcfs else "fair"]
        return ServeProcess(args.model, tenants, extra, reported)
    url, keys = (args.fcfs_url, args.fcfs_key) if fcfs else (args.url, args.key)
    if not url:
        raise SystemExit(f"bench_serving: give --model, or --{'fcfs-' if fcfs else ''}url and its keys")
    target = Target(url.rstrip("/"), parse_keys(keys), lanes=reported)
    target.model = args.base_model or ""
    if not target.model or args.adapters is None:
        import httpx

        key = next(iter(target.keys.values()), "")
        r = httpx.get(f"{target.url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)
        r.raise_for_status()
        fill_models(target, [m["id"] for m in r.json()["data"]], args.base_model)
    if args.adapters is not None:
        target.adapters = [a for a in args.adapters.split(",") if a]
    return contextlib.nullcontext(target)


@contextlib.contextmanager
def _server(args, tenants: dict[str, str], reported: dict[str, str], fcfs: bool) -> Iterator[Target]:
    """The Target, warmed by `--warmup` short requests so no run pays for a cold server."""
    with _target(args, tenants, reported, fcfs) as target:
        warm = [Planned(0.0, next(iter(tenants)), None, None, args.prompt_tokens, 2)] * args.warmup
        if warm:
            asyncio.run(run_plan(target, warm))
        yield target


def parse_tenants(spec: str) -> dict[str, str]:
    """"a,b:batch" -> {"a": "standard", "b": "batch"}."""
    out = {}
    for item in spec.split(","):
        name, _, lane = item.partition(":")
        if not name or lane not in ("", "interactive", "standard", "batch"):
            raise SystemExit(f"bench_serving: bad tenant {item!r} (TENANT or TENANT:interactive|standard|batch)")
        out[name] = lane or "standard"
    return out


def parse_keys(items: list[str]) -> dict[str, str]:
    keys = {}
    for item in items:
        tenant, sep, key = item.partition("=")
        keys[tenant if sep else "*"] = key if sep else tenant
    return keys


def scenario_poisson(args, runs: list[dict], slo: SLO) -> dict:
    lanes = parse_tenants(args.tenants)
    tenants = list(lanes)
    with _server(args, lanes, lanes, False) as target:
        points: dict[str, list[tuple[float, float]]] = {}
        for rate in args.rates:
            plan = plan_poisson(rate, args.requests, tenants, args.seed, args.prompt_tokens, args.output_tokens)
            s = record(runs, "poisson", f"poisson {rate}", rate, *asyncio.run(run_plan(target, plan, args.seed)),
                       slo)
            for lane, v in s["lane"].items():
                points.setdefault(lane, []).append((rate, v["ttft_p99"]))
    knees = {lane: knee(p, slo.ttft_s) for lane, p in points.items()}
    print(f"\nknee (highest rate with p99 TTFT <= {slo.ttft_s} s): " +
          ", ".join(f"{lane} {k if k is not None else 'none'}" for lane, k in knees.items()))
    return {"knee": knees}


def scenario_trace(args, runs: list[dict], slo: SLO) -> dict:
    try:
        records = read_trace(args.trace)
    except (OSError, TraceError) as e:
        raise SystemExit(f"bench_serving: {e}") from None
    plan = plan_trace(records, args.speedup, args.requests or None)
    order = {"interactive": 0, "standard": 1, "batch": 2}
    lanes: dict[str, str] = {}
    for p in plan:  # a tenant's lane: the highest any of its requests asks for
        lane = p.lane or "standard"
        lanes[p.tenant] = min(lanes.get(p.tenant, lane), lane, key=order.__getitem__)
    with _server(args, lanes, lanes, False) as target:
        plan = map_adapters(plan, target.adapters)
        rate = len(plan) / max(plan[-1].at, 1e-9)
        record(runs, "trace", f"trace {Path(args.trace).name} x{args.speedup}", rate,
               *asyncio.run(run_plan(target, plan, args.seed)), slo)
    return {}


def _capacity(args, target: Target, tenant: str) -> float:
    if args.capacity:
        return args.capacity
    cap = asyncio.run(measure_capacity(target, tenant, args.capacity_requests, args.batch_prompt_tokens,
                                       args.output_tokens))
    print(f"capacity: {cap:.2f} req/s ({args.capacity_requests} requests of {args.batch_prompt_tokens}+"
          f"{args.output_tokens} tokens at once)")
    return cap


def _flood_plan(args, tenant: str, rate: float, duration: float) -> list[Planned]:
    n = max(1, round(rate * duration))
    return plan_poisson(rate, n, [tenant], args.seed + 1, args.batch_prompt_tokens, args.output_tokens)


def _p99(summary: dict, group: str) -> float:
    return summary["lane"].get(group, {}).get("ttft_p99", float("nan"))


def scenario_mixed_lane(args, runs: list[dict], slo: SLO) -> dict:
    roles = {"inter0": "interactive", "inter1": "interactive", "bulk": "batch"}
    inter = plan_poisson(args.interactive_rate, args.requests, ["inter0", "inter1"], args.seed, args.prompt_tokens,
                         args.output_tokens)
    duration = inter[-1].at + 1 / args.interactive_rate
    with _server(args, roles, roles, False) as target:
        cap = _capacity(args, target, "bulk")
        bulk = _flood_plan(args, "bulk", 2 * cap, duration)
        total = args.interactive_rate + 2 * cap
        alone = record(runs, "lanes", "interactive alone (lanes)", args.interactive_rate,
                       *asyncio.run(run_plan(target, inter, args.seed)), slo)
        lanes = record(runs, "lanes", "interactive + batch at 2x capacity (lanes)", total,
                       *asyncio.run(run_plan(target, inter + bulk, args.seed)), slo)
    with _server(args, {t: "standard" for t in roles}, roles, True) as target:
        fcfs = record(runs, "fcfs", "interactive + batch at 2x capacity (FCFS: one lane)", total,
                      *asyncio.run(run_plan(target, inter + bulk, args.seed)), slo)
    base = _p99(alone, "interactive")
    out = {"capacity_rps": cap, "interactive_p99_ttft_s": {"alone": base, "lanes": _p99(lanes, "interactive"),
                                                           "fcfs": _p99(fcfs, "interactive")}}
    print(f"\ninteractive p99 TTFT: alone {base:.3f} s; with batch flooding: lanes "
          f"{out['interactive_p99_ttft_s']['lanes']:.3f} s ({out['interactive_p99_ttft_s']['lanes'] / base:.2f}x, "
          f"aim <= 1.5x), FCFS {out['interactive_p99_ttft_s']['fcfs']:.3f} s "
          f"({out['interactive_p99_ttft_s']['fcfs'] / base:.2f}x)")
    for name, s in (("lanes", lanes), ("FCFS", fcfs)):
        b = s["lane"].get("batch", {})
        print(f"batch under {name}: {b.get('requests', 0) - b.get('errors', 0)}/{b.get('requests', 0)} "
              f"finished, {b.get('output_tokens_per_s', 0):.1f} output tok/s")
    return out


def scenario_noisy_neighbour(args, runs: list[dict], slo: SLO) -> dict:
    roles = {"flood": "A (flood)", "modest": "B (modest)"}
    tenants = {t: "standard" for t in roles}
    modest = plan_poisson(args.interactive_rate, args.requests, ["modest"], args.seed, args.prompt_tokens,
                          args.output_tokens)
    duration = modest[-1].at + 1 / args.interactive_rate
    with _server(args, tenants, roles, False) as target:
        cap = _capacity(args, target, "flood")
        flood = _flood_plan(args, "flood", 2 * cap, duration)
        total = args.interactive_rate + 2 * cap
        fair = record(runs, "fair", "A floods at 2x capacity, B modest (fair)", total,
                      *asyncio.run(run_plan(target, modest + flood, args.seed)), slo)
    with _server(args, tenants, roles, True) as target:
        fcfs = record(runs, "fcfs", "A floods at 2x capacity, B modest (FCFS)", total,
                      *asyncio.run(run_plan(target, modest + flood, args.seed)), slo)
    b = {"fair": _p99(fair, roles["modest"]), "fcfs": _p99(fcfs, roles["modest"])}
    print(f"\nB's p99 TTFT: fair {b['fair']:.3f} s, FCFS {b['fcfs']:.3f} s ({b['fcfs'] / b['fair']:.2f}x fair)")
    return {"capacity_rps": cap, "b_p99_ttft_s": b}


SCENARIOS = {"poisson": scenario_poisson, "trace": scenario_trace, "mixed-lane": scenario_mixed_lane,
             "noisy-neighbour": scenario_noisy_neighbour}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scenario", choices=SCENARIOS, default="poisson")
    srv = p.add_argument_group("server: started here, or given")
    srv.add_argument("--model", default=None, help="start `loraplex serve --model MODEL` for each run")
    srv.add_argument("--serve-args", default="", help="more `loraplex serve` options, one string")
    srv.add_argument("--fcfs-serve-args", default="", help="options of the comparison (FCFS) server")
    srv.add_argument("--url", default=None, help="a running OpenAI-compatible server")
    srv.add_argument("--key", action="append", default=[], metavar="TENANT=KEY", help="repeatable; KEY alone: any")
    srv.add_argument("--fcfs-url", default=None)
    srv.add_argument("--fcfs-key", action="append", default=[], metavar="TENANT=KEY")
    srv.add_argument("--base-model", default=None, help="the base model id (default: the first listed)")
    srv.add_argument("--adapters", default=None, help="comma-separated adapter ids (default: the others listed)")
    load = p.add_argument_group("load")
    load.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0])
    load.add_argument("--requests", type=int, default=100, help="per rate / interactive requests / trace limit")
    load.add_argument("--tenants", default="t0", help="poisson: comma-separated TENANT[:LANE] (round robin)")
    load.add_argument("--trace", default=str(Path(__file__).parent / "traces" / "synthetic_chat.jsonl"))
    load.add_argument("--speedup", type=float, default=1.0, help="trace: replay this many times faster")
    load.add_argument("--interactive-rate", type=float, default=1.0, help="interactive/B tenants' req/s")
    load.add_argument("--capacity", type=float, default=None, help="req/s (default: measured)")
    load.add_argument("--capacity-requests", type=int, default=32)
    load.add_argument("--prompt-tokens", type=int, default=128)
    load.add_argument("--batch-prompt-tokens", type=int, default=512)
    load.add_argument("--output-tokens", type=int, default=32)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=2, help="requests sent to each server before measuring")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    p.add_argument("--out", default="bench_serving_out", help="folder for results.json and the PNG")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.interactive_rate <= 0 or any(r <= 0 for r in args.rates):
        raise SystemExit("bench_serving: --requests, --interactive-rate and --rates must be positive")
    slo, runs = SLO(args.slo_ttft, args.slo_tpot), []
    extra = SCENARIOS[args.scenario](args, runs, slo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"scenario": args.scenario, "slo": asdict(slo), **extra, "runs": runs}
    (out / f"{args.scenario}.json").write_text(json.dumps(result, indent=1))
    plot(runs, out / f"{args.scenario}.png")
    print(f"\nwrote {out / (args.scenario + '.json')} and {out / (args.scenario + '.png')}")
    return result


if __name__ == "__main__":
    main()
