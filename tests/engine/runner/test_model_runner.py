"""The runner's GPU decisions without a GPU: how it sizes the KV cache (the CPU pool, and
the figures it hands the GPU memory plan), which steps replay a CUDA graph and at which
width, as the scheduler produces them, and that a CPU engine captures nothing."""
from __future__ import annotations

import subprocess
import sys

import pytest

from loraplex.engine.sched.block_pool import KVCacheManager
from loraplex.engine.config import CPU_KV_CACHE_MEMORY, CacheConfig, EngineConfig, LoRAConfig, ModelConfig, \
    SchedulerConfig
from loraplex.engine.runner.cuda_graphs import GraphPolicy
from loraplex.engine.engine import LLMEngine
from loraplex.engine.runner.memory_budget import (GIB, DeviceMemory, DeviceMemoryError, Measured, MemoryPlanConfig,
                                           ModelShape, kv_bytes_per_block, plan_fixed_kv, plan_kv_cache)
from loraplex.engine.request import Request, SamplingParams
from loraplex.engine.sched.scheduler import Scheduler

# The tiny Llama: 2 layers, 2 KV heads of 16, fp32 -> 8 KiB per 16-token block, 2048 positions.
TINY_BLOCK = 2 * 2 * 2 * 16 * 16 * 4


def _engine(model_dir, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(**cache), kernels="torch"))


def test_the_cpu_pool_is_one_gib_by_default(tiny_llama_dir):
    runner = _engine(tiny_llama_dir).runner
    assert runner.num_blocks == CPU_KV_CACHE_MEMORY // TINY_BLOCK
    assert runner.kv_caches[0][0].shape == (2, runner.num_blocks * 16, 16)
    assert runner.graphs is None  # a CPU device: every step eager


def test_the_cpu_pool_is_zeroed_views_of_one_mapping(tiny_llama_dir):
    caches = _engine(tiny_llama_dir).runner.kv_caches
    base = caches[0][0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base and t.is_contiguous() for kv in caches for t in kv)
    assert not any(t[:, :: 4096].any() for kv in caches for t in kv)
    starts = sorted(t.data_ptr() for kv in caches for t in kv)
    assert [b - a for a, b in zip(starts, starts[1:])] == [caches[0][0].nbytes] * 3  # K, V per layer, no overlap


def test_a_pool_the_host_cannot_hold_is_refused_at_start(tiny_llama_dir):
    cfg = MemoryPlanConfig(block_size=16, max_model_len=2048, dtype_bytes=4)
    shape = ModelShape(32, 64, 2, 2, 2, 16)
    with pytest.raises(DeviceMemoryError) as e:
        plan_fixed_kv(shape, cfg, GIB, available=GIB // 2)
    assert str(e.value) == ("kv_cache_memory 1.00 GiB exceeds the 0.50 GiB of memory this host has available; "
                            "lower kv_cache_memory")
    assert plan_fixed_kv(shape, cfg, GIB, available=GIB).num_blocks == GIB // TINY_BLOCK


def test_an_engine_whose_host_cannot_hold_its_pool_refuses_to_start(tiny_llama_dir, monkeypatch):
    # The runner hands the host's available memory to the plan (what the test above checks).
    from loraplex.engine.runner import model_runner
    monkeypatch.setattr(model_runner, "host_memory_available", lambda: GIB // 2)
    with pytest.raises(DeviceMemoryError, match="exceeds the 0.50 GiB of memory this host has available"):
        _engine(tiny_llama_dir)


def test_a_pool_below_one_max_length_sequence_is_refused_with_its_figures(tiny_llama_dir):
    with pytest.raises(DeviceMemoryError) as e:
        _engine(tiny_llama_dir, kv_cache_memory_bytes=256 << 10)
    assert str(e.value) == ("kv_cache_memory 0.25 MiB: 32 blocks, but one 2048-token sequence needs 128 KV blocks "
                            "of 8192 bytes (1.00 MiB). Raise kv_cache_memory or lower max_model_len")
    # The same pool holds a 128-token context: that model length starts.
    eng = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                                 cache=CacheConfig(kv_cache_memory_bytes=256 << 10), kernels="torch"))
    assert eng.runner.num_blocks == 32


def test_the_memory_plan_reads_the_engine_config():
    cfg = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.8, block_size=32),
                       lora=LoRAConfig(max_loras=4, max_lora_rank=32))
    plan = MemoryPlanConfig.from_engine(cfg, 4096, 2, adapter_rows=4, staged_loras=4)
    assert plan == MemoryPlanConfig(gpu_memory_utilization=0.8, kv_cache_memory=None, block_size=32,
                                    max_model_len=4096, adapter_rows=4, max_lora_rank=32, dtype_bytes=2,
                                    staged_loras=4)
    assert MemoryPlanConfig.from_engine(cfg, 4096, 2).adapter_rows == 0
    over = EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=3 * GIB))
    assert MemoryPlanConfig.from_engine(over, 2048, 2).kv_cache_memory == 3 * GIB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.2)


