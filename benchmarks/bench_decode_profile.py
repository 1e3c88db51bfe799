"""Where a decode step's time goes, at a batch of 64 (SmolLM2, bf16, 2 threads).

Fills the batch with 64 requests, lets every prompt prefill, then times decode-only
steps with timers hooked onto the model's parts from here (nothing in the engine's hot
path): projections (qkv, o, gate_up, down), attention (KV write + paged attention),
other layer ops (norms, RoPE, SiLU, embedding), the LM head, sampling, the runner's
batch building, and the engine's own work around execution (scheduling, the update,
detokenization, outputs). Prints each as a share of the step, greedy and at
temperature 1, and the GEMMs' FLOP/s against the peak of the same linear layers
measured on this machine at a large row count. Then the step's floor at those rates:
the GEMMs at that peak and attention's KV cache read at the rate torch reads one large
tensor here, which bounds what any kernel work on this machine can still take.
The parts are timed on eager steps (a replayed decode step, runner/cpu_graphs.py, makes
its kernel calls without the modules the timers wrap); then the same steps replayed,
timed whole.

    python benchmarks/bench_decode_profile.py
    python benchmarks/bench_decode_profile.py --batch 16 --steps 10
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from loraplex.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams

PARTS = ("projections", "attention", "other layer ops", "lm_head", "sampling", "runner batch building",
         "engine (schedule, update, detokenize)")


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start
        return timed


def instrument(engine: LLMEngine, timers: Timers) -> int:
    """Timers around the model's parts; returns the projections' multiply-adds per row."""
    runner, model = engine.runner, engine.runner.model
    macs = 0
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            proj = getattr(layer, name)
            macs += proj.in_features * proj.out_features
            proj.forward = timers.wrap("projections", proj.forward)
        layer.write_kv = timers.wrap("attention", layer.write_kv)
        layer.attn_impl = timers.wrap("attention", layer.attn_impl)
    model.forward = timers.wrap("model forward", model.forward)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    runner.sampler.sample = timers.wrap("sampling", runner.sampler.sample)
    execute = runner.execute

    def counted(out, requests):
        if timers.on:  # the context every sequence's attention reads this step, new token included
            timers.total["context tokens"] += sum(s.start_pos + len(s.token_ids) for s in out.seqs)
        return execute(out, requests)

    runner.execute = timers.wrap("execute", counted)
    engine.step = timers.wrap("step", engine.step)
    return macs


def measure_gemm_peak(engine: LLMEngine, rows: int = 1024, repeat: int = 5) -> float:
    """Best multiply-add rate (FLOP/s) of the model's own linear layers at `rows` rows."""
    layer, best = engine.runner.model.layers[0], 0.0
    with torch.inference_mode():
        for proj in (layer.qkv_proj, layer.gate_up_proj, layer.down_proj):
            x = torch.randn(rows, proj.in_features).to(engine.runner.dtype)
            proj(x)
            start = time.perf_counter()
            for _ in range(repeat):
                proj(x)
            best = max(best, 2 * rows * proj.in_features * proj.out_features * repeat / (time.perf_counter() - start))
    return best


def measure_read_bandwidth(mib: int = 512, repeat: int = 3) -> float:
    """Best rate (bytes/s) at which torch sums an fp32 tensor of `mib` MiB (far beyond any
    cache; torch's bf16 sum converts too slowly to be limited by memory): what reading
    memory in long runs reaches on this machine now."""
    x = torch.ones(mib << 18, dtype=torch.float32)
    x.sum()
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        x.sum()
        best = max(best, x.nbytes / (time.perf_counter() - start))
    return best


