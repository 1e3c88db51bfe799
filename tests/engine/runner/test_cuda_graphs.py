"""CUDA-graph decode: capture widths and the padding policy (no GPU), the forward a graph
captures run eagerly over padded static buffers (Triton's interpreter on CPU), and the
capture and replay themselves (only where a GPU is present)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# As tests/engine/kernels/conftest.py: the interpreter must be on before the kernel modules load.
os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex.engine.runner.cuda_graphs import (  # noqa: E402
    MAX_GRAPH_WIDTH, DecodeInputs, GraphPolicy, LlamaDecodeForward, capture_widths,
)

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("max_num_seqs, expect", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (128, [1, 2, 4] + list(range(8, 129, 8))),
])
def test_capture_widths(max_num_seqs, expect):
    assert capture_widths(max_num_seqs) == expect


def test_capture_widths_stop_at_the_cap():
    widths = capture_widths(4096)
    assert widths[-1] == MAX_GRAPH_WIDTH and len(widths) == 3 + MAX_GRAPH_WIDTH // 8
    assert capture_widths(100, max_width=40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("seqs, width", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (89, 96), (97, 100), (100, 100)])
def test_a_decode_step_pads_to_the_next_captured_width(seqs, width):
    policy = GraphPolicy.build(100, "cuda", "triton")
    assert policy.width_for(seqs, seqs) == width


def test_eager_fallbacks():
    policy = GraphPolicy.build(32, "cuda:1", "triton")
    assert policy.enabled and policy.widths[-1] == 32
    assert policy.width_for(40, 8) is None  # a prefill chunk shares the step
    assert policy.width_for(33, 33) is None  # wider than the widest graph
    assert policy.width_for(0, 0) is None
    for off in (GraphPolicy.build(32, "cuda", "triton", enforce_eager=True), GraphPolicy.build(32, "cpu", "triton"),
                GraphPolicy.build(32, "cuda", "torch")):
        assert not off.enabled and off.width_for(4, 4) is None


def _step(ids, ctx, tables, slots) -> DecodeInputs:
    """The runner's decode step (DecodeInputs.from_rows), block size 8."""
    return DecodeInputs.from_rows(list(zip(ids, [c - 1 for c in ctx], tables, slots)), 8)


