"""The "cpu" kernel backend's LoRA backend: the torch backend's slot stacks, each step's
segments through the C kernel (lora.py's `CLoRABatch`), the long bf16 ones through oneDNN
from the crossover lora_choice.py measured on this CPU for the adapter's rank."""
from __future__ import annotations

import torch

from ...lora.backend import LoRAHook
from ...lora.packing import PackedGroup
from ...lora.torch_backend import TorchLoRABackend
from .lora import CLoRABatch
from .lora_choice import crossovers


class CLoRABackend(TorchLoRABackend):
    """The torch backend's slot stacks through the C kernel, but for the long bf16
    segments where oneDNN measured faster on this CPU (`crossovers`: rank -> rows, from
    lora_choice; None: every segment through the C kernel); bf16 B^T in rank pairs, the
    kernel's layout (the grouped torch path can still read them)."""

    def __init__(self, num_slots: int, num_layers: int, in_sizes: dict[str, int], out_sizes: dict[str, int],
                 max_rank: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(num_slots, num_layers, in_sizes, out_sizes, max_rank, dtype, device)
        self.crossovers = crossovers(self.dtype)
        self.slot_ranks: list[int] = [0] * num_slots  # each slot's largest module rank

    def rank_pairs(self) -> bool:
        return self.dtype == torch.bfloat16

    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None:
        super().set_slot(slot, packed)
        if slot >= len(self.slot_ranks):
            self.slot_ranks.extend([0] * (slot + 1 - len(self.slot_ranks)))
        self.slot_ranks[slot] = max((part[3] for layer in packed for g in layer.values() for part in g.parts),
                                    default=0)

    def torch_from_rows(self, slot: int) -> int | None:
        """The segment length from which `slot`'s adapter runs on oneDNN (None: never)."""
        return None if self.crossovers is None else self.crossovers.rows_for(self.slot_ranks[slot])

    def batch(self, segments: list[tuple[int, int, int]]) -> LoRAHook:
        return CLoRABatch(self.stacks, segments, self.packed,
                          None if self.crossovers is None else self.torch_from_rows)
