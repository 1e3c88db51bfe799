"""The LoRA manager: adapter names, the CPU tier, the device copies.

Adapters have three tiers: their source (the disk store; a worker's shared blob store;
or, for `serve` replicas sharing a store, the registry's names over both), a CPU tier
(LRU, loaded in the background) and the device, whose weights the LoRA backend
(`backend.LoRABackend`, chosen once by the engine's kernel backend) holds in its
kernels' layout, one row per resident adapter. Which adapters are resident is the
scheduler's decision (`engine/sched/adapter_memory.py`: their pages come from the KV pool);
the manager materialises them in the rows it is told. On CUDA an adapter also passes
through staging (staging.py): copied to the device in the background, it is `ready`
only once that copy has completed.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from concurrent.futures import Future

import torch

from ..config import LoRAConfig
from ..errors import InvalidRequestError, UnknownAdapterError
from ..mixtures import is_mixture, resolve_mixture
from ..request import AdapterRef
from ..threads import serial_torch_executor
from .backend import LoRABackend, LoRAHook
from .epilogue import BaseWeights, module_epilogues
from .mixtures import MixtureRecipes
from .packing import pack_adapter, projection_sizes, segments_of
from .saved_modules import SavedBatch, SavedModuleSlots, to_device
from .sizing import entry_device_bytes, max_lora_device_bytes
from .sources import AdapterSource, NamedAdapterSource
from .staging import CudaStager, StagedAdapter, Stager
from .torch_backend import TorchLoRABackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Residence:
    """Where one adapter's weights are: "device" (resident, in a backend row) or "cpu"
    (the CPU tier only); `pinned`: a request holds it, so it is not evicted."""

    name: str | None  # the name it was last asked for by, None when only its digest is known
    tier: str
    pinned: bool


# Rows a growing backend starts with (it doubles when more adapters are resident).
INITIAL_ROWS = 8


class LoRAManager:
    """Resolves adapter names, keeps the CPU tier, fills device rows.

    `store`: an `AdapterSource`; names resolve (`ref`) only through a `NamedAdapterSource`.
    A source without names (a worker's blob store) serves requests that carry an
    `AdapterRef`, whose digest the manager fetches on first use.
    """

    def __init__(self, store: AdapterSource, config: LoRAConfig | None = None,
                 stager: Stager | None = None) -> None:
        self.store = store
        self.config = config or LoRAConfig()
        # digest -> (LoRAAdapter, its epilogues: epilogue.module_epilogues), LRU
        self._cpu: OrderedDict[str, tuple] = OrderedDict()
        self._live: dict[str, int] = {}  # digest -> requests holding it (never evicted)
        self._pending: dict[str, object] = {}  # digest -> Future of a background load
        self._failed: dict[str, str] = {}  # digest -> why loading failed
        self._lock = threading.Lock()
        self._pool = serial_torch_executor(1, thread_name_prefix="loraplex-lora-load")  # see engine/threads.py
        self._rows: dict[int, AdapterRef] = {}  # device row -> the adapter loaded there
        self._device: dict[str, int] = {}  # digest -> its device row
        self._bytes: dict[str, int] = {}  # digest -> device bytes of its weights (CPU-tier adapters)
        self._names: dict[str, str] = {}  # digest -> the name a request last used it by
        self.mixtures = MixtureRecipes()  # how to build the mixtures requests named
        self.backend: LoRABackend | None = None
        self.base_weights: BaseWeights | None = None  # what DoRA's rescale is computed from
        # The most adapters resident at once: None, bounded by memory (the backend's rows
        # grow); else `max_loras`, or a preallocated backend's row count.
        self.max_rows: int | None = self.config.max_loras
        # digest -> its copy to the device (None while the loader thread prepares it);
        # at most `max_staged` at once, each as large as a row at most.
        self.stager = stager
        self._staged: dict[str, StagedAdapter | None] = {}
        self.max_staged = self.config.max_loras or INITIAL_ROWS

    def bind(self, arch, dtype: torch.dtype, device: torch.device,
             backend: type[LoRABackend] = TorchLoRABackend, fixed_rows: int | None = None,
             base_weights: BaseWeights | None = None) -> None:
        """Make the device rows for `arch`; `backend`: the kernel backend's LoRA backend.
        A backend that cannot grow (`grows` False: CUDA graphs read its rows by address)
        gets `max_loras` rows, else `fixed_rows`. `base_weights`: the base model's
        projections, read once per DoRA adapter (None: DoRA adapters are refused)."""
        self.base_weights = base_weights
        self.in_sizes, self.out_sizes = projection_sizes(arch)
        self.num_layers, self.dtype, self.device = arch.num_layers, dtype, device
        if backend.grows:
            rows = min(self.config.max_loras or INITIAL_ROWS, INITIAL_ROWS)
        else:
            rows = self.max_rows = self.config.max_loras or fixed_rows or INITIAL_ROWS
        self.backend = backend(rows, arch.num_layers, self.in_sizes, self.out_sizes,
                               self.config.max_lora_rank, dtype, device)
        self.saved = SavedModuleSlots()  # modules_to_save, trainable tokens
        if self.stager is None and torch.device(device).type == "cuda":
            self.stager = CudaStager(torch.device(device))

    # -- names and lifetimes ---------------------------------------------------------
    def ref(self, name: str) -> AdapterRef:
        """The current version of the adapter (or mixture: engine/mixtures.py) `name` names."""
        from loraplex.adapters import AdapterError, AdapterNotFoundError

        if is_mixture(name):
            return resolve_mixture(name, self.ref)
        if not isinstance(self.store, NamedAdapterSource):
            raise UnknownAdapterError(f"the adapter {name!r} does not exist (this engine resolves no names)")
        try:
            record = self.store.get(name)
        except (AdapterNotFoundError, AdapterError):
            raise UnknownAdapterError(f"the adapter {name!r} does not exist") from None
        if record.rank is not None and record.rank > self.config.max_lora_rank:
            raise InvalidRequestError(f"adapter {name!r} has rank {record.rank}, above this engine's "
                                      f"max_lora_rank {self.config.max_lora_rank}")
        return AdapterRef(name, record.digest)

    def retain(self, ref: AdapterRef) -> None:
        """A request holds `ref` until release(): its weights stay loadable even if the
        adapter is replaced or removed from the store meanwhile."""
        self.mixtures.know(ref)
        with self._lock:
            self._live[ref.digest] = self._live.get(ref.digest, 0) + 1
            self._names[ref.digest] = ref.name
        self.ready(ref)

    def release(self, digest: str) -> None:
        with self._lock:
            n = self._live.get(digest, 0) - 1
            if n > 0:
                self._live[digest] = n
            else:
                self._live.pop(digest, None)
                self._failed.pop(digest, None)
                self._forget(digest)
                if self._staged.get(digest) is not None:
                    del self._staged[digest]  # nobody waits for it (an in-flight one is dropped when done)
            self._trim()

    # -- the CPU tier ----------------------------------------------------------------
    def ready(self, ref: AdapterRef) -> bool:
        """True when `ref` can go onto the device now (in the CPU tier; with a stager,
        copied to the device); else start what it waits for."""
        d = ref.digest
        with self._lock:
            if d in self._failed or d in self._device:
                return d not in self._failed
            if d in self._cpu and self.stager is None:
                return True
            if d in self._staged:
                staged = self._staged[d]
                return staged is not None and staged.done()
            if d in self._cpu:
                # Staging may be full: asked again at the next step.
                if self._reserve_staging(d):
                    self._pool.submit(self._stage, d, self._cpu[d])
            elif d not in self._pending:
                self._pending[d] = self._pool.submit(self._load_to_cpu, d)
        return False

    def prefetch(self, adapter: AdapterRef | str) -> Future:
        """Bring `adapter` (a ref, or a digest) into the CPU tier off the engine thread.
        The future's result is None once it is there; its exception is the source's when
        it cannot be loaded. Each caller gets a future of its own: cancelling it (a client
        that left) leaves the load to the others waiting for it."""
        digest = self.mixtures.know(adapter)
        with self._lock:
            done: Future = Future()
            if digest in self._cpu or digest in self._device:
                done.set_result(None)
                return done
            if digest in self._failed:
                if digest in self._live:  # requests wait on this failure: they fail first
                    done.set_exception(UnknownAdapterError(
                        f"adapter {digest} could not be loaded: {self._failed[digest]}"))
                    return done
                del self._failed[digest]  # nobody holds it: try again
            if digest not in self._pending:
                self._pending[digest] = self._pool.submit(self._load_to_cpu, digest)
            return _follow(self._pending[digest])

    def drop(self, digest: str) -> bool:
        """Forget the CPU-tier copy of `digest` unless a request holds it; True if dropped."""
        with self._lock:
            if digest in self._live:
                return False
            self._failed.pop(digest, None)
            dropped = self._cpu.pop(digest, None) is not None
            self._forget(digest)
            return dropped

    def refuse(self, digest: str, reason: str) -> None:
        """Fail the requests of `digest` (the engine cannot hold it): as a failed load does."""
        log.warning("adapter %s refused: %s", digest, reason)
        with self._lock:
            self._failed[digest] = reason

    def failed(self) -> dict[str, str]:
        with self._lock:
            return dict(self._failed)

    def _fetch(self, digest: str) -> tuple:
        """A CPU-tier entry from the source: the adapter and its epilogues, computed once."""
        adapter = self.mixtures.load(self.store, digest, self.dtype, self.config.max_lora_rank)
        return adapter, module_epilogues(adapter, self.base_weights)

    def _pack(self, entry: tuple, device: torch.device):
        return pack_adapter(entry[0], self.out_sizes, self.num_layers, self.dtype, device, entry[1])

    def _load_to_cpu(self, digest: str) -> None:
        try:
            adapter = self._fetch(digest)
        except Exception as exc:  # the request fails, the engine does not
            self._load_failed(digest, "loading", exc)
            raise  # into the future, for prefetch() callers
        with self._lock:
            self._cpu[digest] = adapter
            self._cpu.move_to_end(digest)
            self._bytes[digest] = entry_device_bytes(adapter, self.dtype)
            self._pending.pop(digest, None)
            stage = self._reserve_staging(digest)
            self._trim()
        if stage:
            self._stage(digest, adapter)

    # -- staging (CUDA): copies to the device ahead of a slot ----------------------------
    def _reserve_staging(self, digest: str) -> bool:
        """Under the lock: room for the copy of `digest`, which a request waits for,
        reserved (None until it is issued)."""
        if (self.stager is None or digest in self._staged or digest not in self._live
                or len(self._staged) >= self.max_staged):
            return False
        self._staged[digest] = None
        return True

    def _stage(self, digest: str, adapter) -> None:
        """The loader thread: issue the reserved copy of `adapter` to the device."""
        try:
            staged = self.stager.stage(self._pack(adapter, torch.device("cpu")))
        except Exception as exc:
            self._load_failed(digest, "copying to the device", exc)
            return
        with self._lock:
            if digest in self._live:
                self._staged[digest] = staged
            else:
                self._staged.pop(digest, None)  # released while it was copied

    def _load_failed(self, digest: str, doing: str, exc: Exception) -> None:
        log.warning("%s adapter %s failed: %s", doing, digest, exc)
        with self._lock:
            self._failed[digest] = str(exc)
            self._pending.pop(digest, None)
            self._staged.pop(digest, None)

    def _trim(self) -> None:
        # LRU, skipping adapters that live requests still need.
        for d in list(self._cpu):
            if len(self._cpu) <= self.config.max_cpu_loras:
                return
            if d not in self._live:
                del self._cpu[d]
                self._forget(d)

    def _forget(self, digest: str) -> None:
        """Under the lock: what is known of an adapter in neither tier any more."""
        if digest not in self._cpu and digest not in self._device and digest not in self._live:
            self._bytes.pop(digest, None)
            self._names.pop(digest, None)

    def device_bytes(self, ref: AdapterRef) -> int:
        """Device bytes of `ref`'s weights at its own ranks (what its pages hold); known once
        it is in the CPU tier (`ready`), else the largest an adapter may take."""
        with self._lock:
            known = self._bytes.get(ref.digest)
        return known if known is not None else max_lora_device_bytes(
            self.in_sizes, self.out_sizes, self.num_layers, self.config.max_lora_rank, self.dtype)

    # -- device rows -----------------------------------------------------------------
    def load(self, loads: list[tuple[int, AdapterRef]]) -> None:
        for row, ref in loads:
            with self._lock:
                adapter = self._cpu.get(ref.digest)
                if adapter is not None:
                    self._cpu.move_to_end(ref.digest)
                staged = self._staged.get(ref.digest)
                if staged is not None and staged.done():
                    del self._staged[ref.digest]
                else:
                    staged = None
            if adapter is None:  # not prefetched (e.g. evicted meanwhile): load inline
                adapter = self._fetch(ref.digest)
            packed = self.stager.take(staged) if staged is not None else self._pack(adapter, self.device)
            self.backend.set_slot(row, packed)
            self.saved.set_slot(row, to_device(getattr(adapter[0], "saved", None), self.dtype, self.device))
            with self._lock:
                old = self._rows.get(row)
                if old is not None and self._device.get(old.digest) == row:
                    del self._device[old.digest]
                self._rows[row], self._device[ref.digest] = ref, row
                self._names[ref.digest] = ref.name

    def evict(self, refs: list[AdapterRef]) -> None:
        """The scheduler gave these adapters' pages back: they are no longer on the device
        (their rows keep stale weights until reused, never read meanwhile)."""
        with self._lock:
            for ref in refs:
                row = self._device.pop(ref.digest, None)
                if row is not None and self._rows.get(row) == ref:
                    del self._rows[row]
                self._forget(ref.digest)

    def batch(self, seqs: list[tuple[int, int]]) -> LoRAHook | None:
        """`seqs`: (num tokens, row) in batch order -> the step's hook, None without adapters."""
        segments = segments_of(seqs)
        return self.backend.batch(segments) if segments else None

    def saved_batch(self, seqs: list[tuple[int, int]]) -> SavedBatch | None:
        """As `batch`: the step's rows of adapters with saved modules, None without."""
        return self.saved.batch(segments_of(seqs)) if self.saved.slots else None

    def tiers(self) -> dict[str, list[str]]:
        """Where each adapter is now: on the device (resident, in use or idle), CPU tier (digests)."""
        with self._lock:
            return {"device": list(self._device), "cpu": list(self._cpu)}

    def residency(self) -> dict[str, Residence]:
        """Every adapter on the device or in the CPU tier, by digest: its tier ("device"
        wins over "cpu") and whether a request holds it (pinned). Adapters in neither
        are in the store only."""
        with self._lock:
            out = {d: Residence(self._names.get(d), "cpu", d in self._live) for d in self._cpu}
            out.update({d: Residence(self._names.get(d), "device", d in self._live) for d in self._device})
            return out

    def staged(self) -> dict[str, bool]:
        """Adapters on their way to the device: digest -> whether the copy has completed."""
        with self._lock:
            return {d: s is not None and s.done() for d, s in self._staged.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _follow(shared: Future) -> Future:
    """A future with `shared`'s outcome whose cancellation does not reach `shared`."""
    mine: Future = Future()

    def copy(done: Future) -> None:
        if done.cancelled():  # the pool shut down
            mine.cancel()
        elif mine.set_running_or_notify_cancel():  # False: its caller cancelled it
            if done.exception() is not None:
                mine.set_exception(done.exception())
            else:
                mine.set_result(done.result())

    shared.add_done_callback(copy)
    return mine
