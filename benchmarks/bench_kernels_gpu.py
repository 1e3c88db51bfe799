"""GPU benchmark of the Triton kernels and of the engine running on them.

One command, a few minutes on an H100/H200:

    python benchmarks/bench_kernels_gpu.py                  # kernels + engine, bf16
    python benchmarks/bench_kernels_gpu.py --skip-engine    # kernels only (~1 min)
    python benchmarks/bench_kernels_gpu.py --json out.json  # also write every number

1. Kernels, each against its torch reference on the same GPU (bf16, Llama-3-8B and
   SmolLM2 shapes): KV write, paged attention (decode batch, mixed prefill+decode
   batch), batched LoRA shrink+expand (decode with 32 adapters, prefill with 4). For each:
   median time, achieved memory bandwidth and FLOP/s, and both as % of the GPU's peak
   (spec sheet, by device name; `--peak-gbs/--peak-tflops` for other GPUs; the measured
   device-to-device copy bandwidth is printed as the practical ceiling).
2. Engine output tokens/s (greedy, all requests at once) with 0, 1 and 32 adapters
   (rank 16, all seven projections) on SmolLM2-135M and on a larger Llama built from a
   config with random weights (Llama-3.2-1B shape by default, `--large 3b|8b`), with the
   Triton kernels and with the torch path.

Needs CUDA and Triton. `--smoke-cpu` runs tiny shapes of every part on CPU through
Triton's interpreter, to check the script itself on a machine without a GPU; its
numbers mean nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

if "--smoke-cpu" in sys.argv:  # must precede the kernel modules' import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

PEAKS = {  # name substring -> (HBM GB/s, dense bf16 TFLOP/s), from the vendor spec sheets
    "H200": (4800, 989), "H100 NVL": (3900, 835), "H100 PCIe": (2000, 756), "H100": (3350, 989),
    "A100-SXM4-80GB": (2039, 312), "A100 80GB PCIe": (1935, 312), "A100": (1555, 312),
    "L40S": (864, 362), "L4": (300, 121),
}
LARGE = {  # Llama-architecture shapes for the random-weight model (vocab is SmolLM2's tokenizer)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {m: "self_attn" if m[0] in "qkvo" else "mlp" for m in MODULES}


def fail(msg: str) -> None:
    sys.exit(f"bench_kernels_gpu.py: {msg}")


# -- kernels ---------------------------------------------------------------------------
class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn) -> float:
        """Median milliseconds per call."""
        if self.device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
        fn()  # smoke mode: one timed call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def copy_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 29, dtype=torch.uint8, device=device)  # 512 MiB
    y = torch.empty_like(x)
    ms = Timer(device)(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def lora_case(T_rows: list[int], rank: int, k: int, widths: list[int], dtype, device, seed=0):
    """Packed (torch path) and stacked (Triton) weights for len(T_rows) adapters, one segment each."""
    from types import SimpleNamespace

    from loraplex.engine.kernels.triton.lora import StackedLoRAWeights
    from loraplex.engine.lora import GROUPS, pack_adapter

    group = next(g for g, mods in GROUPS.items() if len(mods) == len(widths))
    mods = GROUPS[group]
    out = dict(zip(mods, widths))
    out_sizes = {m: out.get(m, 16) for m in MODULES}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    packed = []
    for _ in T_rows:
        w = {(0, m): SimpleNamespace(a=torch.randn(rank, k, generator=gen) / k ** 0.5,
                                     b=torch.randn(out[m], rank, generator=gen) / rank ** 0.5, scale=1.0, rank=rank)
             for m in mods}
        packed.append(pack_adapter(SimpleNamespace(weights=w), out_sizes, 1, dtype, device))
    in_sizes = {g: k for g in GROUPS}
    stacked = StackedLoRAWeights(len(T_rows), 1, in_sizes, out_sizes, max(rank, 16), dtype, device)
    for slot, p in enumerate(packed):
        stacked.set_slot(slot, p)
    segments, row = [], 0
    for slot, n in enumerate(T_rows):
        segments.append((row, row + n, slot))
        row += n
    return group, packed, stacked, segments


def kernel_benchmarks(device: torch.device, smoke: bool, peak_gbs: float | None, peak_tflops: float | None) -> list:
    from loraplex.engine.kernels.torch.attention import build_metadata, build_ragged_metadata
    from loraplex.engine.kernels.triton.kv_write import reference_write_kv, triton_write_kv
    from loraplex.engine.lora.torch_backend import LoRABatch
    from loraplex.engine.kernels.triton.paged_attention import (
        attention_flops_bytes,
        reference_paged_attention,
        triton_paged_attention,
    )

    timer, dtype, isz = Timer(device), torch.bfloat16, 2
    rnd = random.Random(0)
    s = 16 if smoke else 1  # smoke mode divides sizes
    rows = []

    def record(name, shape, tri_fn, ref_fn, bytes_, flops, check=None):
        err = check() if check else None
        t_tri, t_ref = timer(tri_fn), timer(ref_fn)
        gbs = bytes_ / (t_tri * 1e-3) / 1e9
        tfl = flops / (t_tri * 1e-3) / 1e12
        row = dict(kernel=name, shape=shape, triton_ms=t_tri, torch_ms=t_ref, speedup=t_ref / t_tri, gbs=gbs,
                   tflops=tfl, pct_bw=100 * gbs / peak_gbs if peak_gbs else None,
                   pct_flops=100 * tfl / peak_tflops if peak_tflops and flops else None, max_abs_err=err)
        rows.append(row)
        pb = f"{row['pct_bw']:5.1f}%" if row["pct_bw"] is not None else "   - "
        pf = f"{row['pct_flops']:5.1f}%" if row["pct_flops"] is not None else "   - "
        e = f"{err:.1e}" if err is not None else "-"
        print(f"{name:<22} {shape:<44} {t_tri:8.3f} {gbs:8.0f} {pb} {tfl:7.1f} {pf} {t_ref:9.3f} "
              f"{row['speedup']:6.2f}x  {e}", flush=True)

    print(f"{'kernel':<22} {'shape':<44} {'ms':>8} {'GB/s':>8} {'%bw':>6} {'TFLOP/s':>7} {'%peak':>6} "
          f"{'torch ms':>9} {'speedup':>7}  max|err|")

    def kv_write_case(T, KVH, D, slots):
        kc, vc = (torch.zeros(KVH, slots, D, dtype=dtype, device=device) for _ in range(2))
        k, v = (torch.randn(T, KVH, D, dtype=dtype, device=device) for _ in range(2))
        sm = torch.randperm(slots, device=device)[:T]
        record("kv_write", f"T={T} kv_heads={KVH} d={D}", lambda: triton_write_kv(kc, vc, k, v, sm),
               lambda: reference_write_kv(kc, vc, k, v, sm), 4 * T * KVH * D * isz, 0)

    # A decode step's 512 tokens into a 256k-slot cache (Llama-3-8B: 8 KV heads x 128).
    kv_write_case(512 // s, 8, 128, (1 << 18) // s)

    def attention_case(name, lens, H, KVH, D, bs=16):
        nb = [-(-(p + n) // bs) for p, n in lens]
        ids = list(range(sum(nb) + 1))
        rnd.shuffle(ids)
        seqs, i = [], 0
        for (p, n), b in zip(lens, nb):
            seqs.append((p, n, ids[i:i + b]))
            i += b
        kc = torch.randn(KVH, len(ids) * bs, D, dtype=dtype, device=device)
        vc = torch.randn_like(kc)
        T = sum(n for _, n in lens)
        q = torch.randn(T, H, D, dtype=dtype, device=device)
        meta, torch_meta = build_ragged_metadata(seqs, bs, dtype, device), build_metadata(seqs, bs, dtype, device)
        flops, bytes_ = attention_flops_bytes([(p + n, n) for p, n in lens], H, KVH, D, isz)
        sc = D ** -0.5

        def check():
            a = triton_paged_attention(q, kc, vc, meta, sc).float()
            return (a - reference_paged_attention(q, kc, vc, torch_meta, sc).float()).abs().max().item()

        ctx = sum(p + n for p, n in lens) / len(lens)
        record(name, f"B={len(lens)} T={T} ctx~{ctx:.0f} h={H}/{KVH} d={D}",
               lambda: triton_paged_attention(q, kc, vc, meta, sc),
               lambda: reference_paged_attention(q, kc, vc, torch_meta, sc), bytes_, flops, check)

    decodes = [(rnd.randrange(512, 2048) // s, 1) for _ in range(128 // s)]
    attention_case("attn decode 8B", decodes, 32, 8, 128)
    attention_case("attn decode SmolLM2", [(rnd.randrange(512, 2048) // s, 1) for _ in range(64 // s)], 9, 3, 64)
    mixed = decodes[: 32 // s] + [(0, 1024 // s)] * 2 + [(1024 // s, 512 // s)] * 2
    attention_case("attn mixed 8B", mixed, 32, 8, 128)

    def lora(name, seg_rows, rank, k, widths):
        group, packed, stacked, segments = lora_case(seg_rows, rank, k, widths, dtype, device)
        T = sum(seg_rows)
        N = sum(widths)
        x = torch.randn(T, k, dtype=dtype, device=device)
        out = torch.zeros(T, N, dtype=dtype, device=device)
        tri, ref = stacked.batch(segments), LoRABatch(packed, segments)
        M, S = len(widths), len(seg_rows)
        bytes_ = (T * k + S * M * rank * k + S * rank * N + 2 * T * N) * isz + 2 * T * M * rank * 4
        flops = 2 * T * k * M * rank + 2 * T * rank * N

        def check():
            a, b = torch.zeros_like(out), torch.zeros_like(out)
            tri.apply(0, group, x, a)
            ref.apply(0, group, x, b)
            return (a.float() - b.float()).abs().max().item()

        record(name, f"T={T} segs={S} r={rank} {k}->{'+'.join(map(str, widths))}",
               lambda: tri.apply(0, group, x, out), lambda: ref.apply(0, group, x, out), bytes_, flops, check)

    qkv = [4096 // s, 1024 // s, 1024 // s]
    lora("lora qkv decode", [4] * (32 // s or 2), 16, 4096 // s, qkv)
    lora("lora down decode", [4] * (32 // s or 2), 16, 14336 // s, [4096 // s])
    lora("lora qkv prefill", [1024 // s] * 4, 64, 4096 // s, qkv)
    lora("lora gate_up prefill", [1024 // s] * 4, 64, 4096 // s, [14336 // s] * 2)
    return rows


# -- engine ----------------------------------------------------------------------------
def build_large_model(out: Path, size: str, tokenizer_dir: Path, device: torch.device, smoke: bool) -> Path:
    """A Llama folder (config.json + safetensors + SmolLM2's tokenizer) with random weights."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = dict(LARGE[size])
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab.json", "merges.txt",
                    "generation_config.json"):
        for f in tokenizer_dir.glob(pattern):
            shutil.copy(f, out / f.name)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **shape)
    cfg.save_pretrained(out)
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*s):
        return (torch.randn(*s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    state = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    sizes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
             "up_proj": (i, h), "down_proj": (h, i)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for m, s in sizes.items():
            state[f"{p}{PARENT[m]}.{m}.weight"] = rand(*s)
        state[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_adapters(model_dir: Path, root: Path, n: int, rank: int) -> dict[str, Path]:
    """`n` PEFT LoRA folders (all seven projections, rank `rank`) with random weights."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    io = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
          "up_proj": (h, i), "down_proj": (i, h)}
    dirs = {}
    for a in range(n):
        d = root / f"a{a}"
        dirs[f"a{a}"] = d
        if (d / "adapter_model.safetensors").is_file():
            continue
        d.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(L):
            for m, (fin, fout) in io.items():
                key = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) / fin ** 0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * 0.01).bfloat16()
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(MODULES), "bias": "none", "base_model_name_or_path": str(model_dir)}))
    return dirs


def engine_throughput(model_dir: Path, store_root: Path, adapters: dict[str, Path], num_adapters: int,
                      backend: str, args, device: torch.device) -> dict:
    from loraplex.adapters import AdapterStore, BaseShapes
    from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.lora import LoRAManager
    from loraplex.engine.request import SamplingParams

    names = list(adapters)[:num_adapters]
    nslots = max(1, num_adapters)
    cfg = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32" if args.smoke_cpu else "bfloat16",
                          device=device.type),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=args.kv_gib << 30),
        scheduler=SchedulerConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_batched_tokens),
        lora=LoRAConfig(max_loras=nslots, max_cpu_loras=nslots, max_lora_rank=args.rank), kernels=backend)
    manager = None
    if names:
        store = AdapterStore(store_root, BaseShapes.from_model_dir(model_dir))
        for name in names:
            if name not in {r.name for r in store.list()}:
                store.add(name, adapters[name])
        manager = LoRAManager(store, cfg.lora)
    engine = LLMEngine(cfg, manager)
    rnd = random.Random(1)
    vocab = engine.arch.vocab_size
    prompts = [[rnd.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    assign = [names[i % len(names)] if names else None for i in range(args.num_prompts)]

    def run(prompts, assign, max_tokens) -> tuple[int, float]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for p, a in zip(prompts, assign):
            engine.add_request(p, sp, adapter=a)
        n, t = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finish_reason == "error":
                    raise RuntimeError(f"request failed: {o.stop_reason}")
                n += len(o.new_token_ids)
        return n, time.perf_counter() - t

    # Warm-up: loads every adapter into its slot and compiles every kernel configuration
    # (decode-only and mixed batches, short and long LoRA segments). Its own prompts, so
    # the timed run gets no prefix-cache hits from it.
    warm = [[rnd.randrange(100, vocab - 100) for _ in range(48)] for _ in range(max(2, len(names)))]
    run(warm, [names[i % len(names)] if names else None for i in range(len(warm))], 4)
    n, elapsed = run(prompts, assign, args.output_len)
    result = {"tok_s": n / elapsed, "tokens": n, "seconds": elapsed}
    if manager is not None:
        manager.close()
    engine.runner.kv_caches.clear()  # free the KV cache before the next engine is built
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--models", default="smollm2,large", help="comma list of smollm2, large")
    ap.add_argument("--large", default="1b", choices=sorted(LARGE), help="shape of the random-weight Llama")
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument("--adapter-counts", default="0,1,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-gib", type=int, default=8, help="KV cache memory per engine")
    ap.add_argument("--work-dir", default=os.environ.get("LORAPLEX_BENCH_DIR", "/tmp/loraplex-bench-gpu"),
                    help="random model and adapters are built here once and reused")
    ap.add_argument("--peak-gbs", type=float, help="memory bandwidth peak (GB/s) when the GPU is not in the table")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak (TFLOP/s) when the GPU is not in the table")
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on CPU via the Triton interpreter")
    args = ap.parse_args()

    try:
        import triton  # noqa: F401
    except ImportError:
        fail("Triton is not installed (pip install triton==3.9.0)")
    if args.smoke_cpu:
        device = torch.device("cpu")
        torch.set_num_threads(2)
        args.num_prompts, args.prompt_len, args.output_len, args.kv_gib = 4, 20, 3, 1
        if args.adapter_counts == ap.get_default("adapter_counts"):
            args.adapter_counts = "0,1,2"
    else:
        if not torch.cuda.is_available():
            fail("needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False). "
                 "The kernels are tested on CPU by `pytest tests/engine/kernels` (Triton's interpreter).")
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            fail("TRITON_INTERPRET is set: unset it to run compiled kernels on the GPU")
        device = torch.device("cuda")
    start = time.perf_counter()
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"}
    name = results["device"]
    peak_gbs, peak_tflops = args.peak_gbs, args.peak_tflops
    match = next((v for k, v in PEAKS.items() if k in name), None)
    if match and peak_gbs is None:
        peak_gbs = match[0]
    if match and peak_tflops is None:
        peak_tflops = match[1]
    copy = copy_bandwidth(device)
    results.update(peak_gbs=peak_gbs, peak_tflops=peak_tflops, copy_gbs=copy)
    print(f"device: {name}; peak {peak_gbs or '?'} GB/s, {peak_tflops or '?'} dense bf16 TFLOP/s"
          + (f"; measured copy {copy:.0f} GB/s" if copy else ""))
    print("(the kernels multiply 16-bit inputs in tf32 with fp32 accumulation: their compute ceiling is "
          "half the bf16 peak)\n")

    if not args.skip_kernels:
        results["kernels"] = kernel_benchmarks(device, args.smoke_cpu, peak_gbs, peak_tflops)
        print(f"\nkernels done in {time.perf_counter() - start:.0f}s\n", flush=True)

    if not args.skip_engine:
        from loraplex.engine.checkpoint import resolve_model_dir

        work = Path(args.work_dir) / ("smoke" if args.smoke_cpu else "gpu")
        smol = resolve_model_dir("default")
        models = {}
        for m in args.models.split(","):
            if m == "smollm2":
                models["SmolLM2-135M"] = smol
            elif m == "large":
                label = "tiny" if args.smoke_cpu else args.large
                models[f"random Llama {label}"] = build_large_model(work / f"llama-{label}", args.large, smol, device,
                                                                    args.smoke_cpu)
            else:
                fail(f"unknown model {m!r}")
        counts = [int(c) for c in args.adapter_counts.split(",")]
        results["engine"] = []
        print(f"engine: {args.num_prompts} requests x {args.prompt_len} prompt tokens -> {args.output_len} "
              f"output tokens each, greedy, all at once; adapters rank {args.rank} on all 7 projections")
        print(f"{'model':<22} {'adapters':>8} {'backend':>8} {'output tok/s':>13} {'seconds':>8}")
        for label, model_dir in models.items():
            adapters = write_adapters(model_dir, work / f"adapters-{model_dir.name}-r{args.rank}", max(counts),
                                      args.rank)
            for n in counts:
                for backend in args.backends.split(","):
                    r = engine_throughput(model_dir, work / f"store-{model_dir.name}-r{args.rank}", adapters, n,
                                          backend, args, device)
                    results["engine"].append(dict(model=label, adapters=n, backend=backend, **r))
                    print(f"{label:<22} {n:>8} {backend:>8} {r['tok_s']:>13.0f} {r['seconds']:>8.1f}", flush=True)
    results["seconds"] = time.perf_counter() - start
    print(f"\ntotal {results['seconds']:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
