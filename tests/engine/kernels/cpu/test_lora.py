"""The C multi-LoRA kernel: shapes its register blocks do not divide, pieces of long
segments, and what its launcher refuses.

(Its results are also checked against the per-segment torch loop in tests/engine/lora/test_backends.py,
which runs every case through this kernel and through the grouped bmm path.)"""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import lora as cpu_lora
from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend
from loraplex.engine.kernels.cpu.lora_choice import Crossovers
from loraplex.engine.lora import GROUPS, pack_adapter
from loraplex.engine.lora.stacks import rank_pairs
from loraplex.engine.lora.torch_backend import GroupedLoRABatch, LoRABatch
from tests.engine.kernels.kernel_cases import MARCHES, llama_shapes, random_adapter, random_epilogues, use_build

pytestmark = pytest.mark.skipif(cpu_lora.load_library() is None, reason="no C compiler to build the CPU kernels")


@pytest.fixture(params=MARCHES)
def code_path(request, monkeypatch) -> str:
    """The kernel built for this CPU, and its AVX2 and plain x86-64 builds where this CPU
    runs them (vdpbf16ps / 16 lanes, 8 lanes with vpmovzxwd, generic vectors)."""
    use_build(monkeypatch, cpu_lora, "lora.c", {f"lora_segments_{t}": cpu_lora._ARGTYPES for t in ("bf16", "f32")},
              request.param)
    return request.param


def _args(rows=4, dtype=torch.float32, k=8, r=3, w=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    out = torch.randn(rows, w, generator=gen).to(dtype)
    # 1 layer, 2 slots; scaled so deltas stay O(1) whatever k and r, like out
    a = (torch.randn(1, 2, r, k, generator=gen) / k**0.5).to(dtype)
    bt = (torch.randn(1, 2, r, w, generator=gen) / r**0.5).to(dtype)
    mods, kernel_bt = _modules(bt)
    ranks = torch.full((1, 2, 1), r, dtype=torch.int32)
    segs = torch.tensor([[0, rows, 1]], dtype=torch.int32)
    return x, out, segs, a, mods, ranks, bt, kernel_bt


def _modules(bt):
    """One module's `mods` row over B^T [layers, slots, r, w] as the kernel reads it (bf16:
    in rank pairs), and that tensor (the row holds its address)."""
    if bt.dtype == torch.bfloat16:
        bt = torch.stack([torch.stack([rank_pairs(b) for b in per_layer]) for per_layer in bt])
    mods = torch.tensor([[0, bt.shape[2], 0, bt.shape[3], bt.data_ptr(), bt.stride(0)]], dtype=torch.int64)
    return mods, bt


def _expected(x, out, a, bt):
    # fp32 arithmetic on the same (bf16) values, one rounding at the end, as the kernel does
    return (out.float() + x.float() @ a[0, 1].float().T @ bt[0, 1].float()).to(out.dtype)


def test_one_segment_is_x_a_b():
    x, out, segs, a, mods, ranks, bt, _kbt = _args()
    expected = _expected(x, out, a, bt)
    cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 0)
    torch.testing.assert_close(out, expected)


# Rows, input width, rank and output width around the register blocks (4 rows, 2-4
# ranks, 16 lanes, 32 bf16 pairs, 64-column expand blocks): full blocks, remainders,
# and sizes below one block, so every tail path runs.
SHAPES = [(1, 32, 1, 16), (3, 48, 5, 70), (4, 64, 8, 64), (7, 576, 8, 192), (33, 96, 16, 130),
          (64, 1536, 64, 576), (17, 40, 3, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,k,r,w", SHAPES)
def test_blocks_and_tails_match_fp32(dtype, rows, k, r, w, code_path):
    x, out, segs, a, mods, ranks, bt, _kbt = _args(rows, dtype, k, r, w, seed=rows + k)
    expected = _expected(x, out, a, bt)
    cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, expected, **tol)


def test_long_segment_in_pieces_equals_one_pass(code_path):
    """A 150-row prefill segment cut into pieces gives what 64-row pieces of it give,
    rows of other slots (slot 0 here: rank 0) are untouched."""
    x, out, _, a, mods, ranks, bt, _kbt = _args(rows=160, k=64, r=8, w=64)
    ranks[0, 0] = 0
    segments = [(0, 5, 0), (5, 155, 1), (155, 160, 0)]
    expected = _expected(x, out, a, bt)
    expected[:5], expected[155:] = out[:5], out[155:]
    for rows in (cpu_lora.PIECE_ROWS, cpu_lora.MAX_ROWS, 7):
        pieces = cpu_lora.pieces(segments, rows)
        assert pieces[:, 1].sub(pieces[:, 0]).max() <= rows and pieces[:, 1].sub(pieces[:, 0]).sum() == 160
        got = out.clone()
        cpu_lora.cpu_lora_segments(x, got, pieces, a, mods, ranks, 0)
        torch.testing.assert_close(got, expected)
        assert torch.equal(got[:5], out[:5]) and torch.equal(got[155:], out[155:])


def test_rejects_wrong_dtypes_and_layouts():
    x, out, segs, a, mods, ranks, *_ = _args()
    with pytest.raises(AssertionError):
        cpu_lora.cpu_lora_segments(x.double(), out, segs, a, mods, ranks, 0)
    with pytest.raises(AssertionError):
        cpu_lora.cpu_lora_segments(x, out, segs.long(), a, mods, ranks, 0)
    with pytest.raises(AssertionError):
        cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 1)  # no such layer
    with pytest.raises(AssertionError):
        cpu_lora.pieces([(0, 100, 1)], cpu_lora.MAX_ROWS + 1)


