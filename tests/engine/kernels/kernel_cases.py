"""Shared builders for the kernel tests: ragged paged batches and random adapters."""
from __future__ import annotations

import platform
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loraplex.engine.kernels.cpu.metadata import build_cpu_metadata
from loraplex.engine.kernels.torch.attention import prefill_attention, reference_attention


def paged_batch(lens: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3, build=build_cpu_metadata):
    """`lens`: (cached prefix, new query rows) per sequence, decodes first (the engine's order).

    Returns q, k_cache, v_cache (the step's K/V already written), metadata (by `build`:
    the C kernels' form by default, which the torch path also reads), and the
    `seqs` list `reference_attention` takes. Blocks are shuffled, so a sequence's
    blocks are scattered through the cache as in a running engine."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // block_size) for s, n in lens]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rnd.shuffle(ids)
    seqs, i = [], 0
    for (s, n), nb in zip(lens, need):
        seqs.append((s, n, ids[i:i + nb]))
        i += nb
    shape = (num_kv_heads, num_blocks * block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    T = sum(n for _, n in lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen).to(dtype)
    meta = build(seqs, block_size, dtype)
    return q, k_cache, v_cache, meta, seqs


def llama_shapes(hidden: int, q: int, kv: int, inter: int) -> tuple[dict, dict, dict]:
    """(out features per module, in features per module, input width per LoRA group)."""
    out = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": inter, "up_proj": inter,
           "down_proj": hidden}
    inp = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": q, "gate_proj": hidden,
           "up_proj": hidden, "down_proj": inter}
    return out, inp, {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}


def random_adapter(ranks: dict[str, int], in_sizes: dict[str, int], out_sizes: dict[str, int], num_layers: int,
                   seed: int, scale: float = 0.5):
    """An object shaped like loraplex.adapters' LoRAAdapter, as `pack_adapter` reads it:
    `.weights[(layer, module)]` with `.a [rank, in]`, `.b [out, rank]`, `.scale`, `.rank`."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(num_layers):
        for module, r in ranks.items():
            a = torch.randn(r, in_sizes[module], generator=gen) / in_sizes[module] ** 0.5
            b = torch.randn(out_sizes[module], r, generator=gen) / r ** 0.5
            weights[(layer, module)] = SimpleNamespace(a=a, b=b, scale=scale, rank=r)
    return SimpleNamespace(weights=weights)


# Targets a C kernel is built for besides this CPU's own: each has its own code path
# (AVX-512 with 16 lanes and AVX512-BF16, AVX2 with 8, generic vectors), and a machine
# only ever builds its own; these let one machine test them all.
MARCHES = ["native", "x86-64-v3", "x86-64"]


def _cpu_flags() -> set[str]:
    try:
        return set(next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def use_build(monkeypatch, module, source: str, signatures: dict, march: str) -> None:
    """Make `module.load_library()` return `source` built for `march` (skip where this
    CPU cannot run that target)."""
    from loraplex.engine.kernels.cpu import build as cpu_build

    if march == "native":
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    if march == "x86-64-v3" and not {"avx2", "fma", "bmi2"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if march == "skylake-avx512" and not {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    lib = cpu_build.load(source, signatures, march=march)
    assert lib is not None
    monkeypatch.setattr(module, "load_library", lambda: lib)


def assert_as_accurate_as_sdpa(prefill) -> None:
    """prefill(q, k_cache, v_cache, meta, scale, out), a bf16 prefill kernel, errs no more
    against the fp32 oracle than the torch path's SDPA on two long chunks."""
    q, kc, vc, meta, seqs = paged_batch([(0, 250), (300, 40)], 16, 9, 3, 64, torch.bfloat16, seed=2)
    oracle = reference_attention(q.float(), kc.float(), vc.float(), seqs, 16, 0.125)
    out_kernel, out_torch = torch.empty_like(q), torch.empty_like(q)
    prefill(q, kc, vc, meta, 0.125, out_kernel)
    prefill_attention(q, kc, vc, meta, 0.125, out_torch)
    assert (out_kernel.float() - oracle).abs().max() <= (out_torch.float() - oracle).abs().max()


def same_on_one_and_four_threads(fn) -> None:
    """fn() gives bit-identical results on 1 and 4 threads: work items, however they are
    shared out, each compute their own rows."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            outs.append(fn())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def random_epilogues(adapter, seed: int, dora: bool = True, bias: bool = True) -> dict:
    """Per module of `adapter`: a DoRA-like scale near 1 and/or a bias-like shift, fp32, as
    `lora.epilogue.module_epilogues` returns them (`pack_adapter`'s `epilogues`)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, w in sorted(adapter.weights.items()):
        n = w.b.shape[0]
        out[key] = (1 + 0.2 * torch.randn(n, generator=gen) if dora else None,
                    torch.randn(n, generator=gen) if bias else None)
    return out
