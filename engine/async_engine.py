"""Asyncio bridge: the step loop runs on its own thread; outputs stream per request.

The event loop never runs model code. Commands (add, abort) cross to the engine thread
through a queue and are applied between steps, so the engine itself needs no locks.

Given a function that builds the engine, the engine thread builds and warms it up too,
and is then the only thread that ever ran the model. On a CPU that matters: each thread
that calls into torch's OpenMP kernels keeps a team of worker threads for its life, and
once the teams hold more threads than the machine has cores, libgomp's workers stop
spinning between parallel regions and sleep instead. A decode step runs hundreds of
short regions, each then waiting for its workers to wake: an engine built on the main
thread and stepped on this one served ~0.76x the tokens/s (380 against 500 on 2 cores).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from .client import AdapterResidency, EngineStats, ModelInfo
from .engine import LLMEngine, RequestOutput
from .errors import EngineDeadError, InvalidRequestError, StreamStalledError, UnknownAdapterError
from .request import AdapterRef, Lane, SamplingParams

log = logging.getLogger(__name__)
# Outputs one request may have waiting for its reader; past it the request is aborted (a
# reader that stops reading would otherwise grow its queue for its whole max_tokens).
MAX_STREAM_BACKLOG = 1024
# Well before that, a request whose reader fell this far behind is paused (it costs the
# batch nothing while its reader stalls), and resumed once its reader has taken them all.
PAUSE_BACKLOG = 256
# A request whose reader has been away this long with the last output it took (blocked
# sending it to a client that stopped reading) is paused however short its backlog, so a
# stalled client stops costing the batch within a second of its connection's buffers
# filling. Readers waiting for output never count, so an event loop that stalls does not
# pause everyone.
STALL_SECONDS = 1.0


@dataclass(slots=True)
class _Stream:
    """One request's output queue and where its reader is."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    away_since: float | None = None  # monotonic time it took its last output; None while waiting


