"""LoRA shrink/expand kernels vs the torch path (`LoRABatch`) and the stacked-layout references."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0 --no-deps)")

from loraplex.engine.kernels.triton.lora import (  # noqa: E402
    StackedLoRAWeights,
    TritonLoRABatch,
    lora_expand,
    lora_shrink,
    reference_lora_expand,
    reference_lora_shrink,
    row_tiles,
)
from loraplex.engine.lora import GROUPS, pack_adapter  # noqa: E402
from loraplex.engine.lora.torch_backend import LoRABatch  # noqa: E402
from tests.engine.kernels.kernel_cases import llama_shapes, random_adapter, random_epilogues  # noqa: E402

# A small Llama: hidden 64, 4 heads x 16, 2 KV heads, intermediate 96 (not a multiple of
# the 64-column expand tile), 2 layers.
HIDDEN, Q, KV, INTER, LAYERS = 64, 64, 32, 96, 2
OUT, IN, GROUP_IN = llama_shapes(HIDDEN, Q, KV, INTER)
ALL = tuple(OUT)
# Heterogeneous ranks 1..64 with partial targets and per-module ranks (as rank_pattern gives).
ADAPTERS = [
    {m: 1 for m in ALL},
    {"q_proj": 64, "v_proj": 64, "down_proj": 64},
    {"o_proj": 8, "gate_proj": 8},
    {m: 33 for m in ALL} | {"k_proj": 5, "up_proj": 17},
    {"q_proj": 16},
]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
SEGMENTS = [
    # decode-style: one row per adapter, base rows (2, 5, 6) between them
    [(0, 1, 0), (1, 2, 1), (3, 4, 2), (4, 5, 3), (7, 8, 4)],
    # prefill-style: several row tiles per segment, lengths 1 and 63..70, rows 20..24 base
    [(0, 20, 1), (20, 21, 3), (25, 95, 0), (95, 96, 2), (96, 159, 4)],
]


def _setup(dtype):
    packed = [pack_adapter(random_adapter(r, IN, OUT, LAYERS, seed=i + 1), OUT, LAYERS, dtype, torch.device("cpu"))
              for i, r in enumerate(ADAPTERS)]
    stacked = StackedLoRAWeights(len(ADAPTERS) + 1, LAYERS, GROUP_IN, OUT, 64, dtype, "cpu")
    for slot, p in enumerate(packed):
        stacked.set_slot(slot, p)
    return packed, stacked


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def adapters(request):
    return request.param, *_setup(request.param)


@pytest.mark.parametrize("segments", SEGMENTS, ids=["decode", "prefill"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_apply_matches_torch_path(adapters, segments, group):
    dtype, packed, stacked = adapters
    gen = torch.Generator().manual_seed(7)
    T = segments[-1][1] + 2
    N = sum(OUT[m] for m in GROUPS[group])
    x = torch.randn(T, GROUP_IN[group], generator=gen).to(dtype)
    out = torch.randn(T, N, generator=gen).to(dtype)
    expect = out.clone()
    LoRABatch(packed, segments).apply(1, group, x, expect)
    got = out.clone()
    batch = stacked.batch(segments)
    assert isinstance(batch, TritonLoRABatch)
    batch.apply(1, group, x, got)
    torch.testing.assert_close(got.float(), expect.float(), **TOL[dtype])
    base = torch.ones(T, dtype=torch.bool)
    for start, end, _ in segments:
        base[start:end] = False
    assert torch.equal(got[base], out[base]), "rows of base-model requests were touched"
    assert not torch.equal(got, out), "no delta was applied"


def test_no_adapter_batch_is_a_no_op():
    _, stacked = _setup(torch.float32)
    assert stacked.batch([]) is None
    batch = TritonLoRABatch(stacked, [])
    out = torch.randn(4, Q + 2 * KV)
    before = out.clone()
    batch.apply(0, "qkv", torch.randn(4, HIDDEN), out)
    assert torch.equal(out, before)


def test_untargeted_group_is_skipped():
    _, stacked = _setup(torch.float32)
    out = torch.randn(3, HIDDEN)
    before = out.clone()
    stacked.batch([(0, 3, 4)]).apply(0, "o", torch.randn(3, Q), out)  # adapter 4 targets q_proj only
    assert torch.equal(out, before)


def test_set_slot_replaces_everything():
    packed, stacked = _setup(torch.float32)
    stacked.set_slot(0, packed[4])  # rank-1-everywhere replaced by q_proj only
    for g in GROUPS:
        for layer in range(LAYERS):
            assert stacked.host_rank[g][layer][0] == (16 if g == "qkv" else 0)
    assert stacked.ranks["qkv"][:, 0].tolist() == [[16, 0, 0]] * LAYERS
    assert stacked.a["down"][:, 0].abs().sum() == 0 and stacked.b["gate_up"][:, 0].abs().sum() == 0
    x, out = torch.randn(2, HIDDEN), torch.zeros(2, Q + 2 * KV)
    expect = out.clone()
    LoRABatch(packed, [(0, 2, 4)]).apply(0, "qkv", x, expect)
    stacked.batch([(0, 2, 0)]).apply(0, "qkv", x, out)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("block_m", [16, 64])
def test_shrink_and_expand_kernels(split_k, block_m):
    _, stacked = _setup(torch.float32)
    segments = SEGMENTS[1]
    T = segments[-1][1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, INTER, generator=gen)
    a, b, ranks = stacked.a["down"][0], stacked.b["down"][0], stacked.ranks["down"][0]
    tiles = row_tiles(segments, block_m, "cpu")
    s = lora_shrink(x, a, ranks, tiles, block_m, 64, split_k=split_k, block_k=32)
    ref = reference_lora_shrink(x, a, ranks, segments)
    for start, end, slot in segments:  # only rows in segments and ranks below each rank are defined
        r = int(ranks[slot, 0])
        torch.testing.assert_close(s[start:end, 0, :r], ref[start:end, 0, :r], atol=1e-5, rtol=1e-5)
    out = torch.randn(T, HIDDEN, generator=gen)
    expect = out.clone()
    reference_lora_expand(ref, b, ranks, [HIDDEN], segments, expect)
    lora_expand(s, b, ranks, tiles, stacked.col_tiles["down"], out, block_m, stacked.BLOCK_N)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_launchers_reject_bad_inputs():
    _, stacked = _setup(torch.float32)
    tiles = row_tiles([(0, 2, 0)], 16, "cpu")
    a, ranks = stacked.a["qkv"][0], stacked.ranks["qkv"][0]
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(2, HIDDEN).half(), a, ranks, tiles, 16, 8)  # dtype
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(2, HIDDEN + 1), a, ranks, tiles, 16, 8)  # in features
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(2, HIDDEN), a, ranks, tiles, 8, 8)  # tile below the tl.dot minimum
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(2, HIDDEN), a, ranks, tiles, 16, 65)  # rank above the stacked maximum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("segments", SEGMENTS, ids=["decode", "prefill"])
def test_epilogues_fused_in_expand_match_torch_path(dtype, segments):
    """DoRA's rescale and lora_bias's shift (lora/epilogue.py), fused into the expand
    kernel, give what the torch path's per-segment epilogue gives; base rows untouched."""
    kinds = {0: (True, True), 1: (True, False), 3: (False, True)}  # slots 2 and 4 plain
    packed = []
    for i, r in enumerate(ADAPTERS):
        adapter = random_adapter(r, IN, OUT, LAYERS, seed=i + 1)
        epi = random_epilogues(adapter, i, *kinds[i]) if i in kinds else None
        packed.append(pack_adapter(adapter, OUT, LAYERS, dtype, torch.device("cpu"), epi))
    stacked = StackedLoRAWeights(len(ADAPTERS) + 1, LAYERS, GROUP_IN, OUT, 64, dtype, "cpu")
    for slot, p in enumerate(packed):
        stacked.set_slot(slot, p)
    assert stacked.epilogues.flags_t["qkv"][:, :len(ADAPTERS)].tolist() == [[1, 1, 0, 1, 0]] * LAYERS
    gen = torch.Generator().manual_seed(9)
    T = segments[-1][1] + 2
    for group in GROUPS:
        x = torch.randn(T, GROUP_IN[group], generator=gen).to(dtype)
        out = torch.randn(T, sum(OUT[m] for m in GROUPS[group]), generator=gen).to(dtype)
        expect, got = out.clone(), out.clone()
        LoRABatch(packed, segments).apply(1, group, x, expect)
        batch = stacked.batch(segments)
        assert batch.epilogue
        batch.apply(1, group, x, got)
        torch.testing.assert_close(got.float(), expect.float(), **TOL[dtype], msg=lambda m: f"{group}: {m}")
        base = torch.ones(T, dtype=torch.bool)
        for start, end, _ in segments:
            base[start:end] = False
        assert torch.equal(got[base], out[base]), "rows of base-model requests were touched"


def test_expand_kernel_epilogue_matches_reference():
    _, stacked = _setup(torch.float32)
    segments = SEGMENTS[1]
    T = segments[-1][1]
    gen = torch.Generator().manual_seed(4)
    b, ranks = stacked.b["qkv"][0], stacked.ranks["qkv"][0]
    S, N = b.shape[0], b.shape[2]
    s = torch.randn(T, 3, 64, generator=gen)
    flags = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int32)
    epilogue = (flags, 1 + 0.2 * torch.randn(S, N, generator=gen), torch.randn(S, N, generator=gen))
    out = torch.randn(T, N, generator=gen)
    expect = out.clone()
    reference_lora_expand(s, b, ranks, stacked.widths["qkv"], segments, expect, epilogue)
    lora_expand(s, b, ranks, row_tiles(segments, 16, "cpu"), stacked.col_tiles["qkv"], out, 16, stacked.BLOCK_N,
                epilogue)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError):  # the epilogue's maps are fp32
        lora_expand(s, b, ranks, row_tiles(segments, 16, "cpu"), stacked.col_tiles["qkv"], out, 16,
                    stacked.BLOCK_N, (flags, epilogue[1].half(), epilogue[2].half()))
