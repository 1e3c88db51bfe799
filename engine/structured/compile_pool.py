"""Grammar compiles for every tenant, on a few threads of their own, fairly, with a deadline.

A request's grammar is compiled before the request is queued (the async layer awaits
`CompilePool.compile`), so the engine thread only ever receives a compiled grammar.

- Bounded: `threads` workers; a tenant may have `max_per_tenant` compiles queued or
  running, more are refused (`GrammarQueueFullError`, 429).
- Fair: each tenant has its own queue; a free worker takes the next tenant in turn
  (round robin), and never a tenant that already has a compile running, so one tenant's
  slow schemas hold at most one worker while other tenants' compiles go ahead.
- Deadline: a request waits `deadline` seconds. A compile that started and is still
  running then is refused as too complex (`GrammarTimeoutError`, 400); one that never
  started (every worker busy) as overload (`GrammarPoolBusyError`, 503). The compile
  itself cannot be interrupted: it finishes into the cache and keeps its tenant's slot
  until then, so the cost stays with its sender.
  One that waited behind its own tenant's running compile is that tenant's share
  (`GrammarShareBusyError`, 429).
- Cached: compiled grammars (and compiles in flight) by the spec's SHA-256; a request
  whose spec is cached or compiling waits on that one, queuing nothing.
- Low priority: the workers run at `nice` (19 by default), so a compile takes only the
  CPU that serving leaves. A schema within every cap may still take seconds of a core:
  at normal priority, one tenant's compiles slowed another's streaming ~1.8x on 2 cores
  with the engine on both (`benchmarks/bench_isolation.py`, costly schemas).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import EngineOverloadedError, InvalidRequestError
from ..errors import TenantShareExceededError
from .spec import StructuredOutput

log = logging.getLogger(__name__)


class GrammarTimeoutError(InvalidRequestError):
    """The schema's grammar did not compile within the deadline (the API answers 400)."""

    code = "grammar_compile_timeout"


class GrammarPoolBusyError(EngineOverloadedError):
    """No compile worker was free for the request before its deadline (503, retry)."""


class GrammarShareBusyError(TenantShareExceededError):
    """The request's compile never started: its tenant's own earlier compile held the
    tenant's one worker until the deadline (429, retry after it)."""


class GrammarQueueFullError(TenantShareExceededError):
    """The tenant already has its share of compiles queued or running (429)."""


@dataclass
class _Job:
    spec: StructuredOutput
    key: str
    tenant: str
    future: Future


def spec_hash(spec: StructuredOutput) -> str:
    kind, text, strict = spec.key
    return hashlib.sha256(f"{kind}\0{int(strict)}\0{text}".encode()).hexdigest()


class CompilePool:
    def __init__(self, compile_fn: Callable[[StructuredOutput], Any], *, threads: int = 2,
                 deadline: float = 10.0, max_per_tenant: int = 4, cache_size: int = 256, nice: int = 19) -> None:
        """`nice`: the workers' scheduling priority (Linux nice, per thread: 0 normal, 19
        lowest); never raised above the process's own."""
        if threads < 1 or max_per_tenant < 1 or cache_size < 1 or not deadline > 0:
            raise ValueError("threads, max_per_tenant and cache_size must be >= 1, deadline > 0")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice}")
        self._compile_fn = compile_fn
        self.nice = nice
        self.deadline = deadline
        self.max_per_tenant = max_per_tenant
        self._cache_size = cache_size
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenants in turn order
        self._running: set[str] = set()
        self._held: Counter[str] = Counter()  # compiles queued or running, per tenant
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._closed = False
        self.hits = self.misses = 0
        self._threads = [threading.Thread(target=self._work, name=f"loraplex-grammar-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, spec: StructuredOutput, tenant: str = "") -> Future:
        """The compiled grammar's future (the cached one when there is one)."""
        key = spec_hash(spec)
        with self._cond:
            if self._closed:
                raise EngineOverloadedError("the grammar compile pool is shut down")
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
            if self._held[tenant] >= self.max_per_tenant:
                raise GrammarQueueFullError(
                    f"tenant {tenant!r} already has {self._held[tenant]} schema compiles queued or running, "
                    f"the cap is {self.max_per_tenant} (max_compiles_per_tenant); retry after they finish")
            fut = Future()
            self.misses += 1
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._held[tenant] += 1
            self._queues.setdefault(tenant, deque()).append(_Job(spec, key, tenant, fut))
            self._cond.notify()
        return fut

    async def compile(self, spec: StructuredOutput, tenant: str = "") -> Any:
        """The compiled grammar, awaited for at most `deadline` seconds."""
        fut = self.submit(spec, tenant)
        if fut.done():
            return fut.result()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.deadline)
        except asyncio.TimeoutError:
            raise self._late(fut, tenant) from None

    def compile_now(self, spec: StructuredOutput, tenant: str = "") -> Any:
        """`compile` for a caller without an event loop (a blocking wait on this thread)."""
        fut = self.submit(spec, tenant)
        try:
            return fut.result(self.deadline)
        except TimeoutError:
            raise self._late(fut, tenant) from None

    def _late(self, fut: Future, tenant: str) -> Exception:
        if fut.running() or fut.done():
            return GrammarTimeoutError(f"the schema's grammar did not compile within the {self.deadline:g} s "
                                       "deadline (compile_deadline); simplify the schema")
        with self._cond:
            own = tenant in self._running
        if own:
            return GrammarShareBusyError(f"tenant {tenant!r}'s earlier schema compile was still running after "
                                         f"{self.deadline:g} s, and a tenant compiles one schema at a time; "
                                         "retry after it finishes")
        return GrammarPoolBusyError(f"no grammar compile worker was free within {self.deadline:g} s; retry")

    # -- workers ------------------------------------------------------------------
    def _next(self) -> _Job | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                for tenant, queue in self._queues.items():
                    if queue and tenant not in self._running:
                        self._running.add(tenant)
                        return queue.popleft()
                self._cond.wait()

    def _work(self) -> None:
        _lower_priority(self.nice)
        while (job := self._next()) is not None:
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(self._compile_fn(job.spec))
                except Exception as exc:  # the request's own error (a schema the builder refuses)
                    job.future.set_exception(exc)
            with self._cond:
                self._running.discard(job.tenant)
                # To the back of the turn order: tenants that queued while this compile ran go first.
                if self._queues.get(job.tenant):
                    self._queues.move_to_end(job.tenant)
                else:
                    self._queues.pop(job.tenant, None)
                self._held[job.tenant] -= 1
                if not self._held[job.tenant]:
                    del self._held[job.tenant]
                failed = job.future.cancelled() or job.future.exception() is not None
                if failed and self._cache.get(job.key) is job.future:
                    del self._cache[job.key]  # failures are not cached: the next request retries
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.cancel()
            self._queues.clear()
            self._cond.notify_all()


def _lower_priority(nice: int) -> None:
    """This thread's nice value to `nice` (Linux keeps one per thread), where allowed."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):  # no per-thread priority here: compiles run at the process's
        log.debug("grammar compile workers keep the process's priority", exc_info=True)