class AsyncEngine:
    """The in-process `EngineClient`: an `LLMEngine` stepped on its own thread."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_stream_backlog: int = MAX_STREAM_BACKLOG,
                 pause_backlog: int = PAUSE_BACKLOG, stall_seconds: float = STALL_SECONDS) -> None:
        """`engine`, or a function that builds (and warms up) one on the engine thread:
        returns once it is built, raising what building raised."""
        self.max_stream_backlog = max_stream_backlog
        self.pause_backlog = pause_backlog
        self.stall_seconds = stall_seconds
        self._paused: set[str] = set()  # streams paused for their reader (engine thread writes)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # call() futures whose command has not completed: failed too if the loop stops
        # first (a command queued as the loop exits would otherwise never run).
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stop = False
        self._dead: BaseException | None = None
        built = threading.Event()
        failed: list[BaseException] = []

        def main() -> None:
            try:
                self.engine = engine() if callable(engine) else engine
                self._stats: EngineStats = self.engine.stats()
            except BaseException as exc:
                failed.append(exc)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=main, name="loraplex-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            raise failed[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stop

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self._stats

    def model_info(self) -> ModelInfo:
        e = self.engine
        info = ModelInfo(e.max_model_len, e.arch.vocab_size, tuple(e.tokenizer.eos_token_ids), e.model_dir)
        if e.lora is None:
            return info
        return dataclasses.replace(info, max_loras=e.lora.config.max_loras, max_lora_rank=e.lora.config.max_lora_rank)

    # -- adapters -----------------------------------------------------------------------
    def resolve_adapter(self, name: str) -> AdapterRef | None:
        lora = self.engine.lora
        return None if lora is None else lora.ref(name)

    def adapter_residency(self) -> AdapterResidency:
        """Read from the LoRA manager now: its CPU tier fills on a loader thread, between
        the stats snapshots, and routers and metrics should see a load as it completes."""
        lora = self.engine.lora
        if lora is None:
            return self._stats.adapters
        tiers = lora.tiers()
        return AdapterResidency(tuple(tiers["device"]), tuple(tiers["cpu"]))

    def add_adapter(self, name: str, source: str | Path, *, replace: bool = False) -> AdapterRef:
        record = self._disk_store().add(name, source, replace=replace)
        return AdapterRef(name, record.digest)

    def remove_adapter(self, name: str) -> None:
        self._disk_store().remove(name)

    async def prefetch_adapter(self, ref: AdapterRef) -> None:
        """Loads off the engine thread (the LoRA manager's loader)."""
        if self.engine.lora is None:
            raise UnknownAdapterError("this engine serves no adapters")
        await asyncio.wrap_future(self.engine.lora.prefetch(ref))

    def drop_adapter(self, digest: str) -> bool:
        return self.engine.lora is not None and self.engine.lora.drop(digest)

    def _disk_store(self) -> Any:
        """The disk store the engine resolves names in; a source that resolves them
        elsewhere (a registry replicas share) is written through the platform instead."""
        if self.engine.lora is None:
            raise UnknownAdapterError("this engine serves no adapters")
        store = self.engine.lora.store
        if not (hasattr(store, "add") and hasattr(store, "remove")):
            raise InvalidRequestError("this engine's adapter names come from a shared registry: publish adapters "
                                      "through the platform (admin API or `loraplex adapter add`)")
        return store

    # -- the engine thread ---------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.stats()  # aborts while idle show at once
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if self.engine.idle_step:
                    # Nothing runnable yet: let loader threads work; when every request
                    # waits for its reader, a resume wakes the loop.
                    self._wake.wait(0.05 if len(self._paused) >= len(self.engine.scheduler.requests) else 0.002)
                    self._wake.clear()
                self._stats = self.engine.stats()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the loop is dead: fail every stream, loudly
            log.exception("engine loop failed")
            self._dead = exc
        finally:
            self._fail_all(EngineDeadError("the engine is shutting down" if self._dead is None
                                           else f"the engine stopped: {self._dead!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        q = entry.queue
        ongoing = not isinstance(item, BaseException) and not item.finished
        if ongoing and q.qsize() >= self.max_stream_backlog:
            # The outputs already queued are still read (and billed); then the stream ends.
            self.engine.abort_request(request_id)
            item = StreamStalledError(f"the reader of request {request_id} fell more than "
                                      f"{self.max_stream_backlog} outputs behind; the request was aborted")
        elif ongoing and request_id not in self._paused and (q.qsize() >= self.pause_backlog or self._stalled(entry)):
            self._paused.add(request_id)
            self.engine.pause_request(request_id, True)
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
            self._paused.discard(request_id)
        try:
            entry.loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed; nobody is listening

    def _stalled(self, entry: _Stream) -> bool:
        away = entry.away_since
        return away is not None and time.monotonic() - away >= self.stall_seconds

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, exc)
        for key in list(self._calls):
            entry = self._calls.pop(key, None)
            if entry is not None:
                self._settle(*entry, exc=exc)

    @staticmethod
    def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
                exc: BaseException | None = None) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(result)
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass  # the caller's loop is closed; nobody is waiting

    def _submit(self, cmd: Callable[[], None]) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self._commands.put(cmd)
        self._wake.set()

    # -- the public API -------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                       request_id: str | None = None, lane: Lane | str = Lane.STANDARD,
                       adapter: str | AdapterRef | None = None, cache_salt: str = "", tenant: str = "",
                       tenant_weight: float = 1.0, timeout: float | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Closing the iterator early aborts the request."""
        rid = request_id or uuid.uuid4().hex
        if isinstance(adapter, AdapterRef) and self.engine.lora is not None:
            # Loaded off the engine thread first (from a shared store: fetched on first
            # use), so a version that cannot be had is refused here with the source's
            # error, before any output, as an engine worker refuses it.
            loaded = self.engine.lora.prefetch(adapter)
            if loaded.done():  # resident already (or failed): no round trip through the loop
                loaded.result()
            else:
                await asyncio.wrap_future(loaded)
        grammar = None
        if sampling is not None and sampling.structured_output is not None:
            # Compiled here, in the tenant-fair pool, so the engine thread gets it ready-made.
            grammar = await self.engine.grammar_pool.compile(sampling.structured_output, tenant)
        if rid in self._streams:
            # Checked before registering: replacing the entry would hand the other stream's
            # outputs to this one (and its error, or our abort, to the other request).
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        entry = self._streams[rid] = _Stream(asyncio.get_running_loop(), q)

        def add() -> None:
            try:
                self.engine.add_request(prompt, sampling, request_id=rid, lane=lane, adapter=adapter,
                                        cache_salt=cache_salt, tenant=tenant, tenant_weight=tenant_weight,
                                        timeout=timeout, grammar=grammar)
            except Exception as exc:  # a bad request fails alone, not the loop
                self._deliver(rid, exc)

        finished = resuming = False
        try:
            self._submit(add)
            while True:
                entry.away_since = None
                resuming = resuming and rid in self._paused
                if not resuming and rid in self._paused and q.empty():
                    resuming = True
                    self._commands.put(lambda: self._resume(rid))
                    self._wake.set()
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                entry.away_since = time.monotonic()
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def _resume(self, request_id: str) -> None:
        if request_id in self._paused:
            self._paused.discard(request_id)
            self.engine.pause_request(request_id, False)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.is_running:
            self._commands.put(lambda: (self._paused.discard(request_id), self.engine.abort_request(request_id)))
            self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (e.g. adapter changes)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        key = next(self._call_ids)

        def cmd() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:
                self._calls.pop(key, None)
                self._settle(loop, fut, exc=exc)
            else:
                self._calls.pop(key, None)
                self._settle(loop, fut, result)

        # Registered before the liveness check in _submit, as streams are, so a loop that
        # stops after the check still finds (and fails) this call.
        self._calls[key] = (loop, fut)
        try:
            self._submit(cmd)
            return await fut
        finally:
            self._calls.pop(key, None)

    async def start(self) -> None:
        """Nothing to bind to the caller's loop: the engine thread runs from construction."""

    async def aclose(self) -> None:
        """Nothing bound to the caller's loop; `shutdown` stops the engine thread."""

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
