"""The C bf16 GEMMs (engine/kernels/cpu/gemm.c, dpbf16.c, amx.c) against torch on SmolLM2's projection shapes.

One run, same threads, same weights: for each row count (decode widths to prefill
chunks) it times torch's bf16 `F.linear`, oneDNN's fp32 matmul on the weight widened once
(`WideLinear`, what the engine measures against the C kernel where bf16 is emulated),
and the C kernel on the packed weight, over enough
distinct weights that they stream from memory as in a real step. Prints each
GFLOP/s and the C kernel's ratio to each.

On CPUs with AVX-512 it also times dpbf16.c (what the engine runs there: vdpbf16ps with
AVX512-BF16, two FMAs on widened halves without) against oneDNN's pre-packed bf16
weights (engine/kernels/torch/linear.py) and the widened fp32 weights;
on CPUs with AMX also the tile kernel (amx.c, what the engine runs there from
amx.FROM_ROWS rows) on the same packed weights, as a ratio to both.

    python benchmarks/bench_kernels_cpu.py               # 2 threads
    python benchmarks/bench_kernels_cpu.py --threads 1 --rows 1,16
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from loraplex.engine.kernels.torch.linear import PackedLinear, WideLinear, packing_supported, widening_supported
from loraplex.engine.kernels.cpu import amx as cpu_amx, dpbf16 as cpu_dpbf16, gemm as cpu_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(fn, count: int, reps: int) -> float:
    for i in range(count):  # warm: oneDNN primitives, packed copies
        fn(i)
    start = time.perf_counter()
    for _ in range(reps):
        for i in range(count):
            fn(i)
    return (time.perf_counter() - start) / (reps * count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_gemm.load_library() is None:
        raise SystemExit("the C kernel could not be built (no C compiler?)")
    # 30 layers' worth of one projection: more than the L3 cache holds.
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k).bfloat16() for _ in range(30)]
        packed = [cpu_gemm.pack_weight(w) for w in ws]
        dp = onednn = None
        wide = [WideLinear(w, None) for w in ws] if widening_supported(torch.device("cpu"), torch.bfloat16) else None
        if cpu_dpbf16.supported() and packing_supported(torch.device("cpu"), torch.bfloat16):
            dp, onednn = [cpu_dpbf16.pack_weight(w) for w in ws], [PackedLinear(w, None) for w in ws]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            flop = 2 * rows * n * k
            t_c = _time(lambda i: cpu_gemm.cpu_gemm_bf16(x, packed[i], n), len(ws), args.reps)
            t_bf16 = _time(lambda i: F.linear(x, ws[i]), len(ws), 1 if rows > 64 else args.reps)
            t_f32 = _time((lambda i: wide[i](x)) if wide else (lambda i: F.linear(x.float(), ws[i].float()).bfloat16()),
                          len(ws), args.reps)
            print(f"{name:>8} {n:>5}x{k:<5} rows {rows:>5}: C {flop / t_c / 1e9:6.1f} GFLOP/s | torch bf16 "
                  f"{flop / t_bf16 / 1e9:6.1f} ({t_bf16 / t_c:5.2f}x) | fp32 widened {flop / t_f32 / 1e9:6.1f} "
                  f"({t_f32 / t_c:5.2f}x)", flush=True)
            if dp is not None:
                t_dp = _time(lambda i: cpu_dpbf16.dpbf16_linear(x, dp[i], n), len(ws), args.reps)
                t_dnn = _time(lambda i: onednn[i](x), len(ws), args.reps)
                label = "AVX512-BF16 C" if cpu_dpbf16.native() else "AVX-512F C"
                print(f"{'':>8} {'':>11} {'':>10}  {label} {flop / t_dp / 1e9:6.1f} GFLOP/s "
                      f"({n * k * 2 / t_dp / 1e9:5.1f} GB/s of weights) | "
                      f"oneDNN packed bf16 {flop / t_dnn / 1e9:6.1f} ({t_dnn / t_dp:5.2f}x) | "
                      f"fp32 widened ({t_f32 / t_dp:5.2f}x) | C above ({t_c / t_dp:5.2f}x)", flush=True)
                if cpu_amx.supported() and k % cpu_amx.K_STEP == 0:
                    t_amx = _time(lambda i: cpu_amx.amx_linear(x, dp[i], n), len(ws), args.reps)
                    print(f"{'':>8} {'':>11} {'':>10}  AMX C {flop / t_amx / 1e9:6.1f} GFLOP/s "
                          f"({n * k * 2 / t_amx / 1e9:5.1f} GB/s of weights) | {t_dp / t_amx:5.2f}x AVX512-BF16 C | "
                          f"{t_dnn / t_amx:5.2f}x oneDNN packed bf16", flush=True)


if __name__ == "__main__":
    main()
