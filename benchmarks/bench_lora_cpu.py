"""Multi-LoRA compute on the CPU: the C LoRA backend (engine/kernels/cpu/lora.c) against the torch one.

One run, same threads, same adapters (rank 8 on all seven projections of SmolLM2's 30
layers, 64 device slots, weights streaming from memory as in a real step). For each
step shape it runs every layer and group of one step through each backend's batch both
ways: the C kernel alone, and the torch path (short segments grouped into padded bmm,
long ones as per-segment matmuls: what runs without a C compiler); prefill steps also
through the "cpu" backend's hybrid, "C+oneDNN" (kernels/cpu/lora_choice.py: the whole
64-row buckets of segments from the crossover measured here for their rank on through
oneDNN, the rest through the C kernel). Prefill steps draw new segment lengths every
repetition, as a server's chunks do (so oneDNN builds primitives for some of them, as it
does while a server warms). Prints the milliseconds of LoRA per step, GFLOP/s of LoRA
arithmetic, the GB/s at which the C kernel reads adapter weights (each piece reads its
adapter's A and B^T once per layer: what bounds decode steps), the C kernel's speed-up
over torch, and the hybrid's over the C kernel and over torch.

    python benchmarks/bench_lora_cpu.py                 # 2 threads
    python benchmarks/bench_lora_cpu.py --threads 1 --rank 64
    python benchmarks/bench_lora_cpu.py --torch-from-rows 64   # the hybrid's crossover forced, every rank
"""
from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch

from loraplex.adapters.peft import LoRAWeight
from loraplex.engine.kernels.cpu import lora as cpu_lora, lora_choice
from loraplex.engine.lora import GROUPS, pack_adapter
from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend
from loraplex.engine.lora.torch_backend import TorchLoRABackend

HIDDEN, Q, KV, INTER, LAYERS, SLOTS = 576, 576, 192, 1536, 30, 64
OUT = {"q_proj": Q, "k_proj": KV, "v_proj": KV, "o_proj": HIDDEN, "gate_proj": INTER, "up_proj": INTER,
       "down_proj": HIDDEN}
IN = {"q_proj": HIDDEN, "k_proj": HIDDEN, "v_proj": HIDDEN, "o_proj": Q, "gate_proj": HIDDEN, "up_proj": HIDDEN,
      "down_proj": INTER}
GROUP_IN = {"qkv": HIDDEN, "o": Q, "gate_up": HIDDEN, "down": INTER}
GROUP_OUT = {g: sum(OUT[m] for m in mods) for g, mods in GROUPS.items()}


