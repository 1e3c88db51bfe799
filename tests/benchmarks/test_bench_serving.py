"""bench_serving's pure helpers, the trace format and generator, and one tiny real run."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks import bench_serving as bs
from benchmarks.traces.make_trace import TraceError, generate, parse_record, read_trace, write_trace


def res(ttft: float | None, tpot: float | None = 0.05, error: str | None = None, lane: str = "standard",
        prompt: int = 100, out: int = 10) -> bs.Result:
    return bs.Result("t", lane, None, prompt, out, ttft=ttft, tpot=tpot, error=error)


def test_summary_percentiles_goodput_and_throughput():
    results = [res(0.01 * i) for i in range(1, 101)] + [res(None, None, error="APIStatusError: 429")]
    results[-2].tpot = 0.5  # within the TTFT SLO, over the TPOT one
    s = bs.summarize(results, bs.SLO(ttft_s=0.5, tpot_s=0.2), duration=10.0)
    assert (s["requests"], s["errors"]) == (101, 1)
    assert (s["ttft_p50"], s["ttft_p90"], s["ttft_p99"]) == pytest.approx((0.51, 0.90, 0.99), abs=0.006)
    assert s["tpot_p50"] == 0.05
    assert s["goodput_fraction"] == pytest.approx(50 / 101)  # ttft <= 0.5 s: requests 1..50
    assert s["goodput_rps"] == pytest.approx(5.0) and s["throughput_rps"] == pytest.approx(10.0)
    assert s["output_tokens_per_s"] == pytest.approx(100.0)


def test_slo_needs_an_answer_and_tolerates_a_single_token():
    slo = bs.SLO(2.0, 0.2)
    assert bs.meets_slo(res(1.0, None), slo)  # one output token: no TPOT
    assert not bs.meets_slo(res(2.5), slo) and not bs.meets_slo(res(1.0, 0.3), slo)
    assert not bs.meets_slo(res(None, None, error="ReadTimeout"), slo)


def test_grouping_by_lane_and_prompt_bucket():
    results = [res(0.1, lane="interactive", prompt=50), res(0.2, lane="batch", prompt=600),
               res(0.3, lane="batch", prompt=5000), res(0.4, lane="batch", prompt=128)]
    g = bs.grouped(results, bs.SLO(), 1.0)
    assert list(g["lane"]) == ["batch", "interactive"] and g["lane"]["batch"]["requests"] == 3
    assert {k: v["requests"] for k, v in g["prompt_bucket"].items()} == {"1-128": 2, "513-2048": 1, ">2048": 1}
    assert g["all"]["all"]["requests"] == 4
    assert [bs.bucket_of(n) for n in (1, 128, 129, 512, 513, 2048, 2049)] == \
        ["1-128", "1-128", "129-512", "129-512", "513-2048", "513-2048", ">2048"]


def test_knee_is_the_last_rate_before_the_first_miss():
    assert bs.knee([(4, 2.5), (1, 0.5), (2, 1.9), (8, 1.0)], 2.0) == 2
    assert bs.knee([(1, float("nan")), (2, 0.1)], 2.0) is None
    assert bs.knee([(1, 3.0)], 2.0) is None and bs.knee([(1, 0.1), (3, 0.2)], 2.0) == 3


def test_prompts_and_arrivals_are_deterministic():
    assert bs.prompt_ids(37, 5) == bs.prompt_ids(37, 5) != bs.prompt_ids(37, 6)
    assert len(bs.prompt_ids(37, 5)) == 37 and all(bs.TOKEN_RANGE[0] <= t < bs.TOKEN_RANGE[1]
                                                  for t in bs.prompt_ids(37, 5))
    times = bs.poisson_times(4.0, 4000, seed=1)
    assert times == bs.poisson_times(4.0, 4000, seed=1) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential


def test_trace_records_are_validated_with_the_line_named(tmp_path):
    good = '{"timestamp": 1.5, "tenant": "t0", "adapter": null, "lane": "batch", "prompt_tokens": 3, ' \
           '"output_tokens": 4}'
    assert parse_record(good).lane == "batch"
    for bad, why in [("{", "not JSON"), ("[1]", "JSON object"), ('{"timestamp": 1}', "missing"),
                     (good.replace("1.5", "-1"), "timestamp"), (good.replace('"t0"', '""'), "tenant"),
                     (good.replace('"batch"', '"urgent"'), "lane"), (good.replace(": 3", ": 0"), "prompt_tokens"),
                     (good.replace(": 4", ": true"), "output_tokens")]:
        with pytest.raises(TraceError, match=why):
            parse_record(bad)
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n\n" + good.replace("1.5", "1.0") + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:3: timestamps must not decrease"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(TraceError, match="no records"):
        read_trace(path)


def test_the_generator_is_seeded_bursty_heavy_tailed_and_zipf(tmp_path):
    a, b = generate(2000, seed=3), generate(2000, seed=3)
    assert a == b != generate(2000, seed=4)
    gaps = [y.timestamp - x.timestamp for x, y in zip(a, a[1:])]
    assert statistics.stdev(gaps) / statistics.mean(gaps) > 1.5  # burstier than Poisson (CV 1)
    prompts = sorted(r.prompt_tokens for r in a)
    assert prompts[-len(a) // 100] > 5 * statistics.median(prompts)  # a long tail
    counts = {}
    for r in a:
        if r.adapter:
            counts[r.adapter] = counts.get(r.adapter, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] > 5 * ranked[-1] and max(counts, key=counts.get) == "a00"
    path = tmp_path / "g.jsonl"
    write_trace(a, path)
    assert read_trace(path) == a


def test_the_shipped_trace_is_the_generators_default():
    shipped = read_trace(bs.Path(bs.__file__).parent / "traces" / "synthetic_chat.jsonl")
    assert shipped == generate()


def test_trace_plans_and_adapter_mapping():
    recs = generate(50, seed=1)
    plan = bs.plan_trace(recs, speedup=2.0, limit=10)
    assert len(plan) == 10 and plan[0].at == 0.0
    assert plan[-1].at == pytest.approx((recs[9].timestamp - recs[0].timestamp) / 2)
    names = ["a05", "a01", "a05", None, "a07", "a05", "a01", "a09"]
    plan = [bs.Planned(float(i), "t", a, None, 5, 5) for i, a in enumerate(names)]
    # By popularity (ties by name): a05 -> x, a01 -> y, a07 -> z, a09 -> x again; None stays the base.
    assert [p.adapter for p in bs.map_adapters(plan, ["x", "y", "z"])] == ["x", "y", "x", None, "z", "x", "y", "x"]
    assert all(m.adapter is None for m in bs.map_adapters(plan, []))
    assert bs.parse_keys(["a=k1", "k2", "b=x=y"]) == {"a": "k1", "*": "k2", "b": "x=y"}
    assert bs.parse_tenants("a,b:batch,c:interactive") == {"a": "standard", "b": "batch", "c": "interactive"}
    for bad in ("a:urgent", ",a", "a,"):
        with pytest.raises(SystemExit, match="bad tenant"):
            bs.parse_tenants(bad)


def test_a_tiny_replay_against_a_real_loraplex_serve(tiny_llama_dir, tmp_path, capsys):
    out = bs.main(["--scenario", "trace", "--model", str(tiny_llama_dir), "--requests", "4", "--speedup", "20",
                   "--serve-args", "--dtype float32 --threads 1 --num-kv-blocks 128", "--out", str(tmp_path)])
    (run,) = out["runs"]
    assert [r["error"] for r in run["requests"]] == [None] * 4
    planned = read_trace(bs.Path(bs.__file__).parent / "traces" / "synthetic_chat.jsonl")[:4]
    assert sorted(r["output_tokens"] for r in run["requests"]) == sorted(p.output_tokens for p in planned)
    assert all(r["ttft"] > 0 and r["e2e"] >= r["ttft"] for r in run["requests"])
    assert run["summary"]["all"]["all"]["requests"] == 4 and not math.isnan(run["summary"]["all"]["all"]["ttft_p99"])
    saved = json.loads((tmp_path / "trace.json").read_text())
    assert saved["runs"][0]["summary"] == run["summary"]
    assert (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert all(f"lane {lane} " in printed for lane in run["summary"]["lane"]) and "bucket 1-128" in printed
