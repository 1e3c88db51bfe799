"""The grammar compile pool: round-robin between tenants, one running compile per tenant,
a per-tenant cap, the deadline, and real xgrammar compiles through it."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.compile_pool import (
    CompilePool,
    GrammarPoolBusyError,
    GrammarQueueFullError,
    GrammarShareBusyError,
    GrammarTimeoutError,
)
from loraplex.engine.structured.grammar import GrammarCompiler
from loraplex.engine.tokenizer import Tokenizer


def _spec(tag: str) -> StructuredOutput:
    return StructuredOutput.json_schema({"type": "object", "title": tag,
                                         "properties": {"a": {"type": "integer"}}, "required": ["a"]})


class Recorder:
    """Real compiles, in the order the pool ran them; a spec in `held` waits for its gate."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.order: list[str] = []
        self.held: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}

    def hold(self, tag: str) -> threading.Event:
        self.started[tag] = threading.Event()
        self.held[tag] = threading.Event()
        return self.held[tag]

    def __call__(self, spec: StructuredOutput):
        tag = spec_tag(spec)
        self.order.append(tag)
        if tag in self.held:
            self.started[tag].set()
            self.held[tag].wait()
        return self.compiler.compile(spec)


def spec_tag(spec: StructuredOutput) -> str:
    import json
    return json.loads(spec.spec)["title"]


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir) -> GrammarCompiler:
    tok = Tokenizer(tiny_llama_dir)
    return GrammarCompiler(tok, tok.vocab_size)


def test_tenants_take_turns_however_many_one_queued(compiler):
    rec = Recorder(compiler)
    gate = rec.hold("a0")
    pool = CompilePool(rec, threads=1, max_per_tenant=8)
    try:
        futures = [pool.submit(_spec("a0"), "a")]
        rec.started["a0"].wait()
        futures += [pool.submit(_spec(f"a{i}"), "a") for i in range(1, 5)]
        futures += [pool.submit(_spec("b0"), "b"), pool.submit(_spec("c0"), "c"), pool.submit(_spec("b1"), "b")]
        gate.set()
        for f in futures:
            f.result(timeout=120)
        # After a0: b and c each get a turn before a's second compile, b's second after a1.
        assert rec.order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    finally:
        gate.set()
        pool.close()


def test_a_tenant_with_a_compile_running_never_takes_a_second_worker(compiler):
    rec = Recorder(compiler)
    gate = rec.hold("a0")
    pool = CompilePool(rec, threads=2)
    try:
        a0 = pool.submit(_spec("a0"), "a")
        rec.started["a0"].wait()
        a1 = pool.submit(_spec("a1"), "a")
        b0 = pool.submit(_spec("b0"), "b")
        b0.result(timeout=120)  # the free worker served b, not a's second compile
        assert not a0.done() and not a1.running() and not a1.done()
        gate.set()
        a1.result(timeout=120)
        assert rec.order == ["a0", "b0", "a1"]
    finally:
        gate.set()
        pool.close()


def test_one_tenant_over_its_cap_is_refused_and_others_are_not(compiler):
    rec = Recorder(compiler)
    gate = rec.hold("a0")
    pool = CompilePool(rec, threads=1, max_per_tenant=2)
    try:
        pool.submit(_spec("a0"), "a")
        pool.submit(_spec("a1"), "a")
        with pytest.raises(GrammarQueueFullError, match="max_compiles_per_tenant"):
            pool.submit(_spec("a2"), "a")
        assert pool.submit(_spec("a0"), "a") is not None  # a cached (in flight) spec queues nothing
        b0 = pool.submit(_spec("b0"), "b")
        gate.set()
        b0.result(timeout=120)
        pool.submit(_spec("a2"), "a").result(timeout=120)  # its slots came back
    finally:
        gate.set()
        pool.close()


def test_deadline_refuses_a_compile_still_running_and_one_never_started(compiler):
    rec = Recorder(compiler)
    gate = rec.hold("a0")
    # Long enough for the nice-19 worker to be scheduled and start a0 on a loaded machine
    # (at 0.05 s it sometimes had not, and a0 was refused as busy instead of timing out).
    pool = CompilePool(rec, threads=1, deadline=1.0)
    try:
        with pytest.raises(GrammarTimeoutError, match="compile_deadline"):
            asyncio.run(pool.compile(_spec("a0"), "a"))
        with pytest.raises(GrammarPoolBusyError):
            asyncio.run(pool.compile(_spec("b0"), "b"))
        gate.set()
        # The late compile finished into the cache: the same schema is served from it.
        pool.submit(_spec("a0"), "a").result(timeout=120)
        hits = pool.hits
        asyncio.run(pool.compile(_spec("a0"), "a"))
        assert pool.hits == hits + 1
    finally:
        gate.set()
        pool.close()


def test_a_failed_compile_is_not_cached(compiler):
    pool = CompilePool(compiler.compile, threads=1)
    bad = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    try:
        first = pool.submit(bad, "a")
        with pytest.raises(Exception):
            first.result(timeout=120)
        assert pool.submit(bad, "a") is not first
    finally:
        pool.close()


def test_a_request_behind_its_own_tenants_compile_is_that_tenants_share_not_overload(compiler):
    rec = Recorder(compiler)
    gate, other = rec.hold("a0"), rec.hold("b0")
    pool = CompilePool(rec, threads=2, deadline=0.05)
    try:
        pool.submit(_spec("a0"), "a")
        rec.started["a0"].wait()
        # The other worker is free, but a tenant compiles one schema at a time: a's own 429.
        with pytest.raises(GrammarShareBusyError, match="one schema at a time"):
            asyncio.run(pool.compile(_spec("a1"), "a"))
        pool.submit(_spec("b0"), "b")
        rec.started["b0"].wait()
        # Both workers busy, c has nothing running: the server's load (503).
        with pytest.raises(GrammarPoolBusyError):
            asyncio.run(pool.compile(_spec("c0"), "c"))
    finally:
        gate.set()
        other.set()
        pool.close()


def test_compiles_run_at_the_lowest_priority():
    """A schema within every cap can take seconds of a core to compile: at nice 19 that
    is only the CPU the engine and the event loop leave."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def priority(spec):
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    pool = CompilePool(priority, threads=2)
    try:
        assert pool.submit(_spec("x"), "a").result(timeout=60) == 19
        assert pool.submit(_spec("y"), "b").result(timeout=60) == 19
    finally:
        pool.close()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's thread is untouched
    with pytest.raises(ValueError, match="nice"):
        CompilePool(priority, nice=20)