def test_staged_adapter_copies_take_room_like_slots():
    """8 rows + 8 staged rank-64 copies of a Llama-8B on a 24 GB device: the plan names both."""
    llama_8b = ModelShape(4096, 14336, 32, 32, 8, 128)
    cfg = EngineConfig(model=ModelConfig(max_model_len=8192), lora=LoRAConfig(max_loras=8, max_lora_rank=64))
    measured = Measured(weight_bytes=16 * GIB, activation_peak_bytes=GIB // 2, non_torch_bytes=GIB // 2)
    device = DeviceMemory(free=23 * GIB, total=24 * GIB)
    plain = plan_kv_cache(llama_8b, MemoryPlanConfig.from_engine(cfg, 8192, 2, adapter_rows=8), device, measured)
    staged = plan_kv_cache(llama_8b, MemoryPlanConfig.from_engine(cfg, 8192, 2, adapter_rows=8, staged_loras=8),
                           DeviceMemory(free=80 * GIB, total=80 * GIB), measured)
    assert staged.adapter_bytes == 2 * plain.adapter_bytes
    with pytest.raises(DeviceMemoryError, match=r"adapter rows 5\.\d\d GiB \(8 \+ 8 staged x rank 64\).*"
                                                r"one 8192-token sequence needs 512 KV blocks"):
        plan_kv_cache(llama_8b, MemoryPlanConfig.from_engine(cfg, 8192, 2, adapter_rows=8, staged_loras=8), device,
                      measured)
    assert plain.num_blocks * plain.bytes_per_block == plain.kv_bytes
    assert plain.bytes_per_block == kv_bytes_per_block(llama_8b, 16, 2)


def _decode_widths(policy: GraphPolicy, arrivals: dict[int, list[int]], steps: int) -> list[int | None]:
    """Drive a real scheduler (fake sampled tokens): per step, the width the runner
    replays it at (`policy.width_for_step` of its sequences' token counts), None = eager."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                      KVCacheManager(512, 16, False), max_model_len=512)
    widths = []
    for step in range(steps):
        for i, n in enumerate(arrivals.get(step, [])):
            sched.add_request(Request(f"r{step}-{i}", list(range(100, 100 + n)),
                                      SamplingParams(max_tokens=50, ignore_eos=True)))
        out = sched.schedule()
        widths.append(policy.width_for_step([len(s.token_ids) for s in out.seqs]) if out.seqs else None)
        sched.update(out, {s.request_id: [7] for s in out.seqs if s.sample})
    return widths


def test_which_steps_replay_a_graph_and_at_what_width():
    policy = GraphPolicy.build(16, "cuda", "triton")
    assert policy.widths == (1, 2, 4, 8, 16)
    # step 0: a prefill (eager); 1-2: one decode (width 1); 3: a 5-token prompt joins (eager);
    # 4-5: two decodes (2); 6: three more prompts of 40 tokens, chunked over the budget (eager
    # while any chunk is in the step); then five decodes pad to 8.
    widths = _decode_widths(policy, {0: [5], 3: [5], 6: [40, 40, 40]}, 12)
    assert widths[:6] == [None, 1, 1, None, 2, 2]
    assert widths[6] is None and widths[-1] == 8
    assert all(w in (None, 8) for w in widths[6:])


def test_steps_wider_than_the_widest_graph_or_without_graphs_run_eagerly():
    narrow = GraphPolicy.build(16, "cuda", "triton", max_width=4)
    assert _decode_widths(narrow, {0: [3] * 6}, 3) == [None, None, None]  # six decodes > 4
    for off in (GraphPolicy.build(16, "cuda", "triton", enforce_eager=True), GraphPolicy.build(16, "cpu", "triton")):
        assert _decode_widths(off, {0: [3]}, 3) == [None, None, None]


def test_enforce_eager_is_honoured_by_the_runner(tiny_llama_dir):
    eng = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                 cache=CacheConfig(num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=4),
                                 kernels="torch", enforce_eager=True))
    assert eng.runner.graphs is None and eng.runner.num_blocks == 32
    out = eng.generate([[100, 101, 102]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].new_token_ids) == 3


def test_the_runner_reserves_staged_copies_only_where_the_manager_stages(tiny_llama_dir):
    from loraplex.engine.lora import LoRAManager
    from tests.engine.lora.test_staging import GatedStager

    def plan(manager):
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                      cache=CacheConfig(num_blocks=16), lora=LoRAConfig(max_loras=3),
                                      kernels="torch"), manager).runner.memory_plan_config()

    assert (plan(None).adapter_rows, plan(None).staged_loras) == (0, 0)
    cpu = plan(LoRAManager(None, LoRAConfig(max_loras=3)))  # a CPU manager stages nothing
    assert (cpu.adapter_rows, cpu.staged_loras, cpu.max_model_len, cpu.dtype_bytes) == (3, 0, 2048, 4)
    staged = plan(LoRAManager(None, LoRAConfig(max_loras=3), stager=GatedStager()))
    assert (staged.adapter_rows, staged.staged_loras) == (3, 3)


def test_bf16_linears_hold_one_copy_where_the_host_cannot_spare_more(tiny_llama_dir, monkeypatch):
    # The host's memory is read at load: with none to spare beyond the KV pool every
    # projection and the LM head are the C kernel alone, even where the measured choice
    # (here: made to split at 16 rows, whatever this machine measures) wants a second copy.
    from loraplex.engine.kernels.cpu import gemm, linear_choice
    from loraplex.engine.kernels.cpu.backend import c_linear
    from loraplex.engine.runner import host_memory
    if not gemm.load_library():
        pytest.skip("needs the C bf16 kernel")
    monkeypatch.setattr(linear_choice, "choose", lambda few, many: linear_choice.LinearChoice(few, many[0], 16))
    runner = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir)), kernels="cpu")).runner
    assert type(runner.model.layers[0].qkv_proj) is linear_choice.SplitLinear  # memory to spare: the split
    monkeypatch.setattr(host_memory, "host_memory_available", lambda: CPU_KV_CACHE_MEMORY + GIB)
    runner = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir)), kernels="cpu")).runner
    few = c_linear()
    assert type(runner.model.layers[0].qkv_proj) is few and type(runner.model.packed_head) is few


def _warm_up_calls(runner, row_counts: list[int]) -> tuple[list[tuple[str, int]], list[int]]:
    """(layer name, rows) for every layer forward and the rows of every LM head call that
    `runner.warm_up(row_counts)` made."""
    layers, heads = [], []
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: layers.append((name, args[0].shape[0])))
             for name, m in runner.model.named_modules() if hasattr(m, "in_features")]
    real = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden, *a, **k: heads.append(hidden.shape[0]) or real(hidden, *a, **k)
    try:
        runner.warm_up(row_counts)
    finally:
        del runner.model.compute_logits
        for h in hooks:
            h.remove()
    return layers, heads


def test_warm_up_runs_every_weight_shape_at_every_row_count_where_the_kernel_builds_state(tiny_llama_dir):
    # torch's bf16 layers hand their shapes to oneDNN, which builds a primitive per shape.
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="bfloat16"),
                                    cache=CacheConfig(num_blocks=64), kernels="torch"))
    runner = engine.runner
    shapes = {(m.in_features, m.out_features) for m in runner.model.modules() if hasattr(m, "in_features")}
    layers, heads = _warm_up_calls(runner, [1, 3, 64])
    assert len(layers) == 3 * len(shapes) and sorted({n for _, n in layers}) == [1, 3, 64]
    # Where oneDNN packs bf16 the LM head is a packed layer among the others.
    assert heads == ([1, 3, 64] if runner.model.packed_head is None else [])


def test_warm_up_runs_nothing_where_no_kernel_builds_state_per_shape(tiny_llama_dir):
    # fp32 on a CPU is BLAS sgemm: warming it would cost seconds at every start for nothing.
    runner = _engine(tiny_llama_dir, num_blocks=64).runner
    assert _warm_up_calls(runner, [1, 3, 64]) == ([], [])


def test_building_an_engine_does_not_import_torch_dynamo(tiny_llama_dir):
    # torch._dynamo costs a second at every process start and nothing on the serving
    # path needs it: a random weight init on the meta device was what imported it.
    code = ("import sys; from loraplex.engine.config import EngineConfig, ModelConfig; "
            "from loraplex.engine.engine import LLMEngine; "
            f"LLMEngine(EngineConfig(model=ModelConfig(model={str(tiny_llama_dir)!r}, dtype='float32'))); "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_the_sampler_finds_top_p_nuclei_with_its_backends_kernel(kernels, tiny_llama_dir):
    # The "cpu" backend's threshold (no sort), the torch backend's sort.
    from loraplex.engine.kernels.cpu import nucleus
    if kernels == "cpu" and nucleus.load_library() is None:
        pytest.skip("needs the C kernels")
    runner = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir)), kernels=kernels)).runner
    assert runner.sampler.nucleus is (nucleus.nucleus_threshold if kernels == "cpu" else None)
