"""KV pool sizing on a GPU, the way vLLM users expect `--gpu-memory-utilization` to work.

loraplex may use `gpu_memory_utilization` F of the device's memory. From that budget come
the model's weights (measured), the adapter rows a LoRA backend allocates up front
(`adapter_rows` x `max_lora_rank` over every target projection: the Triton backend's,
which CUDA graphs read by address; 0 for a backend whose rows grow, whose adapters take
pages of the pool instead), the activation peak of one `max_num_batched_tokens` forward
(profiled) and memory outside torch's allocator (CUDA context, cuBLAS workspaces); the
rest becomes the pool of blocks that KV and adapter pages share (engine/sched/block_pool.py).
`kv_cache_memory` bytes, when given, replaces that computation.

The arithmetic (`plan_kv_cache`) takes plain numbers, so it is tested against injected
device figures; the measurements that need a device (`device_memory`,
`profile_activation_peak`, `tensor_bytes`) are separate, small functions.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..errors import EngineError

GIB = 1 << 30

# The projections an adapter slot covers, each (input features, output features) per layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class DeviceMemoryError(EngineError):
    """The model, its adapter rows and one max-length sequence cannot fit on the device."""


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of an architecture (fields named as in `checkpoint.ModelArch`)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_arch(cls, arch) -> ModelShape:
        return cls(arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads,
                   arch.num_kv_heads, arch.head_dim)

    def projection_sizes(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_stack_sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        """(input features per projection group, output features per projection): the
        sizes a LoRA slot stack is built with."""
        p = self.projection_sizes()
        groups = {"qkv": "q_proj", "o": "o_proj", "gate_up": "gate_proj", "down": "down_proj"}
        return {g: p[m][0] for g, m in groups.items()}, {m: out for m, (_, out) in p.items()}


@dataclass(frozen=True)
class MemoryPlanConfig:
    """The user's knobs (CLI flags) that sizing reads."""

    gpu_memory_utilization: float = 0.9
    # Bytes for the KV pool, ignoring gpu_memory_utilization (`--kv-cache-memory`).
    kv_cache_memory: int | None = None
    block_size: int = 16
    max_model_len: int = 2048
    # Adapter rows the LoRA backend allocates up front (0: none, or rows that grow and
    # take pages of the pool).
    adapter_rows: int = 0
    max_lora_rank: int = 16
    dtype_bytes: int = 2
    # Adapters copied to the device ahead of their row (the asynchronous load's
    # destination, engine/lora/staging.py): sized as that many more rows.
    staged_loras: int = 0

    @classmethod
    def from_engine(cls, config, max_model_len: int, dtype_bytes: int, adapter_rows: int = 0,
                    staged_loras: int = 0) -> MemoryPlanConfig:
        """The knobs of an `EngineConfig`, with the LoRA manager's preallocated rows and staging."""
        return cls(gpu_memory_utilization=config.cache.gpu_memory_utilization,
                   kv_cache_memory=config.cache.kv_cache_memory_bytes, block_size=config.cache.block_size,
                   max_model_len=max_model_len, adapter_rows=adapter_rows, max_lora_rank=config.lora.max_lora_rank,
                   dtype_bytes=dtype_bytes, staged_loras=staged_loras)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if (self.block_size < 1 or self.max_model_len < 1 or self.adapter_rows < 0 or self.max_lora_rank < 1
                or self.staged_loras < 0):
            raise ValueError("block_size, max_model_len and max_lora_rank must be positive, adapter_rows and "
                             "staged_loras >= 0")


@dataclass(frozen=True)
class DeviceMemory:
    """(free, total) bytes as `torch.cuda.mem_get_info` reports them, read before the model loads."""

    free: int
    total: int


