"""Speculative decoding (prompt lookup) against plain decoding, in one run, same engine config.

  copy-heavy: chat requests that repeat, edit or quote a passage of their prompt, greedy,
              at concurrency 1 and 4 (closed loop): TPOT p50 and output tok/s, plain vs spec
  random:     vLLM bench's random workload (256 +- 128 in, 128 +- 64 out, ignore_eos), all
              64 at once (full load), temperature 1: output tok/s, spec / plain

Prints each pair and its ratio; the engines alternate so the machine's drift hits both.

    python benchmarks/bench_spec.py                  # SmolLM2, bf16, 2 threads
    python benchmarks/bench_spec.py --quick          # fewer requests
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import percentile, random_lengths  # noqa: E402

from loraplex.engine.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from loraplex.engine.engine import LLMEngine  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402

SENTENCES = [
    "The committee approved the budget after a long debate about road repairs.",
    "Our service stores every invoice for seven years and deletes it afterwards.",
    "To reset the router, hold the button on its back for ten seconds.",
    "The museum opens at nine on weekdays and at ten on weekends and holidays.",
    "Customers who cancel within thirty days receive a full refund of the fee.",
    "The new library has a reading room, a cafe and a garden on its roof.",
    "Please send the signed contract to the legal team before Friday noon.",
    "The train to the airport leaves every fifteen minutes from platform four.",
]
ASKS = ["Repeat the following text exactly:\n{}", "Fix any typos in this text and return it in full:\n{}",
        "Quote the passage below word for word, then stop:\n{}", "Rewrite this text, keeping every sentence:\n{}"]


def copy_prompts(engine: LLMEngine, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        passage = " ".join(rng.sample(SENTENCES, 4))
        out.append(engine.tokenizer.apply_chat_template([{"role": "user", "content": ASKS[i % len(ASKS)].format(passage)}]))
    return out


def closed_loop(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """Keep `concurrency` requests in flight until all ran; TPOT per request, output tok/s."""
    pending, first, last, count, active = list(prompts), {}, {}, {}, set()
    start = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            active.add(engine.add_request(pending.pop(0), params))
        for o in engine.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                active.discard(o.request_id)
    elapsed = time.perf_counter() - start
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return {"tpot_p50": percentile(tpot, 50), "tok_s": sum(count.values()) / elapsed}


def make_engine(args, speculative: bool) -> LLMEngine:
    spec = SpeculativeConfig("ngram", args.num_speculative_tokens) if speculative else SpeculativeConfig()
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                                    scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
                                    num_threads=args.threads, speculative=spec))
    engine.warm_up()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = ap.parse_args()
    plain, spec = make_engine(args, False), make_engine(args, True)
    engines = {"plain": plain, "spec": spec}
    n_copy = 4 if args.quick else 8
    greedy = SamplingParams(max_tokens=128, temperature=0)
    print(f"model={args.model} dtype={args.dtype} threads={args.threads} k={args.num_speculative_tokens}")
    for c in (1, 4):
        prompts = copy_prompts(plain, n_copy * c, seed=c)
        res = {name: closed_loop(e, prompts, greedy, c) for name, e in engines.items()}
        p, s = res["plain"], res["spec"]
        print(f"copy-heavy c={c}: TPOT p50 plain {p['tpot_p50'] * 1e3:.1f} ms, spec {s['tpot_p50'] * 1e3:.1f} ms "
              f"-> {p['tpot_p50'] / s['tpot_p50']:.2f}x better; tok/s {p['tok_s']:.0f} vs {s['tok_s']:.0f} "
              f"({s['tok_s'] / p['tok_s']:.2f}x)")
    acc = spec.scheduler.speculation
    print(f"  drafts accepted: {acc.num_accepted_tokens}/{acc.num_draft_tokens} "
          f"({acc.num_accepted_tokens / max(1, acc.num_draft_tokens):.0%})")
    wl = random_lengths(16 if args.quick else 64)
    sampled = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=i)
               for i, n in enumerate(wl.max_tokens)]
    tok_s = {}
    for name in ("plain", "spec", "plain", "spec") if not args.quick else ("plain", "spec"):
        start = time.perf_counter()
        engines[name].generate(wl.prompts, sampled)
        tok_s.setdefault(name, []).append(wl.num_output_tokens / (time.perf_counter() - start))
    best = {k: max(v) for k, v in tok_s.items()}
    print(f"random, {len(wl.prompts)} at once, temperature 1: plain {best['plain']:.0f} tok/s, spec "
          f"{best['spec']:.0f} tok/s -> {best['spec'] / best['plain']:.2f}x (best of {len(tok_s['plain'])})")


if __name__ == "__main__":
    main()
