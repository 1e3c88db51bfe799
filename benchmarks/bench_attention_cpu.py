"""Paged attention on the CPU: the C kernels (engine/kernels/cpu/prefill.c, decode.c, and
prefill_amx.c for bf16 prefill chunks on CPUs with AMX) against the torch path
(engine/kernels/torch/attention.py: gathered blocks, SDPA / batched matmuls).

One run, same threads, same cache (SmolLM2's 9 query heads over 3 KV heads of 64,
blocks scattered through the cache as in a running engine). Per batch shape: time per
layer for each, GFLOP/s of attention arithmetic, and the C kernels' speed-up; on CPUs
with AMX the prefill shapes also time prefill.c itself against the tile kernel.

    python benchmarks/bench_attention_cpu.py            # 2 threads
    python benchmarks/bench_attention_cpu.py --threads 1
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from loraplex.engine.kernels.torch.attention import paged_attention
from loraplex.engine.kernels.cpu.metadata import build_cpu_metadata
from loraplex.engine.kernels.cpu import decode as cpu_decode, prefill as cpu_prefill, prefill_amx

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _batch(lens: list[tuple[int, int]], seed: int = 0):
    """(cached prefix, new rows) per sequence, decodes first -> q, caches, metadata."""
    rnd = random.Random(seed)
    need = [-(-(s + n) // BLOCK) for s, n in lens]
    ids = list(range(sum(need)))
    rnd.shuffle(ids)
    seqs, i = [], 0
    for (s, n), nb in zip(lens, need):
        seqs.append((s, n, ids[i:i + nb]))
        i += nb
    shape = (KV_HEADS, len(ids) * BLOCK, HEAD_DIM)
    kc, vc = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    q = torch.randn(sum(n for _, n in lens), HEADS, HEAD_DIM).bfloat16()
    return q, kc, vc, build_cpu_metadata(seqs, BLOCK, torch.bfloat16)


def _time(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_prefill.load_library() is None or cpu_decode.load_library() is None:
        raise SystemExit("the C kernels could not be built (no C compiler?)")
    shapes = {
        "prefill, one 215-token prompt": [(0, 215)],
        "prefill, 1024-token chunk of 5 prompts": [(0, 205)] * 4 + [(0, 204)],
        "prefill, 512-token chunk after 1536 cached": [(1536, 512)],
        "decode, 16 rows, contexts 300-500": [(300 + 13 * i, 1) for i in range(16)],
        "decode, 64 rows, contexts 16-1000": [(16 + 15 * i, 1) for i in range(64)],
    }
    print(f"{HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}, block {BLOCK}, bf16, {args.threads} threads")
    for label, lens in shapes.items():
        q, kc, vc, meta = _batch(lens)
        # causal: each new row sees its prefix and the rows before it
        flop = sum(4 * HEADS * HEAD_DIM * sum(s + i + 1 for i in range(n)) for s, n in lens)
        t_c = _time(lambda: cpu_decode.cpu_paged_attention(q, kc, vc, meta, HEAD_DIM ** -0.5), args.reps)
        t_t = _time(lambda: paged_attention(q, kc, vc, meta, HEAD_DIM ** -0.5), args.reps)
        print(f"{label:<44} C {t_c * 1e3:7.3f} ms ({flop / t_c / 1e9:5.1f} GFLOP/s) | torch {t_t * 1e3:7.3f} ms "
              f"({flop / t_t / 1e9:5.1f} GFLOP/s) | C {t_t / t_c:5.2f}x", flush=True)
        if meta.num_decodes == 0 and prefill_amx.supports(q, kc):
            out = torch.empty_like(q)
            t_p = _time(lambda: cpu_prefill.cpu_prefill_attention(q, kc, vc, meta, HEAD_DIM ** -0.5, out), args.reps)
            t_a = _time(lambda: prefill_amx.amx_prefill_attention(q, kc, vc, meta, HEAD_DIM ** -0.5, out), args.reps)
            print(f"{'':<44} AMX {t_a * 1e3:7.3f} ms ({flop / t_a / 1e9:5.1f} GFLOP/s) | prefill.c {t_p * 1e3:7.3f} ms "
                  f"({flop / t_p / 1e9:5.1f} GFLOP/s) | AMX {t_p / t_a:5.2f}x prefill.c", flush=True)


if __name__ == "__main__":
    main()