def test_a_step_from_rows_matches_the_ragged_metadata():
    from loraplex.engine.kernels.torch.attention import build_ragged_metadata

    ctx, tables = [3, 17, 24], [[10, 4], [11, 12, 13], [14, 15, 16, 17]]  # tables may run past the context
    step = _step([11, 12, 13], ctx, tables, [-1, 0, 2])
    meta = build_ragged_metadata([(c - 1, 1, t[:-(-c // 8)]) for c, t in zip(ctx, tables)], 8, torch.float32)
    assert step.slot_mapping.tolist() == meta.slot_mapping.tolist() == [10 * 8 + 2, 13 * 8 + 0, 16 * 8 + 7]
    assert step.context_lens.tolist() == meta.seq_lens.tolist() == ctx
    assert step.block_tables.tolist() == meta.block_tables.tolist()
    assert step.query_start_loc.tolist() == meta.query_start_loc.tolist() == [0, 1, 2, 3]
    assert step.adapter_slots.dtype == torch.int32 and step.adapter_slots.tolist() == [-1, 0, 2]


def test_stage_fills_rows_and_makes_padding_inert():
    buf = DecodeInputs.allocate(8, 6, "cpu")
    buf.stage(_step([5, 6, 7, 8, 9, 10], [40, 9, 9, 9, 9, 9], [[1, 2, 3, 4, 5], [6, 7]] + [[8, 9]] * 4,
                    [0, 1, 1, 2, 2, -1]), 8)
    step = _step([11, 12, 13], [3, 17, 24], [[10], [11, 12, 13], [14, 15, 0]], [-1, 0, 2])
    buf.stage(step, 4)
    v = buf.view(4)
    assert v.width == 4 and v.query_start_loc.tolist() == [0, 1, 2, 3, 4] and v.block_tables.shape == (4, 6)
    assert v.input_ids.tolist() == [11, 12, 13, 0] and v.positions.tolist() == [2, 16, 23, 0]
    assert v.context_lens.tolist() == [3, 17, 24, 1] and v.adapter_slots.tolist() == [-1, 0, 2, -1]
    assert v.slot_mapping.tolist()[:3] == step.slot_mapping.tolist() and v.slot_mapping[3] == -1
    assert v.block_tables[:3, :3].tolist() == [[10, 0, 0], [11, 12, 13], [14, 15, 0]]
    assert v.block_tables[0, 3:].tolist() == [4, 5, 0]  # stale, yet valid block ids, beyond the context


@pytest.fixture(scope="module")
def decode_setup(tiny_llama_dir):
    pytest.importorskip("triton", reason="Triton is not installed")
    from loraplex.engine.kernels.triton.lora import StackedLoRAWeights
    from loraplex.engine.kernels.triton.kv_write import triton_write_kv
    from loraplex.engine.kernels.triton.paged_attention import triton_paged_attention
    from loraplex.engine.checkpoint import ModelArch, load_state_dict
    from loraplex.engine.lora import pack_adapter
    from loraplex.engine.runner.memory_budget import ModelShape
    from loraplex.engine.models.llama import LlamaModel

    arch = ModelArch.from_dir(tiny_llama_dir)
    model = LlamaModel(arch)
    model.load_weights(load_state_dict(tiny_llama_dir, torch.float32))
    model.eval().set_attention_ops(triton_write_kv, triton_paged_attention)
    stacks = StackedLoRAWeights(3, arch.num_layers, *ModelShape.from_arch(arch).lora_stack_sizes(), 16, torch.float32,
                                "cpu")
    gen = torch.Generator().manual_seed(0)
    sizes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
             "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    for slot, (rank, mods) in enumerate([(8, sizes), (16, ("q_proj", "down_proj")), (4, sizes)]):
        w = {(layer, m): SimpleNamespace(a=torch.randn(rank, sizes[m][0], generator=gen) * 0.2,
                                         b=torch.randn(sizes[m][1], rank, generator=gen) * 0.2, scale=1.5, rank=rank)
             for layer in range(arch.num_layers) for m in mods}
        # Slot 2 is DoRA-like (lora/epilogue.py): the captured forward reads its flag on the device.
        epi = {k: (1 + 0.2 * torch.randn(sizes[k[1]][1], generator=gen), torch.randn(sizes[k[1]][1], generator=gen))
               for k in w} if slot == 2 else None
        stacks.set_slot(slot, pack_adapter(SimpleNamespace(weights=w), {m: o for m, (_, o) in sizes.items()},
                                           arch.num_layers, torch.float32, "cpu", epi))
    kv = [(torch.randn(arch.num_kv_heads, 16 * 8, arch.head_dim, generator=gen),
           torch.randn(arch.num_kv_heads, 16 * 8, arch.head_dim, generator=gen)) for _ in range(arch.num_layers)]
    return model, stacks, kv


@torch.inference_mode()
def test_padded_static_decode_equals_the_eager_step(decode_setup):
    """What a graph captures (LlamaDecodeForward over a padded view of the static buffers)
    computes the eager step's rows, and its padding rows write no KV."""
    from loraplex.engine.lora import segments_of

    model, stacks, kv = decode_setup
    ctx, tables, slots = [5, 17, 30, 9], [[3], [7, 1, 12], [2, 9, 4, 11], [5, 6]], [-1, 0, 2, 1]
    step = _step([101, 202, 303, 404], ctx, tables, slots)
    from loraplex.engine.kernels.torch.attention import build_ragged_metadata

    meta = build_ragged_metadata([(c - 1, 1, t) for c, t in zip(ctx, tables)], 8, torch.float32)
    kv_ref = [(k.clone(), v.clone()) for k, v in kv]
    lora = stacks.batch(segments_of([(1, s) for s in slots]))
    expect = model(step.input_ids, step.positions, meta, kv_ref, lora)

    buf = DecodeInputs.allocate(16, 8, "cpu")
    buf.stage(_step([7] * 12, [60] * 12, [[13, 14, 15, 0, 1, 2, 3, 8]] * 12, [1] * 12), 16)  # an older, wider step
    buf.stage(step, 8)
    kv_got = [(k.clone(), v.clone()) for k, v in kv]
    got = LlamaDecodeForward(model, kv_got, 8, stacks)(buf.view(8))
    assert got.shape == (8, expect.shape[1])
    torch.testing.assert_close(got[:4], expect, rtol=1e-5, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(kv_ref, kv_got):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    touched = set(step.slot_mapping.tolist())
    untouched = [s for s in range(kv[0][0].shape[1]) if s not in touched]
    assert torch.equal(kv_got[0][0][:, untouched], kv[0][0][:, untouched])


_GPU_SCRIPT = """
import torch
from loraplex.engine.runner.cuda_graphs import CUDAGraphRunner, DecodeInputs, GraphPolicy, LlamaDecodeForward
from loraplex.engine.kernels.triton.kv_write import triton_write_kv
from loraplex.engine.kernels.triton.paged_attention import triton_paged_attention
from loraplex.engine.checkpoint import ModelArch, load_state_dict
from loraplex.engine.models.llama import LlamaModel
import sys
d, dev = sys.argv[1], torch.device("cuda")
arch = ModelArch.from_dir(d)
model = LlamaModel(arch)
model.load_weights(load_state_dict(d, torch.float32))
model = model.to(dev).eval()
model.set_attention_ops(triton_write_kv, triton_paged_attention)
kv = [(torch.randn(arch.num_kv_heads, 512, arch.head_dim, device=dev),
       torch.randn(arch.num_kv_heads, 512, arch.head_dim, device=dev)) for _ in range(arch.num_layers)]
fwd = LlamaDecodeForward(model, kv, 16)
runner = CUDAGraphRunner(fwd, GraphPolicy.build(12, dev, "triton"), 8, dev)
with torch.inference_mode():
    fwd(runner.buffers.view(1))
    runner.capture()
    for n in (1, 3, 9, 12):
        step = DecodeInputs.allocate(n, 8, dev)
        step.input_ids.random_(100, 1000)
        step.context_lens.random_(1, 100)
        step.positions.copy_(step.context_lens - 1)
        step.block_tables.copy_(torch.randperm(32, device=dev)[:8].repeat(n, 1))
        pos = step.positions
        step.slot_mapping.copy_(step.block_tables.gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16)
        step.slot_mapping[1:].fill_(-1)  # one writer: rows share blocks
        got = runner.run(step).clone()
        want = fwd(step)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("graphs ok", sorted(runner.graphs))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
def test_capture_and_replay_on_a_gpu(tiny_llama_dir):
    env = dict(os.environ, TRITON_INTERPRET="0")  # compiled kernels: the interpreter cannot be captured
    proc = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, str(tiny_llama_dir)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "graphs ok [1, 2, 4, 8, 12]" in proc.stdout