def _adapter(rank: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weights = {(layer, m): LoRAWeight(torch.randn(rank, IN[m], generator=gen) / IN[m] ** 0.5,
                                      torch.randn(OUT[m], rank, generator=gen) / rank ** 0.5, 2.0)
               for layer in range(LAYERS) for m in OUT}
    return SimpleNamespace(weights=weights)


def _decode(rows_per_adapter: list[int]) -> list[tuple[int, int, int]]:
    segments, row = [], 0
    for slot, n in enumerate(rows_per_adapter):
        segments.append((row, row + n, slot))
        row += n
    return segments


def _prefill(rng: random.Random, decode_rows: int, chunk: int, prompts: int) -> list[tuple[int, int, int]]:
    """`decode_rows` one-row decodes over the slots, then a `chunk`-token prefill cut at
    random points into `prompts` segments of distinct adapters."""
    segments = [(i, i + 1, i % SLOTS) for i in range(decode_rows)]
    cuts = sorted(rng.sample(range(1, chunk), prompts - 1))
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, chunk])):
        segments.append((decode_rows + a, decode_rows + b, (7 * k + 3) % SLOTS))
    return segments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch-from-rows", type=int, default=None,
                    help="the hybrid's crossover (default: measured, as the cpu backend does)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_lora.load_library() is None:
        raise SystemExit("the C kernel could not be built (no C compiler?)")
    dtype, cpu = torch.bfloat16, torch.device("cpu")
    backends = {c_kernel: (CLoRABackend if c_kernel else TorchLoRABackend)(SLOTS, LAYERS, GROUP_IN, OUT, args.rank,
                                                                            dtype, cpu) for c_kernel in (True, False)}
    for s in range(SLOTS):
        packed = pack_adapter(_adapter(args.rank, s), OUT, LAYERS, dtype, cpu)
        for backend in backends.values():
            backend.set_slot(s, packed)
    rng = random.Random(0)
    shapes = {
        "decode, 16 rows of 16 adapters": lambda: _decode([1] * 16),
        "decode, 64 rows of 64 adapters": lambda: _decode([1] * 64),
        "decode, 64 rows of 32 adapters": lambda: _decode([2] * 32),
        "decode, 64 rows, zipf-like (12, 8, 6, ...)": lambda: _decode([12, 8, 6, 5, 4, 4, 3, 3] + [1] * 19),
        "prefill, 1024-token chunk of 5 prompts + 32 decodes": lambda: _prefill(rng, 32, 1024, 5),
        "prefill, 1024-token chunk of 1 prompt": lambda: _prefill(rng, 0, 1024, 1),
    }
    flop_per_row = 2 * args.rank * sum(IN[m] + OUT[m] for m in OUT)
    bytes_per_piece = args.rank * sum(IN[m] + OUT[m] for m in OUT) * dtype.itemsize * LAYERS
    forced = args.torch_from_rows
    hybrid = lora_choice.Crossovers({1: forced}) if forced else lora_choice.crossovers(dtype)
    print(f"SmolLM2 shapes, {LAYERS} layers, rank {args.rank} on 7 projections, {SLOTS} slots, bf16, "
          f"{args.threads} threads; C+oneDNN: oneDNN from rows by rank {hybrid} "
          f"({'given' if forced else 'measured'}; None: never), "
          f"{hybrid.rows_for(args.rank) if hybrid else None} rows for rank {args.rank}")
    c_backend = backends[True]
    for label, make in shapes.items():
        modes = {"C": (c_backend, None), "torch": (backends[False], None)}
        if label.startswith("prefill"):
            modes["C+oneDNN"] = (c_backend, hybrid)
        times = {mode: _time(backend, found, make, args.reps, flop_per_row, bytes_per_piece)
                 for mode, (backend, found) in modes.items()}
        (t_c, gf_c, gb_c), (t_t, gf_t, _) = times["C"], times["torch"]
        line = (f"{label:<52} C {t_c * 1e3:7.2f} ms ({gf_c:5.1f} GFLOP/s, {gb_c:5.1f} GB/s) "
                f"| torch {t_t * 1e3:7.2f} ms ({gf_t:5.1f} GFLOP/s) | C {t_t / t_c:5.2f}x")
        if "C+oneDNN" in times:
            t_h, gf_h, _ = times["C+oneDNN"]
            line += (f" | C+oneDNN {t_h * 1e3:7.2f} ms ({gf_h:5.1f} GFLOP/s): {t_c / t_h:5.2f}x C, "
                     f"{t_t / t_h:5.2f}x torch")
        print(line, flush=True)


def _time(backend, crossovers: lora_choice.Crossovers | None, make, reps: int, flop_per_row: int,
          bytes_per_piece: int):
    """(seconds per step, GFLOP/s, C kernel's weight GB/s) of `reps` steps of `make()`'s
    segments through `backend` (the C backend with `crossovers`: None, the C kernel only)."""
    if isinstance(backend, CLoRABackend):
        backend.crossovers = crossovers
    dtype = backend.dtype
    total, rows, weight_bytes = 0.0, 0, 0
    for rep in range(reps + 1):  # the first is a warm-up
        segments = make()
        n = segments[-1][1]
        x = {g: torch.randn(n, GROUP_IN[g]).to(dtype) for g in GROUPS}
        out = {g: torch.randn(n, GROUP_OUT[g]).to(dtype) for g in GROUPS}
        start = time.perf_counter()
        batch = backend.batch(segments)
        for layer in range(LAYERS):
            for g in GROUPS:
                batch.apply(layer, g, x[g], out[g])
        if rep:
            total += time.perf_counter() - start
            rows += sum(e - s for s, e, _ in segments)
            weight_bytes += len(cpu_lora.pieces(segments)) * bytes_per_piece
    return total / reps, flop_per_row * LAYERS * rows / total / 1e9, weight_bytes / total / 1e9


if __name__ == "__main__":
    main()
