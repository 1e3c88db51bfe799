"""Device slots for LoRA adapters, as the scheduler sees them: plain data, no tensors.

A slot holds one adapter's weights on the compute device. An adapter with running
requests is pinned and never evicted; unpinned slots are reused least recently used
first. The runner is told which adapter to load into which slot.
"""
from __future__ import annotations

from collections import OrderedDict

from .request import AdapterRef


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}  # digest -> slot
        self._ref_of: dict[int, AdapterRef] = {}
        self._pins: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # unpinned resident digests
        self._free = list(range(num_slots - 1, -1, -1))

    def slot_of(self, digest: str) -> int | None:
        return self._slot_of.get(digest)

    def resident(self) -> dict[int, AdapterRef]:
        return dict(self._ref_of)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def can_acquire(self, digest: str) -> bool:
        return digest in self._slot_of or bool(self._free) or bool(self._lru)

    def acquire(self, ref: AdapterRef) -> tuple[int, bool]:
        """Pin `ref` into a slot; returns (slot, needs_load). Caller checks can_acquire."""
        d = ref.digest
        slot = self._slot_of.get(d)
        load = False
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim, _ = self._lru.popitem(last=False)
                slot = self._slot_of.pop(victim)
            self._slot_of[d] = slot
            self._ref_of[slot] = ref
            load = True
        self._lru.pop(d, None)
        self._pins[d] = self._pins.get(d, 0) + 1
        return slot, load

    def release(self, digest: str) -> None:
        n = self._pins[digest] - 1
        if n:
            self._pins[digest] = n
        else:
            del self._pins[digest]
            self._lru[digest] = None
