"""One frozen config dataclass per subsystem, composed into `EngineConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field


DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct
# The KV pool on a CPU when neither a block count nor a size is given.
CPU_KV_CACHE_MEMORY = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    # A Hugging Face folder of safetensors, or "default" for the embedded SmolLM2.
    model: str = DEFAULT_MODEL
    # "bfloat16", "float16" or "float32". bf16: a GPU's native type, and the fastest on
    # AVX512-BF16 CPUs; the oracle tests use float32 so greedy ties cannot flip between implementations.
    dtype: str = "bfloat16"
    # None: the model's own max_position_embeddings.
    max_model_len: int | None = None
    # A torch device ("cpu", "cuda", "cuda:1"): `resolve_device` turns `--device` into one.
    device: str = "cpu"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Exactly this many KV blocks, or size the pool from `kv_cache_memory_bytes`.
    num_blocks: int | None = None
    # KV pool bytes. None: CPU_KV_CACHE_MEMORY on a CPU; on CUDA, what
    # `gpu_memory_utilization` of the device leaves after the weights, the adapter slots
    # and the activation peak (engine/runner/memory_budget.py).
    kv_cache_memory_bytes: int | None = None
    # The fraction of the GPU's memory loraplex may use (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    # The per-step token budget shared by decodes and prefill chunks.
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    # A waiting request climbs one lane per `aging_seconds` waited, up to the lane below
    # the foreground's (engine/sched/lane_guard.py): it orders the background lanes.
    aging_seconds: float = 5.0
    # A lane stays the foreground this long after its last request left.
    lane_hold_seconds: float = 60.0
    # While a foreground lane is held, the lanes below it run in steps sized (measured as
    # they run) to take about this long, so a foreground arrival waits little for the
    # step in flight; they are guaranteed that share, so they never starve.
    background_step_seconds: float = 0.05
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
        if not (self.lane_hold_seconds >= 0 and self.background_step_seconds > 0 and self.aging_seconds > 0):
            raise ValueError("lane_hold_seconds must be >= 0, background_step_seconds and aging_seconds > 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class LoRAConfig:
    # An optional cap on the adapters resident on the device at once. None: bounded by
    # memory only, their pages coming from the KV pool (a backend that allocates its rows
    # up front, Triton's, gets memory_budget.default_adapter_rows). The CPU tier holds more.
    max_loras: int | None = None
    max_cpu_loras: int = 32
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (or unset: no cap), got {self.max_loras}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): `method` "ngram" drafts the next
    tokens from the request's own prompt and output (prompt lookup: the latest earlier
    occurrence of its last `prompt_lookup_max`..`prompt_lookup_min` tokens, and what
    followed it), verified in the same step as every other request's work, with the
    request's own adapter. None: off."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram"):
            raise ValueError(f"unknown speculative method {self.method!r}; use 'ngram'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # torch intra-op threads; None leaves torch's default. A busy 2-core machine can be
    # 40x slower with too many threads, so the CLI always sets this.
    num_threads: int | None = None
    # "auto" picks Triton on CUDA and, on a CPU, the C decode-attention kernel where a C
    # compiler can build it (else the torch path); "triton", "cpu" or "torch" force one.
    kernels: str = "auto"
    seed: int = 0
    # Replay decode steps unless this is set: from CUDA graphs on CUDA (engine/runner/cuda_graphs.py),
    # as recorded C kernel calls on a CPU's "cpu" kernels (engine/runner/cpu_graphs.py).
    enforce_eager: bool = False