def decode_profile(engine: LLMEngine, timers: Timers, batch: int, steps: int, **params) -> dict[str, float]:
    """Seconds per decode step by part, with `batch` requests all decoding; and per
    replayed step ("replayed step") where the engine replays them."""
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(rng.randint(128, 384))],
                           SamplingParams(max_tokens=2 * steps + 64, ignore_eos=True, **params))
    sched = engine.scheduler
    while len(sched.running) < batch or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()  # prefills (and the first decodes of the requests that finished theirs)
    graphs, engine.runner.cpu_graphs = engine.runner.cpu_graphs, None
    timers.total.clear()
    timers.on = True
    for _ in range(steps):
        engine.step()
    timers.on = False
    engine.runner.cpu_graphs = graphs
    replayed = float("nan")
    if graphs is not None:
        for _ in range(2):  # the width's recording
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        replayed = (time.perf_counter() - start) / steps
    for rid in list(sched.requests):
        engine.abort_request(rid)
    t = {k: v / steps for k, v in timers.total.items()}
    model = t["model forward"]
    return {"projections": t["projections"], "attention": t["attention"],
            "other layer ops": model - t["projections"] - t["attention"],
            "lm_head": t["lm_head"], "sampling": t["sampling"],
            "runner batch building": t["execute"] - model - t["lm_head"] - t["sampling"],
            "engine (schedule, update, detokenize)": t["step"] - t["execute"], "step": t["step"],
            "replayed step": replayed,
            "context tokens": t["context tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype), num_threads=args.threads,
                                    scheduler=SchedulerConfig(max_num_seqs=args.batch)))
    engine.warm_up()
    timers = Timers()
    macs = instrument(engine, timers)
    vocab, hidden = engine.arch.vocab_size, engine.arch.hidden_size
    profiles = {}
    peak = measure_gemm_peak(engine)
    bandwidth = measure_read_bandwidth()
    for name, params in (("greedy", dict(temperature=0)), ("temperature 1", dict(temperature=1.0))):
        profiles[name] = decode_profile(engine, timers, args.batch, args.steps, **params)
        # The peak is the best of measurements around the profiles: a busy machine's
        # rate moves, and a low peak would overstate the efficiency.
        peak = max(peak, measure_gemm_peak(engine))
        bandwidth = max(bandwidth, measure_read_bandwidth())
    a = engine.arch
    kv_per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * engine.runner.dtype.itemsize
    print(f"decode steps at batch {args.batch}, {args.dtype}, {args.threads} threads; "
          f"GEMM peak of these layers at 1024 rows: {peak / 1e9:.1f} GFLOP/s")
    for name, p in profiles.items():
        step = p["step"]
        print(f"{name}: {step * 1e3:.1f} ms per eager step ({args.batch / step:.0f} tok/s at this batch); "
              f"replayed {p['replayed step'] * 1e3:.1f} ms (its next {args.steps} steps, contexts longer)")
        for part in PARTS:
            print(f"  {part:<38} {p[part] * 1e3:7.2f} ms  {p[part] / step:6.1%}")
        proj_rate = 2 * args.batch * macs / p["projections"]
        head_rate = 2 * args.batch * hidden * vocab / p["lm_head"]
        print(f"  projections at {proj_rate / 1e9:.1f} GFLOP/s = {proj_rate / peak:.0%} of peak; "
              f"lm_head at {head_rate / 1e9:.1f} GFLOP/s = {head_rate / peak:.0%} of peak")
        kv = p["context tokens"] * kv_per_token
        print(f"  attention reads {kv / 1e6:.0f} MB of KV cache at {kv / p['attention'] / 1e9:.1f} GB/s = "
              f"{kv / p['attention'] / bandwidth:.0%} of the {bandwidth / 1e9:.1f} GB/s a long read reaches here")
        floor = 2 * args.batch * (macs + hidden * vocab) / peak + kv / bandwidth
        print(f"  floor at those rates (GEMMs at peak, the KV read at that bandwidth, all else free): "
              f"{floor * 1e3:.1f} ms = {floor / step:.0%} of the step")
    ratio = profiles["temperature 1"]["sampling"] / profiles["temperature 1"]["step"]
    print(f"sampling's share of a step: greedy {profiles['greedy']['sampling'] / profiles['greedy']['step']:.1%}, "
          f"temperature 1 {ratio:.1%}")

if __name__ == "__main__":
    main()
