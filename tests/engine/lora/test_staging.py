"""The manager's asynchronous adapter loads (engine/lora/staging.py), on a CPU.

On CUDA a copy completes when its event does; here a `GatedStager` plays the event's
part (each copy completes when the test opens its gate), so the state machine the
scheduler sees through `LoRAManager.ready` is checked step by step on a real engine:
a request waits for its own adapter's copy only, the others run meanwhile.
"""
from __future__ import annotations

import shutil
import threading
import time

import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.lora import LoRAManager
from loraplex.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class GatedCopy:
    def __init__(self, packed) -> None:
        self.packed, self.gate = packed, threading.Event()

    def done(self) -> bool:
        return self.gate.is_set()


class GatedStager:
    """A `staging.Stager` whose copies complete when the test opens their gates."""

    def __init__(self) -> None:
        self.copies: list[GatedCopy] = []
        self.taken: list[GatedCopy] = []

    def stage(self, packed) -> GatedCopy:
        copy = GatedCopy(packed)
        self.copies.append(copy)
        return copy

    def take(self, staged: GatedCopy):
        assert staged.done(), "a slot load took a copy still in flight"
        self.taken.append(staged)
        return staged.packed


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("staged")
    return {n: make_random_peft_adapter(tiny_llama_dir, root / n, rank=4 * (i + 1), seed=i + 1, init_scale=0.3)
            for i, n in enumerate(("a", "b", "c"))}


def _engine(model_dir, tmp_path, dirs, stager=None, max_loras=2) -> LLMEngine:
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(model_dir))
    for name, path in dirs.items():
        store.add(name, path)
    cfg = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                       cache=CacheConfig(block_size=8, num_blocks=64),
                       lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=8, max_lora_rank=16), kernels="torch")
    return LLMEngine(cfg, LoRAManager(store, cfg.lora, stager=stager))


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _run(engine: LLMEngine, rids: list[str]) -> dict[str, list[int]]:
    got = {r: [] for r in rids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        if engine.idle_step:
            time.sleep(0.002)
    return got


def test_a_request_waits_for_its_own_adapter_copy_only(tiny_llama_dir, tmp_path, adapter_dirs):
    prompt = [1000 + i for i in range(9)]
    ref_engine = _engine(tiny_llama_dir, tmp_path / "ref", adapter_dirs)
    assert ref_engine.lora.stager is None  # a CPU engine stages nothing: the path as it always was
    ref = _run(ref_engine, [ref_engine.add_request(prompt, GREEDY, request_id="base"),
                            ref_engine.add_request(prompt, GREEDY, request_id="a", adapter="a")])
    ref_engine.lora.close()

    stager = GatedStager()
    engine = _engine(tiny_llama_dir, tmp_path / "staged", adapter_dirs, stager)
    lora = engine.lora
    digest = lora.ref("a").digest
    engine.add_request(prompt, GREEDY, request_id="a", adapter="a")
    engine.add_request(prompt, GREEDY, request_id="base")
    _wait(lambda: lora.staged() == {digest: False}, "the copy of a to start")
    got = {"a": [], "base": []}
    while engine.has_unfinished_requests() and len(got["base"]) < GREEDY.max_tokens:
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    # The base request ran to the end while a's copy was in flight; a was never scheduled.
    assert got == {"a": [], "base": ref["base"]}
    assert not lora.ready(lora.ref("a")) and lora.tiers()["device"] == []
    assert engine.scheduler.requests["a"].num_computed_tokens == 0

    stager.copies[0].gate.set()  # the copy completes
    assert lora.ready(lora.ref("a"))
    got["a"] = _run(engine, ["a"])["a"]
    assert got["a"] == ref["a"]
    assert stager.taken == stager.copies and lora.staged() == {} and lora.tiers()["device"] == [digest]
    lora.close()


def test_staging_is_bounded_and_dropped_when_nobody_waits(tiny_llama_dir, tmp_path, adapter_dirs):
    stager = GatedStager()
    engine = _engine(tiny_llama_dir, tmp_path, adapter_dirs, stager, max_loras=2)
    lora = engine.lora
    digests = {n: lora.ref(n).digest for n in adapter_dirs}
    for n in adapter_dirs:
        engine.add_request([2000, 2001, 2002], GREEDY, request_id=n, adapter=n)
    # At most max_loras copies on their way at once; the third waits in the CPU tier.
    _wait(lambda: len(lora.staged()) == 2 and len(lora.tiers()["cpu"]) == 3, "two copies and the CPU tier")
    for _ in range(3):
        engine.step()
        assert len(stager.copies) == 2 and all(r.num_output_tokens == 0 for r in engine.scheduler.requests.values())
    first = next(n for n, d in digests.items() if d in lora.staged())
    engine.abort_request(first)  # nobody waits for its copy any more: it is dropped
    _wait(lambda: engine.step() is not None and len(stager.copies) == 3, "the third copy to start in the freed room")
    assert first not in {n for n, d in digests.items() if d in lora.staged()}
    for copy in stager.copies:
        copy.gate.set()
    rest = [n for n in adapter_dirs if n != first]
    got = _run(engine, rest)
    assert all(len(got[n]) == GREEDY.max_tokens for n in rest)
    assert lora.staged() == {}
    lora.close()


def test_a_failed_load_fails_its_request_not_the_engine(tiny_llama_dir, tmp_path, adapter_dirs):
    stager = GatedStager()
    engine = _engine(tiny_llama_dir, tmp_path, adapter_dirs, stager)
    lora = engine.lora
    ref = lora.ref("b")
    shutil.rmtree(tmp_path / "store")  # the adapter's files are gone before its first load
    engine.add_request([3000, 3001], GREEDY, request_id="b", adapter=ref)
    _wait(lambda: lora.failed(), "the load to fail")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("b", "error")]
    assert "could not be loaded" in outs[0].stop_reason and lora.staged() == {} and stager.copies == []
    assert not engine.has_unfinished_requests()
    lora.close()
