"""What the LoRA manager loads adapters from: the contracts its sources keep (the disk
store, a worker's shared blob store, the platform's registry over both)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from loraplex.adapters import LoRAAdapter


@runtime_checkable
class AdapterSource(Protocol):
    """Where the manager gets adapter weights: by content digest.

    `load(digest, dtype)` returns the adapter whose content hashes to `digest`, verified,
    or raises (an `AdapterError`: not found, corrupted, invalid, store unreachable). It may
    do I/O: the manager calls it on its loader thread, and on the engine thread only when
    a CPU-tier copy was evicted between `ready()` and the slot load.
    """

    def load(self, digest: str, dtype: torch.dtype) -> LoRAAdapter: ...


class AdapterVersion(Protocol):
    """The version a name means now: its content digest, and its rank when known before
    loading (None: only the load tells, and it enforces the engine's max_lora_rank)."""

    @property
    def digest(self) -> str: ...

    @property
    def rank(self) -> int | None: ...


@runtime_checkable
class NamedAdapterSource(AdapterSource, Protocol):
    """A source that also resolves names to their current version: the disk store (an
    `AdapterRecord`), or the platform's registry when replicas share an adapter store.

    `get(name)` returns that version, or raises `AdapterNotFoundError` (or
    `UnknownAdapterError`) for a name it does not know. It runs on the caller's thread
    (a gateway's event loop), so it reads an index or a row, never adapter weights.
    """

    def get(self, name: str) -> AdapterVersion: ...