@dataclass(frozen=True)
class Measured:
    """What loading and profiling the model measured on the device."""

    weight_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int = 0  # CUDA context, cuBLAS/NCCL workspaces: outside torch's allocator


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    kv_bytes: int  # num_blocks * bytes_per_block
    budget_bytes: int  # total x utilization, or the override's total need
    weight_bytes: int
    adapter_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    min_blocks: int  # one max_model_len sequence

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks ({_gib(self.kv_bytes)}, {self.num_blocks // self.min_blocks} "
                f"max-length sequences); weights {_gib(self.weight_bytes)}, adapter rows "
                f"{_gib(self.adapter_bytes)}, activations {_gib(self.activation_bytes)}, other "
                f"{_gib(self.non_torch_bytes)} of a {_gib(self.budget_bytes)} budget")


def _gib(n: int) -> str:
    # Small pools (a CPU's, a tiny model's) would all read "0.00 GiB".
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB // 16 else f"{n / (1 << 20):.2f} MiB"


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype_bytes: int) -> int:
    """K and V of every layer for `block_size` tokens."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * block_size * dtype_bytes


def adapter_slot_bytes(shape: ModelShape, rows: int, max_lora_rank: int, dtype_bytes: int) -> int:
    """Device bytes of `rows` adapter rows of rank `max_lora_rank` on every target projection:
    A [rank, in] and B [out, rank] per projection and layer, the int32 rank table, and the
    epilogue maps (lora/epilogue.py: fp32 scale and shift per output feature, an int32
    flag per group)."""
    sizes = shape.projection_sizes().values()
    per_layer = sum(max_lora_rank * (fin + fout) for fin, fout in sizes)
    ranks = 4 * len(LORA_TARGETS)
    epilogue = 8 * sum(fout for _, fout in sizes) + 4 * 4
    return rows * shape.num_layers * (per_layer * dtype_bytes + ranks + epilogue)


# Preallocated adapter rows (a backend that cannot grow) take at most this share of the
# memory the budget leaves after the weights, unless `max_loras` says how many.
ADAPTER_ROWS_SHARE = 0.2
MIN_ADAPTER_ROWS = 8


def default_adapter_rows(shape: ModelShape, max_lora_rank: int, dtype_bytes: int, available: int,
                         max_num_seqs: int) -> int:
    """Rows to preallocate when `max_loras` is not set: one per sequence a step may run
    (so rows never limit a step), unless that would take more than ADAPTER_ROWS_SHARE of
    the `available` bytes; never fewer than MIN_ADAPTER_ROWS."""
    per_row = adapter_slot_bytes(shape, 1, max_lora_rank, dtype_bytes)
    fit = int(ADAPTER_ROWS_SHARE * max(available, 0)) // per_row
    return max(MIN_ADAPTER_ROWS, min(max_num_seqs, fit))


def plan_kv_cache(shape: ModelShape, config: MemoryPlanConfig, device: DeviceMemory, measured: Measured) -> KVPlan:
    """The KV pool's block count, or `DeviceMemoryError` naming every figure when the model
    plus one `max_model_len` sequence cannot fit."""
    per_block = kv_bytes_per_block(shape, config.block_size, config.dtype_bytes)
    min_blocks = -(-config.max_model_len // config.block_size)
    adapters = adapter_slot_bytes(shape, config.adapter_rows + config.staged_loras, config.max_lora_rank,
                                  config.dtype_bytes)
    fixed = measured.weight_bytes + adapters + measured.activation_peak_bytes + measured.non_torch_bytes
    staged = f" + {config.staged_loras} staged" if config.staged_loras else ""
    parts = (f"weights {_gib(measured.weight_bytes)} + adapter rows {_gib(adapters)} "
             f"({config.adapter_rows}{staged} x rank {config.max_lora_rank}) + activations "
             f"{_gib(measured.activation_peak_bytes)} + other {_gib(measured.non_torch_bytes)}")
    if config.kv_cache_memory is not None:
        kv = config.kv_cache_memory
        budget = fixed + kv
        if budget > device.free:
            raise DeviceMemoryError(
                f"kv_cache_memory {_gib(kv)} + {parts} = {_gib(budget)} exceeds the {_gib(device.free)} "
                f"free on the device ({_gib(device.total)} total); lower kv_cache_memory or max_loras")
    else:
        budget = int(device.total * config.gpu_memory_utilization)
        if budget > device.free:
            raise DeviceMemoryError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} asks for {_gib(budget)} of the "
                f"device's {_gib(device.total)} but only {_gib(device.free)} is free (other processes use "
                f"the rest); lower gpu_memory_utilization to at most "
                f"{device.free / device.total:.2f}")
        kv = budget - fixed
    num_blocks = max(0, kv // per_block)
    if num_blocks < min_blocks:
        where = (f"kv_cache_memory {_gib(config.kv_cache_memory)}" if config.kv_cache_memory is not None else
                 f"{_gib(budget)} ({config.gpu_memory_utilization} of {_gib(device.total)}) - {parts} "
                 f"leaves {_gib(max(kv, 0))} for the KV cache")
        raise DeviceMemoryError(
            f"{where}: {num_blocks} blocks, but {_one_sequence(config, per_block)}. Raise "
            f"gpu_memory_utilization or kv_cache_memory, or lower max_model_len, max_num_batched_tokens, "
            f"max_loras or max_lora_rank")
    return KVPlan(num_blocks, per_block, num_blocks * per_block, budget, measured.weight_bytes, adapters,
                  measured.activation_peak_bytes, measured.non_torch_bytes, min_blocks)


def _one_sequence(config: MemoryPlanConfig, per_block: int) -> str:
    n = -(-config.max_model_len // config.block_size)
    return f"one {config.max_model_len}-token sequence needs {n} KV blocks of {per_block} bytes ({_gib(n * per_block)})"


def plan_fixed_kv(shape: ModelShape, config: MemoryPlanConfig, kv_bytes: int, available: int | None = None
                  ) -> KVPlan:
    """A pool of `kv_bytes` (a CPU's KV cache: no device figures to read), or
    `DeviceMemoryError` when it cannot hold one `max_model_len` sequence or exceeds the
    `available` bytes (the host's, where known: its pages are taken as it fills, so a
    pool the host cannot hold would fail only under load)."""
    if available is not None and kv_bytes > available:
        raise DeviceMemoryError(f"kv_cache_memory {_gib(kv_bytes)} exceeds the {_gib(available)} of memory this "
                                f"host has available; lower kv_cache_memory")
    per_block = kv_bytes_per_block(shape, config.block_size, config.dtype_bytes)
    min_blocks = -(-config.max_model_len // config.block_size)
    num_blocks = kv_bytes // per_block
    if num_blocks < min_blocks:
        raise DeviceMemoryError(
            f"kv_cache_memory {_gib(kv_bytes)}: {num_blocks} blocks, but {_one_sequence(config, per_block)}. "
            f"Raise kv_cache_memory or lower max_model_len")
    return KVPlan(num_blocks, per_block, num_blocks * per_block, kv_bytes, 0, 0, 0, 0, min_blocks)


# -- measurements on a device ----------------------------------------------------------
def device_memory(device: torch.device | str,
                  mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None) -> DeviceMemory:
    """The device's (free, total) now; call it before the model loads."""
    free, total = (mem_get_info or torch.cuda.mem_get_info)(torch.device(device))
    return DeviceMemory(int(free), int(total))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (tied weights counted once): pass the model's
    `parameters()` and `buffers()` to measure its weights."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def profile_activation_peak(forward: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes `forward` allocates beyond what is allocated before it: the runner passes
    one dummy forward of `max_num_batched_tokens` tokens (and the logits of its sampled
    rows), run before the KV cache exists."""
    device = torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)


def non_torch_bytes(device: torch.device | str, at_start: DeviceMemory,
                    mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None) -> int:
    """Device memory this process holds outside torch's caching allocator since `at_start`."""
    device = torch.device(device)
    now = device_memory(device, mem_get_info)
    used_since = at_start.free - now.free
    return max(0, used_since - torch.cuda.memory_reserved(device))


def plan_on_device(shape: ModelShape, config: MemoryPlanConfig, device: torch.device | str, at_start: DeviceMemory,
                   weights: Iterable[torch.Tensor], profile_forward: Callable[[], object],
                   mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None) -> KVPlan:
    """The runner's one call on CUDA: after the model (and its adapter rows) are on the
    device, before the KV cache exists. `at_start` is `device_memory(device)` read before
    the model loaded; `weights` the model's parameters and buffers."""
    peak = profile_activation_peak(profile_forward, device)
    measured = Measured(tensor_bytes(weights), peak, non_torch_bytes(device, at_start, mem_get_info))
    return plan_kv_cache(shape, config, at_start, measured)
