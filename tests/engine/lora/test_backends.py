"""The torch and C LoRA backends vs the per-segment loop (`LoRABatch`) on random tensors."""
from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.kernels.cpu import lora as cpu_lora
from loraplex.engine.kernels.cpu.lora import CLoRABatch
from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend
from loraplex.engine.lora import GROUPS, pack_adapter, segments_of
from loraplex.engine.lora.torch_backend import GROUPED_MAX_ROWS, GroupedLoRABatch, LoRABatch, TorchLoRABackend
from tests.engine.kernels.kernel_cases import llama_shapes, random_adapter, random_epilogues

HIDDEN, Q, KV, INTER, LAYERS = 48, 48, 16, 80, 2
OUT, IN, GROUP_IN = llama_shapes(HIDDEN, Q, KV, INTER)
GROUP_OUT = {g: sum(OUT[m] for m in mods) for g, mods in GROUPS.items()}
ALL = tuple(OUT)
# Ranks 4..64, per-module ranks, partial targets: slot 2 has no qkv, slot 4 no gate_up/down.
ADAPTERS = [
    {m: 4 for m in ALL},
    {"q_proj": 64, "v_proj": 64, "down_proj": 64},
    {"o_proj": 8, "gate_proj": 8},
    {m: 32 for m in ALL} | {"k_proj": 5, "up_proj": 17},
    {"q_proj": 16, "o_proj": 16},
    {m: 8 for m in ALL},
    {m: 16 for m in ALL},
    {"down_proj": 4},
]
NUM_SLOTS = 12  # more slots than adapters: idle slots inside and past the active range
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.fixture(params=["c_kernel", "grouped_bmm"])
def backend(request) -> type[TorchLoRABackend]:
    """Every test runs both backends on the slot stacks: the C kernel (the "cpu" kernel
    backend) where it builds, and the grouped torch bmm (the "torch" one)."""
    if request.param == "c_kernel" and cpu_lora.load_library() is None:
        pytest.skip("no C compiler to build the CPU LoRA kernel")
    return CLoRABackend if request.param == "c_kernel" else TorchLoRABackend


def _loaded(dtype, backend, slot_of=None) -> TorchLoRABackend:
    """`backend` with ADAPTERS[i] in slot slot_of[i] (default: slot i)."""
    slot_of = slot_of or list(range(len(ADAPTERS)))
    lora = backend(NUM_SLOTS, LAYERS, GROUP_IN, OUT, 64, dtype, torch.device("cpu"))
    for i, ranks in enumerate(ADAPTERS):
        lora.set_slot(slot_of[i], pack_adapter(random_adapter(ranks, IN, OUT, LAYERS, seed=i + 1), OUT, LAYERS,
                                               dtype, torch.device("cpu")))
    return lora


def _batch(decode_slots: list[int], prefill: list[tuple[int, int]]) -> tuple[list, int]:
    """Decode rows first then prefill chunks, each sorted by slot (as the model runner orders them)."""
    seqs = [(1, s) for s in sorted(decode_slots)] + sorted(prefill, key=lambda p: p[1])
    return seqs, sum(n for n, _ in seqs)


CASES = {
    # one row per adapter, contiguous slots 0..7: the no-gather, no-padding path
    "decode-1-each": ([0, 1, 2, 3, 4, 5, 6, 7], []),
    # 1..3 rows per adapter with base rows: padding
    "decode-mixed": ([-1, -1, 0, 0, 0, 1, 3, 3, 5, 6, 6, 7, -1], []),
    # sparse slots (0, 7 of 0..7 with NUM_SLOTS 12): gathered weights
    "decode-sparse": ([0, 7, 7, -1], []),
    # decodes + short and long prefill chunks, an adapter in both groups
    "mixed": ([-1, 1, 2, 2, 4, 5], [(5, 1), (40, 3), (GROUPED_MAX_ROWS, 6), (30, -1), (3, 0)]),
    "prefill-only": ([], [(9, 2), (70, 5), (17, -1), (2, 7)]),
    "base-only": ([-1, -1], [(6, -1)]),
}


def _run(batch, x_by_group, out_by_group):
    outs = {}
    for g in GROUPS:
        for layer in range(LAYERS):
            out = out_by_group[g].clone()
            batch.apply(layer, g, x_by_group[g], out)
            outs[(layer, g)] = out
    return outs


