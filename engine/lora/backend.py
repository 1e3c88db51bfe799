"""The interface between the LoRA manager and the kernels that compute adapter deltas."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from .packing import PackedGroup


class LoRAHook(Protocol):
    """One step's adapter deltas, as the model calls them once per layer and group."""

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None: ...


class LoRABackend(ABC):
    """Resident adapters' weights in the layout one kind of kernel reads, one row (slot)
    per adapter, and the per-step hook that runs those kernels. One implementation per
    kernel backend (torch, C, Triton), chosen once at start by the engine's kernel backend.

    Contract:
    - Built with (num_slots, num_layers, in_sizes per group, out_sizes per module,
      max_rank, dtype, device); holds no adapter until `set_slot`.
    - `grows`: True when `set_slot` accepts any slot >= 0, growing the rows (amortised:
      a step never repacks them); False when the rows are allocated once for `num_slots`
      (CUDA graphs read them by address).
    - `set_slot(slot, packed)` replaces whatever `slot` held by one adapter as
      `packing.pack_adapter` made it. Called off the hot path, once per load.
    - `batch(segments)` is called once per step with the step's (start row, end row,
      slot) segments: non-empty, slot >= 0, disjoint, in row order, every slot loaded.
      The returned hook's `apply(layer, group, x, out)` adds in place, for each
      segment, out[rows] += (x[rows]·Aᵀ)·(B·scale)ᵀ of the slot's adapter over the
      group's modules (each module into its own output columns), equal to the
      per-segment torch loop (`torch_backend.LoRABatch`) within the dtype's rounding.
      Rows outside every segment are neither read for a delta nor written.
    """

    grows: ClassVar[bool] = True

    @abstractmethod
    def __init__(self, num_slots: int, num_layers: int, in_sizes: dict[str, int], out_sizes: dict[str, int],
                 max_rank: int, dtype: torch.dtype, device: torch.device | str) -> None: ...

    @abstractmethod
    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None: ...

    @abstractmethod
    def batch(self, segments: list[tuple[int, int, int]]) -> LoRAHook: ...
