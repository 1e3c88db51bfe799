"""Adapters resident on the device, as the scheduler sees them: plain data, no tensors.

An adapter's device copy takes pages of the KV pool (`BlockPool.hold_adapter`): how
many adapters a step runs is bounded by memory, not by a count of slots. Each resident
adapter also has a row, the index the LoRA backend stores its weights at; rows are
reused lowest first, so the rows a step reads stay a dense range. An adapter a running
or scheduled request uses is pinned and never evicted; an idle one stays resident until
the pool's LRU order reaches its pages (or, with a `max_rows` cap, until a row is
needed), so a request that comes back to it finds it loaded.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from ..request import AdapterRef
from .block_pool import BlockPool


class AdapterMemory:
    def __init__(self, pool: BlockPool, max_rows: int | None = None) -> None:
        self.pool = pool
        self.max_rows = max_rows  # None: bounded by memory only
        self._row_of: dict[str, int] = {}
        self._ref_of: dict[str, AdapterRef] = {}
        self._pins: dict[str, int] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # unpinned resident digests, LRU first
        self._free_rows: list[int] = []  # heap
        self._num_rows = 0  # rows ever handed out
        # What the runner holds in each row: a row reused by another adapter, or by one
        # that was evicted meanwhile, is loaded again.
        self._loaded: dict[int, str] = {}
        self._evicted: list[AdapterRef] = []
        pool.on_adapter_evicted = self._on_evicted

    def row_of(self, digest: str) -> int | None:
        return self._row_of.get(digest)

    def resident(self) -> dict[str, int]:
        """digest -> row of every adapter on the device, in use or idle."""
        return dict(self._row_of)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pinned(self, digest: str) -> bool:
        return digest in self._pins

    def can_acquire(self, digest: str, pages: int) -> bool:
        """Whether `acquire` would succeed now (`pages`: what the adapter takes if it is not resident)."""
        if digest in self._row_of:
            return True
        return pages <= self.pool.num_free_blocks and self._row_available()

    def acquire(self, ref: AdapterRef, pages: int) -> bool:
        """Pin `ref`, making it resident in `pages` pages if it is not; False, changing
        nothing, when the pool (or the row cap) has no room for it."""
        d = ref.digest
        if d in self._row_of:
            if d in self._idle:
                del self._idle[d]
                self.pool.pin_adapter(d)
            self._pins[d] = self._pins.get(d, 0) + 1
            return True
        if not self.can_acquire(d, pages):
            return False
        self.pool.hold_adapter(d, pages)  # may evict idle adapters: their rows free up first
        self._row_of[d], self._ref_of[d] = self._take_row(), ref
        self._pins[d] = 1
        return True

    def release(self, digest: str) -> None:
        n = self._pins[digest] - 1
        if n:
            self._pins[digest] = n
            return
        del self._pins[digest]
        self._idle[digest] = None
        self.pool.unpin_adapter(digest)

    def loads(self, refs: list[tuple[int, AdapterRef]]) -> list[tuple[int, AdapterRef]]:
        """Of the (row, adapter) pairs a step uses, those the runner must load first."""
        out = []
        for row, ref in refs:
            if self._loaded.get(row) != ref.digest:
                self._loaded[row] = ref.digest
                out.append((row, ref))
        return out

    def take_evicted(self) -> list[AdapterRef]:
        """Adapters evicted since the last call."""
        out, self._evicted = self._evicted, []
        return out

    def _row_available(self) -> bool:
        return bool(self._free_rows) or self.max_rows is None or self._num_rows < self.max_rows or bool(self._idle)

    def _take_row(self) -> int:
        # `acquire` made sure one is free, below the cap, or held by an idle adapter.
        if not self._free_rows and self.max_rows is not None and self._num_rows >= self.max_rows:
            self.pool.evict_adapter(next(iter(self._idle)))  # rows capped: the least recently used idle one
        if self._free_rows:
            return heapq.heappop(self._free_rows)
        self._num_rows += 1
        return self._num_rows - 1

    def _on_evicted(self, digest: str) -> None:
        assert digest not in self._pins, f"evicted adapter {digest} is in use"
        row = self._row_of.pop(digest)
        self._idle.pop(digest, None)
        if self._loaded.get(row) == digest:
            del self._loaded[row]
        heapq.heappush(self._free_rows, row)
        self._evicted.append(self._ref_of.pop(digest))