def test_piece_longer_than_the_kernel_takes_is_refused():
    x, out, segs, a, mods, ranks, *_ = _args(rows=cpu_lora.MAX_ROWS + 1)
    before = out.clone()
    with pytest.raises(ValueError, match="refused"):
        cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 0)
    assert torch.equal(out, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flag", [1, 0], ids=["flagged", "unflagged"])
def test_epilogue_rescales_flagged_slots(dtype, flag, code_path):
    """DoRA / lora_bias (lora/epilogue.py): out = round((out + delta) * scale + shift), one
    rounding as the expand stores, on a flagged slot's columns only, at any width and row
    count (register blocks, single rows, vector and column tails)."""
    x, out, segs, a, mods, ranks, bt, _kbt = _args(rows=5, dtype=dtype, k=48, r=5, w=70)
    gen = torch.Generator().manual_seed(1)
    flags = torch.tensor([0, flag], dtype=torch.int32)
    scale, shift = 1 + 0.2 * torch.randn(2, 70, generator=gen), torch.randn(2, 70, generator=gen)
    delta = x.float() @ a[0, 1].float().T @ bt[0, 1].float()
    expected = (((out.float() + delta) * scale[1] + shift[1]) if flag else out.float() + delta).to(dtype)
    cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 0, (flags, scale, shift))
    torch.testing.assert_close(out, expected)
    with pytest.raises(AssertionError):  # the maps are fp32, one row per slot
        cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 0, (flags, scale[:1], shift[:1]))


def test_epilogue_rounds_once(code_path):
    """The epilogue is applied as the expand stores, before the one bf16 rounding (as the
    Triton expand does): values chosen so every fp32 step is exact give exactly the
    correctly rounded round((out + delta) * scale + shift), which rounding out + delta
    first would miss on most elements."""
    gen = torch.Generator().manual_seed(2)
    rows, k, r, w = 9, 48, 5, 70
    x, out, segs, a, mods, ranks, bt, _kbt = _args(rows=rows, dtype=torch.bfloat16, k=k, r=r, w=w)
    for t in (x, a, bt):  # multiples of 1/4 in [-0.5, 0.5]: every product and sum is exact
        t.copy_(torch.randint(-2, 3, t.shape, generator=gen) / 4)
    mods, _kbt = _modules(bt)
    flags = torch.tensor([0, 1], dtype=torch.int32)
    scale = 2.0 ** torch.randint(-1, 2, (2, w), generator=gen).float()  # exact products
    shift = torch.randn(2, w, generator=gen).to(torch.bfloat16).float()
    delta = x.double() @ a[0, 1].double().T @ bt[0, 1].double()
    expected = ((out.double() + delta) * scale[1].double() + shift[1].double()).to(torch.bfloat16)
    twice = ((out.double() + delta).to(torch.bfloat16).double() * scale[1].double() + shift[1].double()
             ).to(torch.bfloat16)
    assert not torch.equal(expected, twice)  # the case tells the two apart
    cpu_lora.cpu_lora_segments(x, out, segs, a, mods, ranks, 0, (flags, scale, shift))
    assert torch.equal(out, expected)


# Odd output widths (vector and column tails), inputs past one dp step of 32 pairs.
P_OUT, P_IN, P_GROUP_IN = llama_shapes(67, 37, 13, 149)


def _loaded(dtype: torch.dtype, rank: int) -> CLoRABackend:
    """The C backend with four adapters: odd ranks beside `rank` (loaded first, so the
    pairs are regrown to it), DoRA and lora_bias epilogues on slots 1 and 3."""
    cpu = torch.device("cpu")
    lora = CLoRABackend(6, 2, P_GROUP_IN, P_OUT, rank, dtype, cpu)
    adapters = [({m: 5 for m in P_OUT} | {"k_proj": 3, "down_proj": 1}, None),
                ({m: rank for m in P_OUT}, (True, True)),
                ({m: rank for m in P_OUT} | {"v_proj": rank - 1}, None),
                ({"q_proj": rank, "up_proj": 7, "down_proj": rank}, (False, True))]
    for slot, (ranks, epi) in enumerate(adapters):
        adapter = random_adapter(ranks, P_IN, P_OUT, 2, seed=slot + 1)
        epilogues = random_epilogues(adapter, slot, *epi) if epi else None
        lora.set_slot(slot, pack_adapter(adapter, P_OUT, 2, dtype, cpu, epilogues))
    assert lora.stacks.pairs == (dtype == torch.bfloat16) and lora.stacks.epilogues.slots == {1, 3}
    return lora


