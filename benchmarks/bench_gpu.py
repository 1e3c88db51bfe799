"""The GPU serving path in one run (a few minutes on an H100/H200):

    python benchmarks/bench_gpu.py                 # everything below
    python benchmarks/bench_gpu.py --json out.json # also write every number

1. Kernels (benchmarks/bench_kernels_gpu.py's table): paged-attention decode bandwidth
   and LoRA shrink/expand FLOP/s, as fractions of the device's peak (spec sheet by
   device name; `--peak-gbs/--peak-tflops` for GPUs not in the table).
2. Decode-step time, eager vs CUDA graphs (engine/runner/cuda_graphs.py), per batch width, on
   SmolLM2-135M and on a 1B-class Llama with 8 rank-16 adapters on the rows.
3. Output tokens/s of the seeded heavy-tailed workload (benchmarks/workload.py) through
   the engine (Triton kernels, bf16) with 0, 8 and 32 rank-16 adapters, and transformers
   (+ PEFT mixed-batch `adapter_names`) `generate` on the same requests.

Models: the embedded SmolLM2-135M and a Llama-3.2-1B-shaped model with random weights
built from a config (nothing is downloaded). Needs a CUDA GPU; `--smoke-cpu` runs tiny
shapes of every part but the graph capture on CPU (Triton's interpreter), to check the
script itself: its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

if "--smoke-cpu" in sys.argv:  # must precede the kernel modules' import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_gpu import PEAKS, Timer, build_large_model, kernel_benchmarks, write_adapters  # noqa: E402
from lockstep import run_lockstep  # noqa: E402
from workload import Workload, heavy_tailed, left_padded  # noqa: E402

NEEDS_GPU = ("needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False); "
             "`--smoke-cpu` checks the script on a CPU")


def fail(msg: str) -> None:
    sys.exit(f"bench_gpu.py: {msg}")


# -- pure helpers (tests/benchmarks/test_bench_gpu_helpers.py) --------------------------
def peak_for(device_name: str, table: dict[str, tuple[float, float]] = PEAKS) -> tuple[float, float] | None:
    """(HBM GB/s, dense bf16 TFLOP/s) of the longest table key in the device's name:
    "NVIDIA H100 NVL" is an H100 NVL, not the SXM H100."""
    keys = [k for k in table if k.lower() in device_name.lower()]
    return table[max(keys, key=len)] if keys else None


def fraction(value: float, peak: float | None, unit: str) -> str:
    """'3612 GB/s = 75% of 4800' (or without the share when the peak is unknown)."""
    if peak is None or peak <= 0:
        return f"{value:.0f} {unit} (peak unknown)"
    return f"{value:.0f} {unit} = {100 * value / peak:.0f}% of {peak:.0f}"


def ratio(x: float, baseline: float) -> str:
    return f"{x / baseline:.2f}x" if baseline > 0 else "-"


def assign_adapters(num_requests: int, names: list[str]) -> list[str | None]:
    """Round-robin: every adapter gets its share of the requests; none without adapters."""
    return [names[i % len(names)] if names else None for i in range(num_requests)]


# -- decode step: eager vs CUDA graphs --------------------------------------------------
def _load_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from loraplex.engine.kernels.triton.kv_write import triton_write_kv
    from loraplex.engine.kernels.triton.paged_attention import triton_paged_attention
    from loraplex.engine.checkpoint import ModelArch, load_state_dict
    from loraplex.engine.models.llama import LlamaModel

    arch = ModelArch.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaModel(arch)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(load_state_dict(model_dir, dtype))
    model.eval().set_attention_ops(triton_write_kv, triton_paged_attention)
    return arch, model


def _random_slots(arch, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device):
    from loraplex.engine.kernels.triton.lora import StackedLoRAWeights
    from loraplex.engine.runner.memory_budget import ModelShape

    in_sizes, out_sizes = ModelShape.from_arch(arch).lora_stack_sizes()
    stacks = StackedLoRAWeights(num_slots, arch.num_layers, in_sizes, out_sizes, rank, dtype, device)
    for g in stacks.a:  # timing needs realistic shapes, not trained values
        stacks.a[g].normal_(0, 0.02)
        stacks.b[g].normal_(0, 0.02)
        stacks.ranks[g].fill_(rank)
    return stacks


@torch.inference_mode()
def decode_steps(model_dir: Path, widths: list[int], ctx: int, num_adapters: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> list[dict]:
    """Per width: ms of one decode step (every row at context `ctx`, rows spread over
    `num_adapters` slots) run eagerly and replayed from a CUDA graph, and their largest
    difference. Both run the same forward (cuda_graphs.LlamaDecodeForward)."""
    from loraplex.engine.runner.cuda_graphs import CUDAGraphRunner, DecodeInputs, GraphPolicy, LlamaDecodeForward

    arch, model = _load_model(model_dir, dtype, device)
    bs, per_seq = 16, -(-ctx // 16)
    blocks = max(widths) * per_seq
    kv = [(torch.randn(arch.num_kv_heads, blocks * bs, arch.head_dim, dtype=dtype, device=device),
           torch.randn(arch.num_kv_heads, blocks * bs, arch.head_dim, dtype=dtype, device=device))
          for _ in range(arch.num_layers)]
    stacks = _random_slots(arch, num_adapters, rank, dtype, device) if num_adapters else None
    fwd = LlamaDecodeForward(model, kv, bs, stacks)
    graphs = device.type == "cuda"
    runner = CUDAGraphRunner(fwd, GraphPolicy(tuple(widths)), per_seq, device)
    fwd(runner.buffers.view(1))
    if graphs:
        runner.capture()
    timer, rows = Timer(device), []
    for w in widths:
        step = DecodeInputs.allocate(w, per_seq, device)
        step.block_tables.copy_(torch.randperm(blocks, device=device)[:w * per_seq].view(w, per_seq))
        step.context_lens.fill_(ctx)
        step.positions.fill_(ctx - 1)
        last = step.block_tables[:, (ctx - 1) // bs].long()
        step.slot_mapping.copy_(last * bs + (ctx - 1) % bs)
        step.input_ids.random_(100, arch.vocab_size - 100)
        if num_adapters:
            step.adapter_slots.copy_(torch.arange(w, device=device) % num_adapters)
        eager = timer(lambda: fwd(step))
        row = dict(width=w, eager_ms=eager, graph_ms=None, max_abs_diff=None)
        if graphs:
            row["graph_ms"] = timer(lambda: runner.run(step))
            row["max_abs_diff"] = (runner.run(step).float() - fwd(step).float()).abs().max().item()
        rows.append(row)
    del runner, kv, model
    _free(device)
    return rows


# -- end to end: the engine vs transformers + PEFT ---------------------------------------
def engine_tok_s(model_dir: Path, store_root: Path, adapters: dict[str, Path], n: int, wl: Workload, args,
                 device: torch.device) -> dict:
    from loraplex.adapters import AdapterStore, BaseShapes
    from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.lora import LoRAManager

    names = list(adapters)[:n]
    cfg = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=args.dtype, device=str(device)),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=int(args.kv_gib * 2**30)),
        scheduler=SchedulerConfig(max_num_seqs=len(wl.prompts), max_num_batched_tokens=args.max_batched_tokens),
        lora=LoRAConfig(max_loras=max(1, n), max_cpu_loras=max(1, n), max_lora_rank=args.rank), kernels="triton")
    manager = None
    if names:
        store = AdapterStore(store_root, BaseShapes.from_model_dir(model_dir))
        have = {r.name for r in store.list()}
        for name in names:
            if name not in have:
                store.add(name, adapters[name])
        manager = LoRAManager(store, cfg.lora)
    engine = LLMEngine(cfg, manager)
    try:
        run = run_lockstep({"engine": engine}, wl, {"engine": assign_adapters(len(wl.prompts), names)})["engine"]
        return {"tok_s": run.tok_s, "elapsed": run.seconds, "steps": run.steps, "warm": run.warm_seconds,
                "ttft_p50": run.ttft_p(50), "ttft_p99": run.ttft_p(99), "preemptions": run.preemptions}
    finally:
        if manager is not None:
            manager.close()
        engine.runner.kv_caches.clear()
        del engine
        _free(device)


@torch.inference_mode()
def hf_tok_s(model_dir: Path, wl: Workload, adapters: list[Path | None], dtype: torch.dtype, batch: int,
             device: torch.device) -> dict:
    """transformers + PEFT on the device: all adapters in one PeftModel, batches in arrival
    order with per-row `adapter_names` (PEFT's mixed-batch inference); each batch runs to
    its longest request, as a batched `generate` does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    names: dict[Path, str] = {}
    if any(a is not None for a in adapters):
        from peft import PeftModel

        names = {p: f"a{i}" for i, p in enumerate(dict.fromkeys(a for a in adapters if a is not None))}
        first, *rest = names
        model = PeftModel.from_pretrained(model, first, adapter_name=names[first]).eval()
        for p in rest:
            model.load_adapter(p, adapter_name=names[p])

    def generate(prompts, outs, rows):
        ids, mask = left_padded(prompts)
        kw = {"adapter_names": [names.get(a, "__base__") for a in rows]} if names else {}
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(outs),
                       min_new_tokens=max(outs), do_sample=False, pad_token_id=0, **kw)

    generate([wl.prompts[0][:8]], [2], adapters[:1])  # CUDA context, cuBLAS handles
    _sync(device)
    start = time.perf_counter()
    for b in range(0, len(wl.prompts), batch):
        generate(wl.prompts[b:b + batch], wl.max_tokens[b:b + batch], adapters[b:b + batch])
    _sync(device)
    elapsed = time.perf_counter() - start
    del model
    _free(device)
    return {"tok_s": wl.num_output_tokens / elapsed, "elapsed": elapsed}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the run --------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter-counts", default="0,8,32")
    ap.add_argument("--hf-adapter-counts", default="0,8",
                    help="PEFT's mixed batches loop over the adapters in every layer: 32 takes minutes")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--graph-widths", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512, help="context length of the decode-step rows")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-gib", type=float, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--work-dir", default=os.environ.get("LORAPLEX_BENCH_DIR", "/tmp/loraplex-bench-gpu"),
                    help="the random model and adapters are built here once and reused")
    ap.add_argument("--peak-gbs", type=float, help="HBM peak (GB/s) of a GPU not in the table")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak (TFLOP/s) of a GPU not in the table")
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on CPU via the Triton interpreter")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.smoke_cpu:
        device = torch.device("cpu")
        torch.set_num_threads(2)
        args.dtype, args.kv_gib, args.num_requests, args.hf_batch = "float32", 0.25, 4, 4
        args.graph_widths, args.context, args.adapter_counts, args.hf_adapter_counts = "1,2", 40, "0,2", "0,2"
    else:
        if not torch.cuda.is_available():
            fail(NEEDS_GPU)
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            fail("TRITON_INTERPRET is set: unset it to run compiled kernels on the GPU")
        device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    gbs, tflops = peak_for(name) or (None, None)
    gbs, tflops = args.peak_gbs or gbs, args.peak_tflops or tflops
    results: dict = {"device": name, "peak_gbs": gbs, "peak_tflops": tflops}
    print(f"device: {name}; peak {gbs or '?'} GB/s HBM, {tflops or '?'} dense bf16 TFLOP/s\n")

    if not args.skip_kernels:
        rows = results["kernels"] = kernel_benchmarks(device, args.smoke_cpu, gbs, tflops)
        attn = max((r for r in rows if r["kernel"].startswith("attn decode")), key=lambda r: r["gbs"])
        lora = max((r for r in rows if r["kernel"].startswith("lora")), key=lambda r: r["tflops"])
        print(f"\npaged-attention decode: {fraction(attn['gbs'], gbs, 'GB/s')} ({attn['kernel']}, {attn['shape']})")
        print(f"LoRA kernels: {fraction(lora['tflops'], tflops, 'TFLOP/s')} ({lora['kernel']}, {lora['shape']}; "
              "tf32 tensor cores: half the bf16 peak is their ceiling)\n", flush=True)

    from loraplex.engine.checkpoint import resolve_model_dir

    work = Path(args.work_dir) / ("smoke" if args.smoke_cpu else "gpu")
    smol = resolve_model_dir("default")
    label = "tiny" if args.smoke_cpu else "1b"
    models = {"SmolLM2-135M": smol,
              f"random Llama {label}": build_large_model(work / f"llama-{label}", "1b", smol, device, args.smoke_cpu)}
    if args.smoke_cpu:
        models.pop("SmolLM2-135M")  # too slow through the interpreter

    widths = [int(w) for w in args.graph_widths.split(",")]
    results["decode_steps"] = []
    slots = 2 if args.smoke_cpu else 8
    print(f"decode step, every row at context {args.context}, rows over {slots} rank-{args.rank} adapters "
          f"(ms; CUDA graphs replay the same forward)")
    print(f"{'model':<20} {'width':>5} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'max|diff|':>10}")
    for label_, model_dir in models.items():
        for r in decode_steps(model_dir, widths, args.context, slots, args.rank, dtype, device):
            results["decode_steps"].append(dict(model=label_, **r))
            g = r["graph_ms"]
            graph, speedup, diff = (f"{g:.3f}", ratio(r["eager_ms"], g), f"{r['max_abs_diff']:.1e}") if g else \
                ("n/a", "-", "-")
            print(f"{label_:<20} {r['width']:>5} {r['eager_ms']:>9.3f} {graph:>9} {speedup:>8} {diff:>10}",
                  flush=True)

    counts = [int(c) for c in args.adapter_counts.split(",")]
    hf_counts = {int(c) for c in args.hf_adapter_counts.split(",") if c}
    wl = heavy_tailed(args.num_requests, **({"mean_prompt": 16, "max_out": 4} if args.smoke_cpu else {}))
    results["throughput"] = []
    print(f"\nseeded workload: {len(wl.prompts)} requests, {wl.num_output_tokens} output tokens, greedy, all at "
          f"once; rank-{args.rank} adapters on all 7 projections, round-robin over the requests")
    print(f"{'model':<20} {'adapters':>8} {'loraplex tok/s':>15} {'HF+PEFT tok/s':>14} {'ratio':>7}")
    for label_, model_dir in models.items():
        paths = write_adapters(model_dir, work / f"adapters-{model_dir.name}-r{args.rank}", max(counts), args.rank)
        for n in counts:
            ours = engine_tok_s(model_dir, work / f"store-{model_dir.name}-r{args.rank}", paths, n, wl, args, device)
            hf = None
            if n in hf_counts:
                per_request = [paths[a] if a else None for a in assign_adapters(len(wl.prompts), list(paths)[:n])]
                hf = hf_tok_s(model_dir, wl, per_request, dtype, args.hf_batch, device)
            results["throughput"].append(dict(model=label_, adapters=n, loraplex=ours, hf=hf))
            theirs, vs = (f"{hf['tok_s']:.0f}", ratio(ours["tok_s"], hf["tok_s"])) if hf else ("skipped", "-")
            print(f"{label_:<20} {n:>8} {ours['tok_s']:>15.0f} {theirs:>14} {vs:>7}", flush=True)

    results["seconds"] = time.perf_counter() - start
    print(f"\ntotal {results['seconds']:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
