"""Adapter weights on their way from the CPU tier to the device, off the engine's step.

On CUDA the manager's loader thread packs an adapter of the CPU tier, pins it and copies
it to the device on a dedicated copy stream, recording one event per adapter. The
scheduler admits a request only once its adapter's event has completed
(`LoRAManager.ready`), so the slot load in the step that first uses the adapter is a
device-to-device copy, and no step waits for a copy it does not use. On a CPU nothing is
staged: the slot load packs straight from the CPU tier.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .packing import PackedGroup

Packed = list[dict[str, PackedGroup]]  # per layer, per group: `packing.pack_adapter`'s result


class StagedAdapter(Protocol):
    """One adapter's packed weights in flight to the device."""

    def done(self) -> bool:
        """True once the copy has completed (never blocks)."""
        ...


class Stager(Protocol):
    """Copies packed adapters to the device asynchronously.

    Contract: `stage(packed)` is called on the manager's loader thread with host tensors
    and returns at once, the copy in flight; `take(staged)`, called on the engine thread
    only after `staged.done()`, returns the packed weights on the device, safe to read on
    the engine's current stream for as long as they are referenced.
    """

    def stage(self, packed: Packed) -> StagedAdapter: ...

    def take(self, staged: StagedAdapter) -> Packed: ...


def map_packed(packed: Packed, fn) -> Packed:
    """`packed` with `fn` applied to every tensor of its data."""
    return [{g: p.with_tensors([fn(t) for t in p.tensors()]) for g, p in layer.items()} for layer in packed]


class CudaStagedAdapter:
    def __init__(self, packed: Packed, host: Packed, event: torch.cuda.Event) -> None:
        self.packed, self.event = packed, event
        self.host = host  # the pinned sources live until the copy is taken

    def done(self) -> bool:
        return self.event.query()


class CudaStager:
    """Pinned host memory, one copy stream, an event per adapter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def stage(self, packed: Packed) -> CudaStagedAdapter:
        host = map_packed(packed, lambda t: t.pin_memory())
        with torch.cuda.stream(self.stream):
            on_device = map_packed(host, lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaStagedAdapter(on_device, host, event)

    def take(self, staged: CudaStagedAdapter) -> Packed:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(staged.event)  # already complete: orders the streams for the allocator too
        # Allocated on the copy stream, read on this one from now on: the allocator must
        # not hand their memory to the copy stream again before this stream is done.
        for layer in staged.packed:
            for group in layer.values():
                for t in group.tensors():
                    t.record_stream(current)
        return staged.packed