def _inputs(rows: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = {g: torch.randn(rows, GROUP_IN[g], generator=gen).to(dtype) for g in GROUPS}
    out = {g: torch.randn(rows, GROUP_OUT[g], generator=gen).to(dtype) for g in GROUPS}
    return x, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_matches_per_segment_loop(dtype, case, backend):
    lora = _loaded(dtype, backend)
    seqs, rows = _batch(*CASES[case])
    segments = segments_of(seqs)
    x, out = _inputs(rows, dtype)
    ref = _run(LoRABatch(lora.packed, segments), x, out)
    batch = lora.batch(segments)
    # the path under test is the one taken: the C kernel takes every segment, long ones too
    if backend is CLoRABackend:
        assert isinstance(batch, CLoRABatch)
    elif any(e - s <= GROUPED_MAX_ROWS for s, e, _ in segments):
        assert isinstance(batch, GroupedLoRABatch) and batch.plan is not None
    got = _run(batch, x, out)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], **TOL[dtype], msg=lambda m: f"{case} {key}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_random_batches_match(dtype, backend):
    rng = random.Random(5)
    lora = _loaded(dtype, backend, slot_of=[0, 2, 3, 5, 6, 9, 10, 11])
    loaded = [-1, 0, 2, 3, 5, 6, 9, 10, 11]
    for trial in range(12):
        decodes = [rng.choice(loaded) for _ in range(rng.randrange(0, 20))]
        prefill = [(rng.choice([1, 2, 5, 16, 17, 33]), rng.choice(loaded)) for _ in range(rng.randrange(0, 4))]
        seqs, rows = _batch(decodes, prefill)
        segments = segments_of(seqs)
        if not segments:
            continue
        x, out = _inputs(rows, dtype, seed=trial)
        ref = _run(LoRABatch(lora.packed, segments), x, out)
        got = _run(lora.batch(segments), x, out)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], **TOL[dtype], msg=lambda m: f"{seqs} {key}: {m}")


@pytest.mark.parametrize("case", ["decode-mixed", "decode-sparse", "mixed", "base-only"])
def test_base_rows_untouched(case, backend):
    """Base rows keep their exact bits (a +0.0 on a -0.0 would flip the sign), however large x is."""
    lora = _loaded(torch.float32, backend)
    seqs, rows = _batch(*CASES[case])
    segments = segments_of(seqs)
    base = [r for r, slot in enumerate(s for n, s in seqs for _ in range(n)) if slot < 0]
    x, out = _inputs(rows, torch.float32)
    for g in GROUPS:
        x[g][base] = 1e4
        out[g][base] = -0.0
    got = _run(lora.batch(segments), x, out)
    changed = False
    for (layer, g), o in got.items():
        assert torch.equal(o[base].view(torch.int32), out[g][base].view(torch.int32)), (layer, g)
        changed |= not torch.equal(o, out[g])
    assert changed == (len(base) < rows)  # not vacuous: adapter rows did get deltas


def test_reload_replaces_weights_and_cached_gathers(backend):
    """A slot reloaded with a smaller adapter leaves nothing of the old one; gathered copies refresh."""
    dtype = torch.float32
    lora = _loaded(dtype, backend)
    seqs, rows = _batch([0, 7, 7], [])  # sparse: the gathered path, cached across steps
    segments = segments_of(seqs)
    x, out = _inputs(rows, dtype)
    _run(lora.batch(segments), x, out)  # fills the gather cache
    for slot, ranks in ((7, {"q_proj": 4}), (0, {m: 64 for m in ALL})):  # shrink, then grow the stacks
        lora.set_slot(slot, pack_adapter(random_adapter(ranks, IN, OUT, LAYERS, seed=99 + slot), OUT, LAYERS, dtype,
                                         torch.device("cpu")))
        ref = _run(LoRABatch(lora.packed, segments), x, out)
        got = _run(lora.batch(segments), x, out)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], **TOL[dtype])


