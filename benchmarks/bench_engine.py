"""Engine throughput: continuous batching vs static batching vs transformers' generate.

One run, same seeded heavy-tailed workload, same model, same threads:
  (a) loraplex, continuous batching   (b) loraplex, static batching
  (c) transformers' batched `generate` with left padding
Prints output tokens/s for each, a/b and a/c, TTFT and TPOT p50/p99 by input-length
bucket, and KV slots wasted.

    python benchmarks/bench_engine.py                 # SmolLM2, 64 prompts, bf16, 2 threads
    python benchmarks/bench_engine.py --num-prompts 16 --skip-hf
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import Workload, heavy_tailed, left_padded, percentile  # noqa: E402

from loraplex.engine.config import EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from loraplex.engine.engine import LLMEngine  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402

BUCKETS = ((0, 128), (128, 256), (256, 10**9))


def run_engine(engine: LLMEngine, wl: Workload) -> dict:
    """All requests arrive at once; returns throughput, per-request latencies, KV waste."""
    engine.warm_up()  # every batch width meets its matmul shapes once, in every run alike
    engine.generate([wl.prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
           for p, n in zip(wl.prompts, wl.max_tokens)]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    waste_num = waste_den = 0
    bs = engine.kv.block_size
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
        for r in engine.scheduler.running:
            waste_num += len(r.block_ids) * bs - r.num_computed_tokens
            waste_den += len(r.block_ids) * bs
    elapsed = time.perf_counter() - start
    lat = [(len(p), first[i] - start, (done[i] - first[i]) / max(1, n - 1))
           for i, p, n in zip(ids, wl.prompts, wl.max_tokens)]
    return {"tok_s": wl.num_output_tokens / elapsed, "elapsed": elapsed, "lat": lat,
            "waste": waste_num / max(1, waste_den), "preemptions": engine.scheduler.num_preemptions}


def run_hf(model_dir: Path, wl: Workload, dtype: torch.dtype, batch: int) -> dict:
    """transformers' generate: padded batches; each batch runs to its longest request."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    start = time.perf_counter()
    padded_slots = real_slots = 0
    with torch.inference_mode():
        for b in range(0, len(wl.prompts), batch):
            prompts, outs = wl.prompts[b:b + batch], wl.max_tokens[b:b + batch]
            ids, mask = left_padded(prompts)
            width = ids.shape[1]
            model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                           do_sample=False, pad_token_id=0)
            padded_slots += len(prompts) * (width + max(outs))
            real_slots += sum(len(p) + n for p, n in zip(prompts, outs))
    elapsed = time.perf_counter() - start
    n_tokens = sum(wl.max_tokens[: len(wl.prompts)])
    return {"tok_s": n_tokens / elapsed, "elapsed": elapsed, "waste": 1 - real_slots / padded_slots}


def schedule_bound(wl: Workload, width: int) -> tuple[int, int]:
    """Decode steps each policy needs at the least: static runs each batch of `width` to
    its longest output; continuous needs the longest output, and one step per `width`
    output tokens. Both pay the same prefill, so their ratio bounds a/b from above."""
    outs = wl.max_tokens
    static = sum(max(outs[i:i + width]) for i in range(0, len(outs), width))
    return static, max(max(outs), -(-sum(outs) // width))


def print_latency(name: str, res: dict) -> None:
    for lo, hi in BUCKETS:
        rows = [(t, p) for n, t, p in res["lat"] if lo <= n < hi]
        if not rows:
            continue
        ttft, tpot = [r[0] * 1e3 for r in rows], [r[1] * 1e3 for r in rows]
        label = f"{lo}-{hi if hi < 10**9 else 'inf'}"
        print(f"  {name:<11} prompts {label:>9} (n={len(rows):>2}): TTFT p50 {percentile(ttft, 50):8.0f} ms "
              f"p99 {percentile(ttft, 99):8.0f} ms | TPOT p50 {percentile(tpot, 50):6.1f} ms p99 {percentile(tpot, 99):6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wl = heavy_tailed(args.num_prompts)
    print(f"workload: {len(wl.prompts)} prompts, mean {sum(map(len, wl.prompts)) / len(wl.prompts):.0f} tokens; "
          f"outputs {min(wl.max_tokens)}-{max(wl.max_tokens)} (mean {wl.num_output_tokens / len(wl.prompts):.0f}, "
          f"ignore_eos, greedy); {args.dtype}, {args.threads} threads")

    def engine(policy: str, width: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype), num_threads=args.threads,
                                      scheduler=SchedulerConfig(policy=policy, max_num_seqs=width,
                                                                max_num_batched_tokens=args.max_num_batched_tokens)))

    # (a) vs (b) at the same batch width: continuous batching refills a finished
    # request's slot at once; static batching waits for the batch's longest request.
    eng = engine("continuous", args.max_num_seqs)
    a = run_engine(eng, wl)
    model_dir = eng.model_dir
    del eng
    print(f"(a) continuous batching, width {args.max_num_seqs:>3}: {a['tok_s']:7.1f} output tok/s ({a['elapsed']:.1f} s, "
          f"KV slots wasted {a['waste']:.1%}, preemptions {a['preemptions']})", flush=True)
    b = run_engine(engine("static", args.max_num_seqs), wl)
    print(f"(b) static batching,     width {args.max_num_seqs:>3}: {b['tok_s']:7.1f} output tok/s ({b['elapsed']:.1f} s, "
          f"KV slots wasted {b['waste']:.1%})", flush=True)
    full = run_engine(engine("continuous", max(args.max_num_seqs, len(wl.prompts))), wl)
    print(f"(a+) continuous, all requests at once: {full['tok_s']:7.1f} output tok/s ({full['elapsed']:.1f} s)",
          flush=True)
    if not args.skip_hf:
        c = run_hf(model_dir, wl, getattr(torch, args.dtype), args.hf_batch)
        print(f"(c) transformers generate, batch {args.hf_batch}: {c['tok_s']:7.1f} output tok/s ({c['elapsed']:.1f} s, "
              f"padded KV slots wasted {c['waste']:.1%})")
    steps_b, steps_a = schedule_bound(wl, args.max_num_seqs)
    print(f"decode steps the schedules need at least: static {steps_b}, continuous {steps_a} "
          f"(with free prefill a/b could reach at most {steps_b / steps_a:.2f}x on this workload)")
    print(f"a/b = {a['tok_s'] / b['tok_s']:.2f}x" + ("" if args.skip_hf else
          f"   a/c = {a['tok_s'] / c['tok_s']:.2f}x   a+/c = {full['tok_s'] / c['tok_s']:.2f}x"))
    print_latency("continuous", a)
    print_latency("static", b)


if __name__ == "__main__":
    main()
