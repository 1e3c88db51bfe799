"""What sampling costs: the engine at temperature 1 against itself greedy, in one run.

vLLM's benchmark workload: 64 requests at once, random prompts of 256 +- 128 tokens and
128 +- 64 output tokens (ignore_eos, so both runs produce the same tokens count); SmolLM2,
bf16, 2 threads. Prints output tok/s greedy and at temperature 1 (unseeded and seeded)
and their ratio to greedy, then the sampler alone on [64, vocab] logits: each kind of
row against greedy (argmax) at the same shape.

    python benchmarks/bench_sampling.py                      # engine, then sampler alone
    python benchmarks/bench_sampling.py --skip-engine        # sampler alone (seconds)
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow


def random_workload(n: int, seed: int = 0, vocab: tuple[int, int] = (100, 40000)
                    ) -> tuple[list[list[int]], list[int]]:
    """vLLM's `--dataset-name random --random-input-len 256 --random-output-len 128
    --random-range-ratio 0.5`: lengths uniform in [len/2, 3 len/2]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(rng.randint(128, 384))] for _ in range(n)]
    return prompts, [rng.randint(64, 192) for _ in range(n)]


def engine_tok_s(engine: LLMEngine, prompts: list[list[int]], outs: list[int], **kw) -> float:
    """Output tokens/s with every request submitted at once."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n in outs]
    start = time.perf_counter()
    engine.generate(prompts, params)
    return sum(outs) / (time.perf_counter() - start)


def run_engine(args: argparse.Namespace) -> None:
    prompts, outs = random_workload(args.num_prompts)
    # Every mode sends the same prompts: without prefix caching each computes them again,
    # so what differs between modes is the sampling alone.
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype), num_threads=args.threads,
                                    scheduler=SchedulerConfig(max_num_seqs=args.num_prompts),
                                    cache=CacheConfig(enable_prefix_caching=False)))
    engine.warm_up()
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    print(f"engine: {len(prompts)} requests at once, prompts {min(map(len, prompts))}-{max(map(len, prompts))}, "
          f"outputs {min(outs)}-{max(outs)} ({sum(outs)} tokens); {args.dtype}, {args.threads} threads", flush=True)
    greedy = engine_tok_s(engine, prompts, outs, temperature=0)
    print(f"  greedy                  {greedy:7.1f} output tok/s", flush=True)
    for name, kw in (("temperature 1", dict(temperature=1.0)),
                     ("temperature 1, seeded", dict(temperature=1.0, seed=1234)),
                     ("temperature 0.8, top_p 0.95", dict(temperature=0.8, top_p=0.95))):
        tok_s = engine_tok_s(engine, prompts, outs, **kw)
        print(f"  {name:<27} {tok_s:7.1f} output tok/s   {tok_s / greedy:.2f}x greedy", flush=True)
    again = engine_tok_s(engine, prompts, outs, temperature=0)  # the machine's drift over the run
    print(f"  greedy again                {again:7.1f} output tok/s   {again / greedy:.2f}x greedy", flush=True)


def time_sampler(logits: torch.Tensor, rows: list[SampleRow], repeat: int) -> float:
    sampler = Sampler(seed=0)
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
    print(f"sampler alone: [{args.batch}, {args.vocab}] float32 logits, {args.threads} threads")
    base = None
    for name, kw in rows.items():
        batch = [SampleRow(SamplingParams(**kw), i) for i in range(args.batch)]
        sec = time_sampler(logits, batch, args.repeat)
        base = base or sec
        print(f"  {name:<27} {sec * 1e3:8.2f} ms per step   {sec / base:6.2f}x greedy", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_engine:
        run_engine(args)
    run_sampler(args)


if __name__ == "__main__":
    main()
