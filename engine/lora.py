"""Multi-LoRA: adapter tiers (device slots, CPU tier, disk store) and batched compute.

Tokens of one step are ordered so each adapter's tokens are contiguous (one segment in
the decode group, one in the prefill group). Per segment and per layer, LoRA runs as a
shrink `x·A` and an expand `(x·A)·B` on the projections that share an input (q/k/v,
o, gate/up, down): the work is per segment, not per token, and base-model rows are
never touched. The Triton kernels plug in behind the same `LoRABatch.apply`.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .config import LoRAConfig
from .errors import InvalidRequestError, UnknownAdapterError
from .request import AdapterRef

log = logging.getLogger(__name__)

# Projections that read the same input share one shrink.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class PackedGroup:
    a: torch.Tensor  # [sum of ranks, in] — every module's A stacked
    b_fused: torch.Tensor  # [sum of out features, sum of ranks] block-diagonal, scale folded in
    # Per module: (output column offset, output width, rank offset, rank, B*scale [out, r]).
    parts: list[tuple[int, int, int, int, torch.Tensor]]


def pack_adapter(adapter, out_sizes: dict[str, int], num_layers: int, dtype: torch.dtype,
                 device: torch.device) -> list[dict[str, PackedGroup]]:
    """Per layer, per group: the adapter's weights in the layout `LoRABatch` computes with."""
    layers: list[dict[str, PackedGroup]] = []
    for layer in range(num_layers):
        groups = {}
        for g, modules in GROUPS.items():
            a_parts, parts, col, roff = [], [], 0, 0
            for m in modules:
                w = adapter.weights.get((layer, m))
                if w is not None:
                    b = (w.b.float() * w.scale).to(dtype=dtype, device=device)
                    a_parts.append(w.a.to(dtype=dtype, device=device))
                    parts.append((col, out_sizes[m], roff, w.rank, b))
                    roff += w.rank
                col += out_sizes[m]
            if not parts:
                continue
            fused = torch.zeros(col, roff, dtype=dtype, device=device)
            for c, width, r0, r, b in parts:
                fused[c:c + width, r0:r0 + r] = b
            groups[g] = PackedGroup(torch.cat(a_parts).contiguous(), fused, parts)
        layers.append(groups)
    return layers


