"""What sampling costs: the engine at temperature 1 against itself greedy, in one run.

vLLM's benchmark workload: 64 requests at once, random prompts of 256 +- 128 tokens and
128 +- 64 output tokens (ignore_eos, so every mode produces the same tokens count); SmolLM2,
bf16, 2 threads. One engine per mode (greedy, temperature 1 unseeded and seeded, top-p),
their steps interleaved one by one (benchmarks/lockstep.py: on these shared machines two
runs one after the other differ by more than sampling costs). Prints each mode's output
tok/s in its own time and its ratio to greedy, then the sampler alone on [64, vocab]
logits: each kind of row against greedy (argmax) at the same shape, min-p, top-k and
top-p rows both through torch (masks, sorts) and through the "cpu" backend's thresholds
(kernels/cpu/nucleus.c), and greedy and temperature-only rows both through torch on fp32
logits and through the "cpu" backend's plain draw on the LM head's bf16 logits
(kernels/cpu/draw.c); the engine's sampler uses both kernels on that backend.

    python benchmarks/bench_sampling.py                      # engine, then sampler alone
    python benchmarks/bench_sampling.py --skip-engine        # sampler alone (seconds)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lockstep import run_lockstep  # noqa: E402
from workload import random_lengths  # noqa: E402

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from loraplex.engine.engine import LLMEngine  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402
from loraplex.engine.kernels.cpu import draw, nucleus  # noqa: E402
from loraplex.engine.sampler import Sampler, SampleRow, is_plain  # noqa: E402


MODES = {"greedy": dict(temperature=0), "temperature 1": dict(temperature=1.0),
         "temperature 1, seeded": dict(temperature=1.0, seed=1234),
         "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95)}


def run_engine(args: argparse.Namespace) -> dict[str, float]:
    """Output tok/s of each mode, the engines in lockstep, the best of `--rounds` rounds
    (each starting with another engine): {mode: tok/s}."""
    wl = random_lengths(args.num_prompts)
    # Every mode sends the same prompts: without prefix caching each computes them again
    # in every round, so what differs between modes is the sampling alone.
    engines = {mode: LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                                            num_threads=args.threads,
                                            scheduler=SchedulerConfig(max_num_seqs=args.num_prompts),
                                            cache=CacheConfig(enable_prefix_caching=False)))
               for mode in MODES}
    params = {mode: (lambda n, kw=kw: SamplingParams(max_tokens=n, ignore_eos=True, **kw)) for mode, kw in MODES.items()}
    print(f"engine: {len(wl.prompts)} requests at once, prompts {min(map(len, wl.prompts))}-"
          f"{max(map(len, wl.prompts))}, outputs {min(wl.max_tokens)}-{max(wl.max_tokens)} "
          f"({wl.num_output_tokens} tokens); {args.dtype}, {args.threads} threads; one engine per mode, "
          f"their steps interleaved", flush=True)
    none = {mode: [None] * len(wl.prompts) for mode in MODES}
    best: dict[str, float] = {}
    for r in range(args.rounds):
        runs = run_lockstep(engines, wl, none, params, first=r, warm=r == 0)
        for mode, run in runs.items():
            best[mode] = max(best.get(mode, 0.0), run.tok_s)
        print(f"  round {r + 1}: " + ", ".join(f"{m} {runs[m].tok_s:.1f}" for m in MODES) + " output tok/s",
              flush=True)
    for mode, tok_s in best.items():
        print(f"  {mode:<27} {tok_s:7.1f} output tok/s   {tok_s / best['greedy']:.2f}x greedy", flush=True)
    return best


def time_sampler(logits: torch.Tensor, rows: list[SampleRow], repeat: int, threshold: bool = False,
                 plain: bool = False) -> float:
    sampler = Sampler(seed=0, nucleus=nucleus.nucleus_threshold if threshold else None,
                      plain_draw=draw.plain_draw if plain else None)
    sampler.sample(logits, rows)
    start = time.perf_counter()
    for _ in range(repeat):
        sampler.sample(logits, rows)
    return (time.perf_counter() - start) / repeat


def run_sampler(args: argparse.Namespace) -> None:
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 4
    rows = {
        "greedy": dict(temperature=0),
        "temperature 1": dict(temperature=1.0),
        "temperature 1, seeded": dict(temperature=1.0, seed=7),
        "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
        "top_k 50": dict(top_k=50),
        "min_p 0.05": dict(min_p=0.05),
        "logit_bias 300 entries": dict(temperature=0, logit_bias={t * args.vocab // 300: 1.0 for t in range(300)}),
    }
    # bf16, as a bf16 model's LM head makes them: the torch ways include widening them.
    logits = logits.bfloat16()
    print(f"sampler alone: [{args.batch}, {args.vocab}] bfloat16 logits, {args.threads} threads")
    base = None
    for name, kw in rows.items():
        batch = [SampleRow(SamplingParams(**kw), i) for i in range(args.batch)]
        ways = [(name, False, False)]
        if {"top_p", "top_k", "min_p"} & kw.keys() and nucleus.load_library() is not None:
            ways = [(f"{name} (torch)", False, False), (f"{name} (threshold)", True, False)]
        if is_plain(batch[0], args.vocab) and draw.load_library() is not None:
            ways = [(f"{name} (torch)", False, False), (f"{name} (plain draw)", False, True)]
        for label, threshold, plain in ways:
            sec = time_sampler(logits, batch, args.repeat, threshold, plain)
            base = base or sec
            print(f"  {label:<39} {sec * 1e3:8.2f} ms per step   {sec / base:6.2f}x greedy", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_engine:
        run_engine(args)
    run_sampler(args)


if __name__ == "__main__":
    main()
