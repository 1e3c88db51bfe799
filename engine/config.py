"""One frozen config dataclass per subsystem, composed into `EngineConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct


@dataclass(frozen=True)
class ModelConfig:
    # A Hugging Face folder of safetensors, or "default" for the embedded SmolLM2.
    model: str = DEFAULT_MODEL
    # "bfloat16", "float16" or "float32". bf16 is fastest on AVX512-BF16 CPUs;
    # the oracle tests use float32 so greedy ties cannot flip between implementations.
    dtype: str = "bfloat16"
    # None: the model's own max_position_embeddings.
    max_model_len: int | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Exactly this many KV blocks, or size the pool from `kv_cache_memory_bytes`.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    # The per-step token budget shared by decodes and prefill chunks.
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    # A waiting request climbs one lane per `aging_seconds` waited, so batch never starves.
    aging_seconds: float = 5.0
    # "continuous" (iteration-level) or "static" (a batch admitted only when the previous
    # one has fully finished): the baseline the benchmarks compare against.
    policy: str = "continuous"
    # Requests queued beyond this are refused (EngineOverloadedError, HTTP 503).
    max_waiting: int = 4096
    # Order inside a lane: "fair" shares it between tenants by weighted tokens served
    # (virtual token counter), "fcfs" by arrival.
    scheduling: str = "fair"
    # With "fair": the fraction of max_waiting one tenant of weight 1 may fill (scaled by
    # its weight); beyond it its requests are refused (TenantShareExceededError, HTTP 429).
    tenant_queue_share: float = 0.25

    def __post_init__(self) -> None:
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
        if self.scheduling not in ("fair", "fcfs"):
            raise ValueError(f"unknown scheduling order {self.scheduling!r}; use fair or fcfs")
        if not 0 < self.tenant_queue_share <= 1:
            raise ValueError("tenant_queue_share must be in (0, 1]")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class LoRAConfig:
    # Adapters computable in one step (device slots); the CPU tier holds more.
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_lora_rank: int = 64


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # torch intra-op threads; None leaves torch's default. A busy 2-core machine can be
    # 40x slower with too many threads, so the CLI always sets this.
    num_threads: int | None = None
    # "auto" picks Triton on CUDA and, on a CPU, the C decode-attention kernel where a C
    # compiler can build it (else the torch path); "triton", "cpu" or "torch" force one.
    kernels: str = "auto"
    seed: int = 0