def _activations(rows: int, dtype: torch.dtype, seed: int) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    x = {g: torch.randn(rows, P_GROUP_IN[g], generator=gen).to(dtype) for g in GROUPS}
    out = {g: torch.randn(rows, sum(P_OUT[m] for m in GROUPS[g]), generator=gen).to(dtype) for g in GROUPS}
    return x, out


def _assert_matches_reference(batches, lora, segments, x, out, tol):
    for batch in batches:
        for layer in range(2):
            for g in GROUPS:
                got, want = out[g].clone(), out[g].clone()
                batch.apply(layer, g, x[g], got)
                LoRABatch(lora.packed, segments).apply(layer, g, x[g], want)
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{type(batch).__name__} {layer} {g}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_slot_stacks_through_the_kernel_match_the_reference(dtype, rank, code_path):
    """The C backend's stacks (bf16: B^T in rank pairs) through the kernel give what the
    per-segment torch loop gives: odd ranks beside `rank`, DoRA and lora_bias epilogues,
    decode rows and long prefill segments; the grouped torch path reads the same stacks
    back rank-major."""
    lora = _loaded(dtype, rank)
    lora.crossovers = None  # every segment through the kernel, whatever this CPU measured
    segments = [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 3), (4, 45, 1), (45, 115, 2), (115, 122, 3)]
    x, out = _activations(122, dtype, rank)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    _assert_matches_reference([lora.batch(segments), GroupedLoRABatch(lora.stacks, lora.packed, segments)],
                              lora, segments, x, out, tol)


def test_split_gives_torch_whole_buckets_of_long_segments():
    b = cpu_lora.BUCKET
    segments = [(0, 1, 0), (1, 1 + b - 1, 1), (b, 3 * b + 7, 2), (3 * b + 7, 5 * b + 7, 3), (5 * b + 7, 5 * b + 9, 0)]
    assert cpu_lora.split(segments, None) == (segments, [])
    c, onednn = cpu_lora.split(segments, lambda slot: b)
    assert onednn == [(b, 3 * b, 2), (3 * b + 7, 5 * b + 7, 3)]
    assert c == [(0, 1, 0), (1, b, 1), (3 * b, 3 * b + 7, 2), (5 * b + 7, 5 * b + 9, 0)]
    rows = sorted(r for s, e, _ in c + onednn for r in range(s, e))
    assert rows == list(range(5 * b + 9))  # disjoint, and every row on one path
    assert cpu_lora.split(segments, lambda slot: 3 * b)[1] == []  # none reaches the crossover
    assert cpu_lora.split(segments, lambda slot: 2 * b)[1] == [(b, 3 * b, 2), (3 * b + 7, 5 * b + 7, 3)]
    assert cpu_lora.split(segments, lambda slot: b if slot == 3 else None)[1] == [(3 * b + 7, 5 * b + 7, 3)]


@pytest.mark.parametrize("rank", [8, 64])
def test_long_segments_through_onednn_match_the_kernel_and_the_reference(rank):
    """A crossover forced to one bucket (whatever this CPU measured): the long segments'
    whole buckets run through the torch loop, the rest and the decode rows through the
    kernel; the result is the all-kernel batch's and the reference's, DoRA and lora_bias
    (slots 1 and 3) included, lengths off the bucket included, other rows untouched."""
    b = cpu_lora.BUCKET
    lora = _loaded(torch.bfloat16, rank)
    segments = [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 3 + 2 * b + 9, 1), (3 + 2 * b + 9, 3 + 3 * b + 9, 3),
                (3 + 3 * b + 9, 3 + 3 * b + 29, 2), (3 + 3 * b + 29, 3 + 4 * b + 29, 0)]
    rows = 3 + 4 * b + 29 + 5  # 5 rows past the last segment: no adapter
    x, out = _activations(rows, torch.bfloat16, rank)
    lora.crossovers = Crossovers({8: b})
    hybrid = lora.batch(segments)
    assert [s for s in hybrid.torch.segments] == [(3, 3 + 2 * b, 1), (3 + 2 * b + 9, 3 + 3 * b + 9, 3),
                                                  (3 + 3 * b + 29, 3 + 4 * b + 29, 0)]
    lora.crossovers = None
    kernel = lora.batch(segments)
    assert kernel.torch is None
    tol = dict(atol=3e-2, rtol=2e-2)
    _assert_matches_reference([hybrid], lora, segments, x, out, tol)
    for layer in range(2):
        for g in GROUPS:
            got, want = out[g].clone(), out[g].clone()
            hybrid.apply(layer, g, x[g], got)
            kernel.apply(layer, g, x[g], want)
            torch.testing.assert_close(got, want, **tol)
            assert torch.equal(got[-5:], out[g][-5:])


def test_rank_pairs_layout():
    """Ranks 2p and 2p+1 of a column side by side, zero past an odd rank."""
    bt = torch.arange(15.0).view(3, 5)
    pairs = rank_pairs(bt).view(2, 5, 2)
    assert torch.equal(pairs[:, :, 0], bt[0::2]) and torch.equal(pairs[0, :, 1], bt[1])
    assert torch.equal(pairs[1, :, 1], torch.zeros(5))
