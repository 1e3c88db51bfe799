"""KV pool sizing against injected device figures: 24 GiB, 80 GiB and 141 GB devices."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.checkpoint import ModelArch
from loraplex.engine.runner.memory_budget import (
    DeviceMemory, DeviceMemoryError, Measured, MemoryPlanConfig, ModelShape, adapter_slot_bytes, device_memory,
    kv_bytes_per_block, plan_kv_cache, tensor_bytes,
)

GIB = 1 << 30
# hidden, intermediate, layers, heads, KV heads, head_dim (the models' config.json)
SMOLLM2_135M = ModelShape(576, 1536, 30, 9, 3, 64)
LLAMA_1B = ModelShape(2048, 8192, 16, 32, 8, 64)  # Llama-3.2-1B
LLAMA_8B = ModelShape(4096, 14336, 32, 32, 8, 128)  # Llama-3-8B

GPU_24G = DeviceMemory(free=24 * GIB, total=24 * GIB)
GPU_80G = DeviceMemory(free=80 * GIB, total=80 * GIB)
GPU_141G = DeviceMemory(free=141 * 10**9, total=141 * 10**9)


def test_bytes_per_block():
    # K and V x layers x KV heads x head_dim x 16 tokens x 2 bytes
    assert kv_bytes_per_block(SMOLLM2_135M, 16, 2) == 2 * 30 * 3 * 64 * 16 * 2 == 368_640
    assert kv_bytes_per_block(LLAMA_8B, 16, 2) == 2 * 1024 * 1024  # 128 KiB per token
    assert kv_bytes_per_block(LLAMA_1B, 16, 2) == 512 * 1024


def test_adapter_slot_bytes_match_the_triton_weight_stacks():
    # A rank-16 adapter on all seven projections of Llama-3-8B is the familiar ~84 MB in bf16.
    assert adapter_slot_bytes(LLAMA_8B, 1, 16, 2) == 83_886_976 + 11_010_560  # A/B and ranks, epilogues
    assert adapter_slot_bytes(LLAMA_8B, 0, 16, 2) == 0
    # The figure is what StackedLoRAWeights really allocates for the slots.
    from loraplex.engine.kernels.triton.lora import StackedLoRAWeights

    arch = ModelArch.from_hf_config({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256})
    shape = ModelShape.from_arch(arch)
    stacks = StackedLoRAWeights(3, arch.num_layers, *shape.lora_stack_sizes(), 8, torch.bfloat16, "cpu")
    assert adapter_slot_bytes(shape, 3, 8, 2) == stacks.nbytes()


def test_80g_llama_8b_blocks_with_and_without_adapters():
    cfg = MemoryPlanConfig(gpu_memory_utilization=0.9, max_model_len=8192)
    measured = Measured(weight_bytes=16 * GIB, activation_peak_bytes=2 * GIB)
    plan = plan_kv_cache(LLAMA_8B, cfg, GPU_80G, measured)
    # 72 GiB budget - 16 GiB weights - 2 GiB activations = 54 GiB of 2 MiB blocks
    assert plan.num_blocks == 54 * 512 == 27_648
    assert plan.kv_bytes == 54 * GIB and plan.min_blocks == 512 and plan.adapter_bytes == 0
    with_adapters = plan_kv_cache(LLAMA_8B, MemoryPlanConfig(gpu_memory_utilization=0.9, max_model_len=8192,
                                                             adapter_rows=32, max_lora_rank=16), GPU_80G, measured)
    # 32 slots x 94,897,536 bytes (A/B, ranks, epilogues) = 1448.0005 blocks of 2 MiB: 1449 fewer blocks
    assert with_adapters.adapter_bytes == 32 * 94_897_536
    assert with_adapters.num_blocks == 27_648 - 1449
    assert "26199 blocks" in with_adapters.describe()


def test_141g_llama_1b():
    cfg = MemoryPlanConfig(gpu_memory_utilization=0.9, max_model_len=131072)
    plan = plan_kv_cache(LLAMA_1B, cfg, GPU_141G, Measured(weight_bytes=2_471_000_000, activation_peak_bytes=GIB))
    # int(141e9 x 0.9) - 2.471e9 - 1 GiB = 123,355,258,176 bytes of 512 KiB blocks
    assert plan.num_blocks == 235_281
    assert plan.min_blocks == 8192 and plan.num_blocks // plan.min_blocks == 28


def test_24g_smollm2_with_eight_rank_64_adapters():
    measured = Measured(weight_bytes=270_000_000, activation_peak_bytes=GIB // 2)
    base = plan_kv_cache(SMOLLM2_135M, MemoryPlanConfig(max_model_len=8192), GPU_24G, measured)
    # int(24 GiB x 0.9) = 23,192,823,398; minus weights and activations, in 368,640-byte blocks
    assert base.num_blocks == 60_725
    adapters = plan_kv_cache(SMOLLM2_135M, MemoryPlanConfig(max_model_len=8192, adapter_rows=8, max_lora_rank=64),
                             GPU_24G, measured)
    # 30 layers x (64 x 10,176 x 2 + 28 + 8 x 5,184 + 16: A/B, ranks, epilogues) per slot
    assert adapters.adapter_bytes == 8 * 40_321_320
    assert adapters.num_blocks == 59_850


def test_24g_refuses_llama_8b_when_one_sequence_cannot_fit():
    measured = Measured(weight_bytes=16 * GIB, activation_peak_bytes=2 * GIB, non_torch_bytes=GIB // 2)
    # 21.6 GiB - 18.5 GiB leaves ~3.1 GiB = 1587 blocks: 8k contexts fit, 128k contexts do not.
    assert plan_kv_cache(LLAMA_8B, MemoryPlanConfig(max_model_len=8192), GPU_24G, measured).num_blocks == 1587
    with pytest.raises(DeviceMemoryError) as e:
        plan_kv_cache(LLAMA_8B, MemoryPlanConfig(max_model_len=131072), GPU_24G, measured)
    msg = str(e.value)
    assert "1587 blocks" in msg and "one 131072-token sequence needs 8192 KV blocks" in msg
    assert "weights 16.00 GiB" in msg and "activations 2.00 GiB" in msg and "of 24.00 GiB" in msg


def test_refuses_when_the_weights_alone_exceed_the_budget():
    measured = Measured(weight_bytes=16 * GIB, activation_peak_bytes=2 * GIB)
    with pytest.raises(DeviceMemoryError, match=r"0 blocks.*Raise gpu_memory_utilization"):
        plan_kv_cache(LLAMA_8B, MemoryPlanConfig(gpu_memory_utilization=0.7), GPU_24G, measured)
    # 32 rank-64 adapter rows (11.1 GB) push an 8B model off a 24 GiB card at 0.95 too.
    with pytest.raises(DeviceMemoryError, match=r"adapter rows 10\.33 GiB \(32 x rank 64\)"):
        plan_kv_cache(LLAMA_8B, MemoryPlanConfig(gpu_memory_utilization=0.95, adapter_rows=32, max_lora_rank=64),
                      GPU_24G, measured)


def test_refuses_a_utilization_above_the_free_memory():
    shared = DeviceMemory(free=40 * GIB, total=80 * GIB)  # another process holds half the card
    measured = Measured(weight_bytes=3 * GIB, activation_peak_bytes=GIB)
    with pytest.raises(DeviceMemoryError, match=r"only 40\.00 GiB is free.*at most 0\.50"):
        plan_kv_cache(LLAMA_1B, MemoryPlanConfig(gpu_memory_utilization=0.9), shared, measured)
    plan = plan_kv_cache(LLAMA_1B, MemoryPlanConfig(gpu_memory_utilization=0.5), shared, measured)
    assert plan.num_blocks == 36 * 2048  # 40 - 3 - 1 GiB of 512 KiB blocks


def test_kv_cache_memory_overrides_utilization():
    measured = Measured(weight_bytes=16 * GIB, activation_peak_bytes=2 * GIB)
    for util in (0.3, 0.9):  # ignored: 0.3 alone would leave nothing for the cache
        plan = plan_kv_cache(LLAMA_8B, MemoryPlanConfig(gpu_memory_utilization=util, kv_cache_memory=8 * GIB),
                             GPU_80G, measured)
        assert plan.num_blocks == 4096 and plan.budget_bytes == 26 * GIB
    with pytest.raises(DeviceMemoryError, match=r"exceeds the 24\.00 GiB free"):
        plan_kv_cache(LLAMA_8B, MemoryPlanConfig(kv_cache_memory=8 * GIB), GPU_24G, measured)
    with pytest.raises(DeviceMemoryError, match=r"kv_cache_memory 0\.50 GiB: 256 blocks.*needs 512"):
        plan_kv_cache(LLAMA_8B, MemoryPlanConfig(kv_cache_memory=GIB // 2, max_model_len=8192), GPU_80G, measured)


@pytest.mark.parametrize("kwargs", [dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5),
                                    dict(kv_cache_memory=0), dict(block_size=0), dict(adapter_rows=-1)])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        MemoryPlanConfig(**kwargs)


def test_device_memory_reads_the_injected_function():
    seen = []

    def mem_get_info(device):
        seen.append(device)
        return (70 * GIB, 80 * GIB)

    assert device_memory("cuda:1", mem_get_info) == DeviceMemory(free=70 * GIB, total=80 * GIB)
    assert seen == [torch.device("cuda:1")]


def test_tensor_bytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's LM head
    norm = torch.ones(8, dtype=torch.bfloat16)
    assert tensor_bytes([emb.weight, head.weight, norm]) == 100 * 8 * 4 + 8 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiling reads the CUDA allocator")
def test_plan_on_a_real_device():
    from itertools import chain

    from loraplex.engine.runner.memory_budget import plan_on_device

    at_start = device_memory("cuda")
    model = torch.nn.Linear(1024, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    shape = ModelShape(1024, 4096, 2, 8, 8, 128)
    plan = plan_on_device(shape, MemoryPlanConfig(gpu_memory_utilization=0.5, max_model_len=256), "cuda", at_start,
                          chain(model.parameters(), model.buffers()), lambda: model(x))
    assert plan.weight_bytes == 1024 * 4096 * 2
    assert plan.activation_bytes >= 2048 * 4096 * 2  # the output, at least
    assert plan.num_blocks == (int(at_start.total * 0.5) - plan.weight_bytes - plan.activation_bytes
                               - plan.non_torch_bytes) // plan.bytes_per_block


def test_lora_stack_sizes():
    assert LLAMA_8B.lora_stack_sizes() == (
        {"qkv": 4096, "o": 4096, "gate_up": 4096, "down": 14336},
        {"q_proj": 4096, "k_proj": 1024, "v_proj": 1024, "o_proj": 4096, "gate_proj": 14336, "up_proj": 14336,
         "down_proj": 4096})


def test_default_adapter_rows_one_per_sequence_unless_memory_is_short():
    from loraplex.engine.runner.memory_budget import ADAPTER_ROWS_SHARE, MIN_ADAPTER_ROWS, default_adapter_rows

    # SmolLM2 on a 141 GB card: 128 rank-64 rows (39 MB each) are a sliver: one per sequence.
    left = int(GPU_141G.total * 0.9) - 270_000_000
    assert default_adapter_rows(SMOLLM2_135M, 64, 2, left, max_num_seqs=128) == 128
    # Llama-3-8B at rank 64 (347 MB a row) on 80 GiB: a fifth of the 56 GiB left after the weights.
    per_row = adapter_slot_bytes(LLAMA_8B, 1, 64, 2)
    left = int(80 * GIB * 0.9) - 16 * GIB
    rows = default_adapter_rows(LLAMA_8B, 64, 2, left, max_num_seqs=128)
    assert rows == int(ADAPTER_ROWS_SHARE * left) // per_row == 34 and rows * per_row <= ADAPTER_ROWS_SHARE * left
    # On a 24 GiB card the share holds 3 rows: the floor keeps 8, as many as before.
    assert default_adapter_rows(LLAMA_8B, 64, 2, int(24 * GIB * 0.9) - 16 * GIB, 128) == MIN_ADAPTER_ROWS


def test_preallocated_rows_and_staging_come_from_the_engine_config():
    from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig

    cfg = EngineConfig(cache=CacheConfig(block_size=32), lora=LoRAConfig(max_lora_rank=16))
    plan_cfg = MemoryPlanConfig.from_engine(cfg, 4096, 2, adapter_rows=40, staged_loras=8)
    assert (plan_cfg.adapter_rows, plan_cfg.staged_loras, plan_cfg.max_lora_rank, plan_cfg.block_size) == (40, 8, 16, 32)
    # A backend whose rows grow preallocates none: its adapters take pages of the pool.
    grown = plan_kv_cache(LLAMA_8B, MemoryPlanConfig.from_engine(cfg, 8192, 2), GPU_80G,
                          Measured(weight_bytes=16 * GIB, activation_peak_bytes=2 * GIB))
    assert grown.adapter_bytes == 0 and grown.num_blocks == 54 * 256  # 4 MiB blocks of 32 tokens
