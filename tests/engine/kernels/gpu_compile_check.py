"""Compile every kernel, exactly as its launcher launches it, for NVIDIA GPUs: no GPU needed.

Run as a script (the test runs it in a subprocess, because the interpreter must be off):
    TRITON_INTERPRET=0 python tests/engine/kernels/gpu_compile_check.py [sm ...]
The launchers are called on CPU tensors with the kernels replaced by recorders; each
recorded launch (arguments, constexprs, num_warps/num_stages) is then compiled by
Triton down to a cubin for each target (default sm_90 = H100/H200 and sm_80 = A100).
The interpreter accepts code a GPU compiler rejects; this catches that class of error.
"""
from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loraplex.engine.kernels.triton import kv_write, paged_attention
from loraplex.engine.kernels.triton import lora as lora_kernels  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


class Recorder:
    def __init__(self, fn):
        self.fn = fn
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((args, kwargs))
        return launch


def _signature(fn, args, kwargs):
    names = fn.arg_names
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, constexprs = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: {type(v)}")
    return signature, constexprs, {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}


def record_launches() -> list[tuple[str, object, tuple, dict]]:
    from loraplex.engine.lora import pack_adapter
    from loraplex.engine.kernels.torch.attention import build_ragged_metadata
    from tests.engine.kernels.kernel_cases import paged_batch, random_adapter

    recs = {}
    for mod, name in ((paged_attention, "_paged_attention_kernel"), (kv_write, "_kv_write_kernel"),
                      (lora_kernels, "_lora_shrink_kernel"), (lora_kernels, "_lora_expand_kernel")):
        recs[name] = Recorder(getattr(mod, name))
        setattr(mod, name, recs[name])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for lens in ([(5, 1), (40, 1)], [(5, 1), (0, 30)]):  # decode-only and mixed configs
            q, kc, vc, meta, _ = paged_batch(lens, 16, 9, 3, 64, dtype, build=build_ragged_metadata)
            paged_attention.triton_paged_attention(q, kc, vc, meta, 0.125)
        k = torch.zeros(4, 3, 64, dtype=dtype)
        kv_write.triton_write_kv(kc, vc, k, k, torch.arange(4))
    hidden, inter = 64, 96
    out = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": inter, "up_proj": inter,
           "down_proj": hidden}
    inp = {m: hidden for m in out} | {"down_proj": inter}
    for dtype in (torch.float32, torch.bfloat16):
        stacked = lora_kernels.StackedLoRAWeights(2, 1, {"qkv": hidden, "o": 64, "gate_up": hidden, "down": inter},
                                                  out, 64, dtype, "cpu")
        adapter = random_adapter({m: 8 for m in out}, inp, out, 1, seed=0)
        stacked.set_slot(0, pack_adapter(adapter, out, 1, dtype, torch.device("cpu")))
        for segments in ([(0, 1, 0)], [(0, 40, 0)]):
            stacked.batch(segments).apply(0, "qkv", torch.zeros(40, hidden, dtype=dtype),
                                          torch.zeros(40, 128, dtype=dtype))
        tiles = lora_kernels.row_tiles([(0, 2, 0)], 16, "cpu")
        lora_kernels.lora_shrink(torch.zeros(2, inter, dtype=dtype), stacked.a["down"][0], stacked.ranks["down"][0],
                                 tiles, 16, 8, split_k=4)
    return [(name, r.fn, a, kw) for name, r in recs.items() for a, kw in r.launches]


def main(archs: list[int]) -> int:
    launches = record_launches()
    seen, failures = set(), 0
    for name, fn, args, kwargs in launches:
        signature, constexprs, options = _signature(fn, args, kwargs)
        key = (name, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        for arch in archs:
            t0 = time.perf_counter()
            try:
                k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                   options=options)
                print(f"ok   sm_{arch} {name} {constexprs} {options} shared={k.metadata.shared} "
                      f"({time.perf_counter() - t0:.1f}s)", flush=True)
            except Exception as exc:  # report every failure, then fail
                failures += 1
                print(f"FAIL sm_{arch} {name} {constexprs} {options}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(seen)} launch configurations x {len(archs)} targets, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90, 80]))
