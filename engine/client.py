"""The boundary between the gateway and an engine: what the platform may ask of one.

`EngineClient` is the whole contract. The in-process `AsyncEngine` implements it; a
remote engine worker implements the same protocol over the network, so everything here is
plain data (dataclasses, strings, ints, token ids): no tensors, no callables, nothing a
worker in another process could not answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Protocol, runtime_checkable

from .request import AdapterRef, Lane, SamplingParams

if TYPE_CHECKING:
    from .output import RequestOutput


@dataclass(frozen=True)
class LaneDepth:
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class AdapterResidency:
    """Where adapter versions (content digests) are now; one in neither is on disk only."""

    device: tuple[str, ...] = ()  # in a device slot, servable this step
    cpu: tuple[str, ...] = ()  # in the CPU tier, one copy away from a slot

    def where(self) -> dict[str, str]:
        """digest -> "device" or "cpu"."""
        out = {d: "cpu" for d in self.cpu}
        out.update({d: "device" for d in self.device})
        return out


@dataclass(frozen=True)
class AdapterLoad:
    """One adapter load into a device slot; `seq` numbers an engine's loads from 1."""

    seq: int
    adapter: str
    seconds: float


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding so far (cumulative): verified draft runs, draft tokens, the
    tokens of them accepted, accepted tokens by draft position, and by adapter name ("" for
    the base model) (draft tokens, accepted tokens)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    by_adapter: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    """The model an engine serves: its limits, and the folder holding its config.json and
    tokenizer files (what another process needs to tokenize for it)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_dir: Path
    max_loras: int = 0  # device adapter slots; 0: this engine serves no adapters
    max_lora_rank: int = 64


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, taken between steps."""

    running: int = 0
    waiting: int = 0
    # Running requests paused for a streaming reader that fell behind or stopped reading
    # (async_engine.py): they hold their KV blocks and seats but take no steps.
    paused: int = 0
    lanes: dict[Lane, LaneDepth] = field(default_factory=lambda: {lane: LaneDepth() for lane in Lane})
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_blocks: int = 0
    block_size: int = 0  # tokens per KV block
    device: str = "cpu"  # where the model runs ("cpu", "cuda:0")
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # blocks looked up in the prefix cache
    prefix_cache_hits: int = 0
    adapters: AdapterResidency = AdapterResidency()
    max_loras: int = 0  # device adapter slots; 0: this engine serves no adapters
    max_cpu_loras: int = 0
    time: float = 0.0  # when the snapshot was taken (unix seconds)
    # Preemptions by the lane the victim ran at; adapter loads into device slots and
    # evictions from them by adapter name (cumulative); the latest loads, oldest first.
    preemptions_by_lane: dict[Lane, int] = field(default_factory=lambda: {lane: 0 for lane in Lane})
    adapter_loads: dict[str, int] = field(default_factory=dict)
    adapter_evictions: dict[str, int] = field(default_factory=dict)
    recent_adapter_loads: tuple[AdapterLoad, ...] = ()
    # The lane in front (engine/sched/lane_guard.py; None: one lane has all the work) and the
    # tokens of each step the lanes below it get now.
    foreground_lane: Lane | None = None
    background_step_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None  # None: speculation is off


@runtime_checkable
class EngineClient(Protocol):
    """What the gateway, metrics and admin views use of an engine, and nothing else.

    - `generate` streams one request's outputs (deltas) as `RequestOutput`s, the last one
      `finished`; closing the stream early aborts the request. It raises
      `InvalidRequestError` / `PromptTooLongError` / `UnknownAdapterError` for a request
      the engine refuses, `EngineDeadError` once the engine stopped. A request's adapter
      version that cannot be loaded (not found, its store unreachable, corrupted) raises
      before any output too (the adapters package's `AdapterError`s, or an engine error).
      `tenant` and `tenant_weight` place the request in tenant-fair order (a tenant over
      its share of the waiting queue gets `TenantShareExceededError`); after `timeout`
      seconds the engine ends it with finish reason "timeout".
    - `abort` ends a request at once (no error if it already finished).
    - `stats` returns the latest snapshot without waiting for a step.
    - `resolve_adapter` maps an adapter name to the version it runs now (raises
      `UnknownAdapterError`), so the version metered is the version run; None when the
      engine serves no adapters (it then refuses adapter requests itself).
    - `add_adapter` / `remove_adapter` change the adapters the engine can serve;
      `adapter_residency` tells where each version is. `prefetch_adapter` brings a
      version into the CPU tier (fetched from its store on first use; raises as
      `generate` would for a version that cannot be loaded, `UnknownAdapterError` when
      the engine serves no adapters); `drop_adapter` forgets a version's CPU-tier copy
      unless a request holds it (True when dropped).
    - `tokenizer`, `max_model_len` and `model_info` describe the model; `is_running` is False once the
      engine loop stopped; `shutdown` stops it.
    - `start` runs once inside the event loop that will use the client, before its first
      call, and `aclose` once at that loop's end (a remote client's connections and
      health poller live in the loop). Neither starts or stops the engine: whoever built
      the engine calls `shutdown`.
    """

    @property
    def tokenizer(self): ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_running(self) -> bool: ...

    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                 request_id: str | None = None, lane: Lane = Lane.STANDARD,
                 adapter: AdapterRef | None = None, cache_salt: str = "", tenant: str = "",
                 tenant_weight: float = 1.0, timeout: float | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def resolve_adapter(self, name: str) -> AdapterRef | None: ...

    def adapter_residency(self) -> AdapterResidency: ...

    def add_adapter(self, name: str, source: str | Path, *, replace: bool = False) -> AdapterRef: ...

    def remove_adapter(self, name: str) -> None: ...

    async def prefetch_adapter(self, ref: AdapterRef) -> None: ...

    def drop_adapter(self, digest: str) -> bool: ...

    def model_info(self) -> ModelInfo: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...