def test_rows_grow_past_the_initial_count_keeping_every_adapter(backend):
    """Adapters resident beyond the rows a backend started with: the stacks grow (once per
    doubling), earlier rows keep their weights, and every row computes as the reference."""
    dtype = torch.float32
    lora = backend(2, LAYERS, GROUP_IN, OUT, 64, dtype, torch.device("cpu"))
    assert lora.grows
    rows = [0, 1, 5, 2, 13, 3, 4, 6]  # past 2, then past 8
    for i, ranks in enumerate(ADAPTERS):
        lora.set_slot(rows[i], pack_adapter(random_adapter(ranks, IN, OUT, LAYERS, seed=i + 1), OUT, LAYERS, dtype,
                                            torch.device("cpu")))
    assert lora.stacks.num_slots >= 14
    seqs, n = _batch(rows + [0, 13], [(17, 5), (3, 13)])
    segments = segments_of(seqs)
    x, out = _inputs(n, dtype)
    ref = _run(LoRABatch(lora.packed, segments), x, out)
    got = _run(lora.batch(segments), x, out)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], **TOL[dtype])


# Slots with DoRA-like (scale and shift), lora_bias-like (shift) and plain adapters side by side.
EPILOGUE_KINDS = {0: (True, True), 1: (True, False), 3: (False, True), 6: (True, False)}


def _loaded_with_epilogues(dtype, backend) -> TorchLoRABackend:
    lora = backend(NUM_SLOTS, LAYERS, GROUP_IN, OUT, 64, dtype, torch.device("cpu"))
    for i, ranks in enumerate(ADAPTERS):
        adapter = random_adapter(ranks, IN, OUT, LAYERS, seed=i + 1)
        epi = random_epilogues(adapter, i, *EPILOGUE_KINDS[i]) if i in EPILOGUE_KINDS else None
        lora.set_slot(i, pack_adapter(adapter, OUT, LAYERS, dtype, torch.device("cpu"), epi))
    return lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_epilogues_match_per_segment_loop(dtype, case, backend):
    """DoRA's rescale and lora_bias's shift (lora/epilogue.py): gathered for short
    segments, per segment for long ones, as the per-segment reference applies them."""
    lora = _loaded_with_epilogues(dtype, backend)
    assert lora.stacks.epilogues.slots == set(EPILOGUE_KINDS)
    seqs, rows = _batch(*CASES[case])
    segments = segments_of(seqs)
    x, out = _inputs(rows, dtype)
    for g in GROUPS:  # base rows must keep their exact bits, even -0.0
        out[g][[r for r, slot in enumerate(s for n, s in seqs for _ in range(n)) if slot < 0]] = -0.0
    ref = _run(LoRABatch(lora.packed, segments), x, out)
    plain = _run(LoRABatch([_without_epilogue(p) for p in lora.packed], segments), x, out)
    got = _run(lora.batch(segments), x, out)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], **TOL[dtype], msg=lambda m: f"{case} {key}: {m}")
        base = [r for r, slot in enumerate(s for n, s in seqs for _ in range(n)) if slot < 0]
        assert torch.equal(got[key][base].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           out[key[1]][base].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    if any(slot in EPILOGUE_KINDS for *_, slot in segments):
        assert any(not torch.equal(ref[k], plain[k]) for k in ref), "the epilogues changed nothing"


def test_epilogue_reload_and_growth(backend):
    """A slot reloaded with a plain adapter loses its epilogue; rows grown keep theirs."""
    dtype = torch.float32
    lora = _loaded_with_epilogues(dtype, backend)
    lora.set_slot(0, pack_adapter(random_adapter({"q_proj": 4}, IN, OUT, LAYERS, seed=50), OUT, LAYERS, dtype,
                                  torch.device("cpu")))
    adapter = random_adapter({m: 8 for m in ALL}, IN, OUT, LAYERS, seed=51)
    lora.set_slot(20, pack_adapter(adapter, OUT, LAYERS, dtype, torch.device("cpu"), random_epilogues(adapter, 9)))
    assert lora.stacks.epilogues.slots == {1, 3, 6, 20}
    seqs, rows = _batch([0, 1, 3, 20, 20], [(30, 0), (20, 20)])
    segments = segments_of(seqs)
    x, out = _inputs(rows, dtype)
    ref = _run(LoRABatch(lora.packed, segments), x, out)
    got = _run(lora.batch(segments), x, out)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], **TOL[dtype])


def _without_epilogue(packed):
    from loraplex.engine.lora.packing import PackedGroup

    if packed is None:
        return None
    return [{g: PackedGroup(p.a, p.parts, p.width) for g, p in layer.items()} for layer in packed]