def segments_of(seqs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(num tokens, slot) per sequence in batch order -> (start row, end row, slot) for each
    run of rows with the same adapter slot; base-model rows (slot < 0) are left out."""
    segments: list[tuple[int, int, int]] = []
    row = 0
    for n, slot in seqs:
        if slot >= 0:
            if segments and segments[-1][2] == slot and segments[-1][1] == row:
                segments[-1] = (segments[-1][0], row + n, slot)
            else:
                segments.append((row, row + n, slot))
        row += n
    return segments


class LoRABatch:
    """One step's adapter segments; `apply` adds the deltas in place."""

    def __init__(self, slots: list[list[dict[str, PackedGroup]] | None], segments: list[tuple[int, int, int]]):
        self.slots = slots
        self.segments = segments  # (start row, end row, slot), slot >= 0 only

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        for start, end, slot in self.segments:
            packed = self.slots[slot][layer].get(group)
            if packed is None:
                continue
            s = x[start:end] @ packed.a.T  # shrink: [rows, sum of ranks]
            # One block-diagonal expand for q/k/v (gate/up), added in place: the zero blocks
            # at most triple a LoRA expand (under 1% of the base projections' work even for
            # a 1024-token chunk), while each extra call costs tens of microseconds.
            out[start:end].addmm_(s, packed.b_fused.T)


class LoRAManager:
    """Resolves adapter names, keeps the CPU tier, fills device slots."""

    def __init__(self, store, config: LoRAConfig | None = None) -> None:
        self.store = store
        self.config = config or LoRAConfig()
        self._cpu: OrderedDict[str, object] = OrderedDict()  # digest -> LoRAAdapter (LRU)
        self._live: dict[str, int] = {}  # digest -> requests holding it (never evicted)
        self._pending: dict[str, object] = {}  # digest -> Future of a background load
        self._failed: dict[str, str] = {}  # digest -> why loading failed
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-lora-load")
        self.slots: list[list[dict[str, PackedGroup]] | None] = [None] * self.config.max_loras
        self.slot_refs: list[AdapterRef | None] = [None] * self.config.max_loras
        # When the Triton kernels run LoRA, the runner sets this to a
        # kernels.lora_kernels.StackedLoRAWeights: slots are mirrored into it, batches use it.
        self.kernel_weights = None
        # Otherwise (the torch path) slots are mirrored into lora_batch.SlotStacks, made on
        # the first load, so a step's short segments run as a few grouped ops; the runner
        # sets cpu_kernels when the "cpu" backend runs them in C (kernels/cpu_lora.c).
        self.stacks = None
        self.cpu_kernels = False

    def bind(self, arch, dtype: torch.dtype, device: torch.device) -> None:
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        h, i = arch.hidden_size, arch.intermediate_size
        self.out_sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h,
                          "gate_proj": i, "up_proj": i, "down_proj": h}
        self.in_sizes = {"qkv": h, "o": q, "gate_up": h, "down": i}
        self.num_layers, self.dtype, self.device = arch.num_layers, dtype, device

    # -- names and lifetimes ---------------------------------------------------------
    def ref(self, name: str) -> AdapterRef:
        from loraplex.adapters import AdapterError, AdapterNotFoundError

        try:
            record = self.store.get(name)
        except (AdapterNotFoundError, AdapterError):
            raise UnknownAdapterError(f"the adapter {name!r} does not exist") from None
        if record.rank > self.config.max_lora_rank:
            raise InvalidRequestError(f"adapter {name!r} has rank {record.rank}, above this engine's "
                                      f"max_lora_rank {self.config.max_lora_rank}")
        return AdapterRef(name, record.digest)

    def retain(self, ref: AdapterRef) -> None:
        """A request holds `ref` until release(): its weights stay loadable even if the
        adapter is replaced or removed from the store meanwhile."""
        with self._lock:
            self._live[ref.digest] = self._live.get(ref.digest, 0) + 1
        self.ready(ref)

    def release(self, digest: str) -> None:
        with self._lock:
            n = self._live.get(digest, 0) - 1
            if n > 0:
                self._live[digest] = n
            else:
                self._live.pop(digest, None)
                self._failed.pop(digest, None)
            self._trim()

    # -- the CPU tier ----------------------------------------------------------------
    def ready(self, ref: AdapterRef) -> bool:
        """True when `ref` can go into a device slot now; else start loading it."""
        d = ref.digest
        with self._lock:
            if d in self._cpu or d in self._failed or any(r and r.digest == d for r in self.slot_refs):
                return d not in self._failed
            if d not in self._pending:
                self._pending[d] = self._pool.submit(self._load_to_cpu, d)
        return False

    def failed(self) -> dict[str, str]:
        with self._lock:
            return dict(self._failed)

    def _load_to_cpu(self, digest: str) -> None:
        try:
            adapter = self.store.load(digest, dtype=self.dtype)
        except Exception as exc:  # the request fails, the engine does not
            log.warning("loading adapter %s failed: %s", digest, exc)
            with self._lock:
                self._failed[digest] = str(exc)
                self._pending.pop(digest, None)
            return
        with self._lock:
            self._cpu[digest] = adapter
            self._cpu.move_to_end(digest)
            self._pending.pop(digest, None)
            self._trim()

    def _trim(self) -> None:
        # LRU, skipping adapters that live requests still need.
        for d in list(self._cpu):
            if len(self._cpu) <= self.config.max_cpu_loras:
                return
            if d not in self._live:
                del self._cpu[d]

    # -- device slots ----------------------------------------------------------------
    def load(self, loads: list[tuple[int, AdapterRef]]) -> None:
        for slot, ref in loads:
            with self._lock:
                adapter = self._cpu.get(ref.digest)
                if adapter is not None:
                    self._cpu.move_to_end(ref.digest)
            if adapter is None:  # not prefetched (e.g. evicted meanwhile): load inline
                adapter = self.store.load(ref.digest, dtype=self.dtype)
            self.slots[slot] = pack_adapter(adapter, self.out_sizes, self.num_layers, self.dtype, self.device)
            self.slot_refs[slot] = ref
            if self.kernel_weights is not None:
                self.kernel_weights.set_slot(slot, self.slots[slot])
            else:
                self._stacks().set_slot(slot, self.slots[slot])

    def _stacks(self):
        if self.stacks is None:
            from .lora_batch import SlotStacks  # lora_batch imports this module

            self.stacks = SlotStacks(self.config.max_loras, self.num_layers, self.in_sizes, self.out_sizes,
                                     self.dtype, self.device)
        return self.stacks

    def batch(self, seqs: list[tuple[int, int]]) -> LoRABatch | None:
        """`seqs`: (num tokens, slot) in batch order -> segments of equal slot."""
        segments = segments_of(seqs)
        if not segments:
            return None
        if self.kernel_weights is not None:
            return self.kernel_weights.batch(segments)
        from .lora_batch import GroupedLoRABatch

        return GroupedLoRABatch(self._stacks(), self.slots, segments, c_kernel=self.cpu_kernels)

    def tiers(self) -> dict[str, list[str]]:
        """Where each adapter is now: device slots, CPU tier (digests)."""
        with self._lock:
            return {"device": [r.digest for r in self.slot_refs if r], "cpu": list(self._cpu)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
