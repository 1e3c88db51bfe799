"""The scheduler driven without a model: fake sampled tokens, a fake clock, a fake runner.

`Harness.step()` plays the engine: schedule, check every invariant of the plan, "execute"
it on a simulated KV store (each slot remembers which token prefix wrote it, so a
prefix-cache hit over KV nobody computed is caught when attention "reads" it), then
`update()` with fake tokens.
"""
from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest

from loraplex.engine.sched.adapter_memory import AdapterMemory
from loraplex.engine.sched.block_pool import BlockPool, KVCacheManager
from loraplex.engine.config import SchedulerConfig
from loraplex.engine.errors import EngineOverloadedError, PromptTooLongError
from loraplex.engine.request import AdapterRef, Lane, Request, RequestStatus, SamplingParams
from loraplex.engine.sched.scheduler import Scheduler, SchedulerOutput

EOS = 2
I, S, B = Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def ref(name: str) -> AdapterRef:
    return AdapterRef(name, f"digest-{name}")


def fake_token(req: Request) -> int:
    """Deterministic per (request, position), never EOS: what a greedy model would do."""
    return 10 + zlib.crc32(f"{req.request_id}:{req.num_tokens}".encode()) % 1000


class Harness:
    def __init__(self, *, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 512,
                 max_loras: int | None = 2, pages: int | dict[str, int] = 1, prefix: bool = True,
                 **sched) -> None:
        sched.setdefault("max_num_batched_tokens", 64)
        self.kv = KVCacheManager(num_blocks, block_size, prefix)
        self.config = SchedulerConfig(**sched)
        # Pool blocks per adapter: one figure, or per adapter name (default 1).
        self.pages = pages if isinstance(pages, dict) else {}
        default_pages = pages if isinstance(pages, int) else 1
        self.s = Scheduler(self.config, self.kv, max_model_len, max_loras,
                           adapter_pages=lambda r: self.pages.get(r.name, default_pages))
        self.clock = Clock()
        self.s.clock = self.clock
        self.bs = block_size
        self.max_loras = max_loras
        self.device_kv: dict[tuple[int, int], tuple] = {}  # (block, offset) -> who wrote it
        self.device_slots: dict[int, AdapterRef] = {}  # what the fake runner has loaded
        self.reqs: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.n = 0

    # -- requests -----------------------------------------------------------------------
    def add(self, prompt_len: int = 8, *, prompt: list[int] | None = None, rid: str | None = None,
            lane: Lane = S, max_tokens: int = 4, adapter: str | None = None, salt: str = "",
            ignore_eos: bool = True, **sampling) -> Request:
        self.n += 1
        rid = rid or f"r{self.n}"
        if prompt is None:
            prompt = [100 + (self.n * 131 + i * 7) % 30000 for i in range(prompt_len)]
        self.clock.advance(1e-3)  # distinct arrival times, in order of adding
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling),
                      lane, ref(adapter) if adapter else None, salt, (EOS,), arrival_time=self.clock())
        self.s.add_request(req)
        self.reqs[rid] = req
        return req

    def abort(self, rid: str) -> None:
        req = self.s.finish(rid, RequestStatus.FINISHED_ABORTED)
        assert req is not None and req.status is RequestStatus.FINISHED_ABORTED and req.block_ids == []
        self.check_state()

    # -- one engine step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.check_plan(out)
        self.check_state()
        return out

    def execute_and_update(self, out: SchedulerOutput, token=fake_token, dt: float = 0.0) -> list[Request]:
        if out.seqs:  # the engine skips the runner when nothing is scheduled
            self.execute(out)
        sampled = {seq.request_id: [token(self.s.requests[seq.request_id])]
                   for seq in out.seqs if seq.sample and seq.request_id in self.s.requests}
        done = self.s.update(out, sampled)
        for r in done:
            assert r.status.finished and r.block_ids == [] and r.request_id not in self.s.requests
            self.finished[r.request_id] = r
        self.clock.advance(dt)
        self.check_state()
        return done

    def step(self, token=fake_token, dt: float = 0.0) -> SchedulerOutput:
        out = self.schedule()
        self.execute_and_update(out, token, dt)
        return out

    def run(self, max_steps: int = 1000, dt: float = 0.0) -> int:
        for n in range(max_steps):
            if not self.s.has_unfinished():
                return n
            self.step(dt=dt)
        raise AssertionError(f"not finished after {max_steps} steps: {self.s.lane_counts()}")

    # -- the fake runner ------------------------------------------------------------------
    def _kv_id(self, req: Request, pos: int) -> tuple:
        # A position's KV depends on the salt-free content: adapter and every token up to it.
        return req.adapter_digest, tuple(req.token_slice(0, pos + 1))

    def execute(self, out: SchedulerOutput) -> None:
        for ref in out.adapter_evictions:
            self.device_slots = {r: a for r, a in self.device_slots.items() if a != ref}
        for slot, ref in out.adapter_loads:
            assert slot >= 0 and (self.max_loras is None or slot < self.max_loras)
            self.device_slots[slot] = ref
        for seq in out.seqs:  # every write of the step lands before any read
            req = self.reqs[seq.request_id]  # an in-flight abort still runs its plan
            for p in range(seq.start_pos, seq.start_pos + len(seq.token_ids)):
                self.device_kv[seq.block_ids[p // self.bs], p % self.bs] = self._kv_id(req, p)
        for seq in out.seqs:
            req = self.reqs[seq.request_id]
            if req.adapter is None:
                assert seq.adapter_slot == -1
            else:
                assert self.device_slots.get(seq.adapter_slot) == req.adapter, "stale adapter in slot"
            for p in range(seq.start_pos + len(seq.token_ids)):
                got = self.device_kv.get((seq.block_ids[p // self.bs], p % self.bs))
                assert got == self._kv_id(req, p), f"{req.request_id} reads wrong KV at position {p}"

    # -- invariants ---------------------------------------------------------------------
    def check_plan(self, out: SchedulerOutput) -> None:
        assert out.num_tokens <= self.config.max_num_batched_tokens
        ids = [seq.request_id for seq in out.seqs]
        assert len(ids) == len(set(ids))
        for seq in out.seqs:
            req = self.s.requests[seq.request_id]
            n = len(seq.token_ids)
            assert req.status is RequestStatus.RUNNING and req in self.s.running
            assert n >= 1 and seq.start_pos == req.num_computed_tokens
            assert seq.token_ids == req.token_slice(seq.start_pos, seq.start_pos + n)
            assert seq.sample == (seq.start_pos + n == req.num_tokens)
            assert seq.block_ids == req.block_ids
            assert seq.start_pos + n <= len(seq.block_ids) * self.bs, "tokens overflow the block table"
            assert len(seq.block_ids) == self.kv.blocks_needed(seq.start_pos + n)
            if not self.config.enable_chunked_prefill:
                assert seq.sample, "chunked prefill is off: the whole remainder or nothing"
            if req.adapter is not None:
                assert seq.adapter_slot == self.s.adapters.row_of(req.adapter.digest) >= 0
        if out.adapter_loads:
            assert out.seqs, "adapter loads in a plan the engine will not execute"

    def check_state(self) -> None:
        s, pool = self.s, self.kv.pool
        pool.check_invariants()
        assert len(s.running) <= self.config.max_num_seqs
        refs = Counter(b for r in s.running for b in r.block_ids)
        running_adapters = {r.adapter.digest for r in s.running if r.adapter}
        refs.update(b for d in running_adapters for b in pool.adapter_pages(d))  # in use: pinned
        for b in range(pool.num_blocks):
            assert pool.ref_cnt[b] == refs.get(b, 0), f"block {b}: ref {pool.ref_cnt[b]} != holders {refs.get(b, 0)}"
        for r in s.waiting:
            assert r.status is RequestStatus.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_ids) >= self.kv.blocks_needed(r.num_computed_tokens)
        assert {r.request_id for r in s.running} | {r.request_id for r in s.waiting} == set(s.requests)
        assert len(s.running) + len(s.waiting) == len(s.requests)
        assert self.max_loras is None or len(s.adapters.resident()) <= self.max_loras
        for d in running_adapters:
            assert s.adapters.row_of(d) is not None and s.adapters.pinned(d)
        assert s.adapters.num_pinned == len(running_adapters)
        rows = list(s.adapters.resident().values())
        assert len(rows) == len(set(rows)), "two resident adapters share a row"

    def assert_all_free(self) -> None:
        assert not self.s.requests and not self.s.running and not self.s.waiting
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks  # idle adapters' pages are free
        assert self.s.adapters.num_pinned == 0
        self.kv.pool.check_invariants()


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {seq.request_id: len(seq.token_ids) for seq in out.seqs}


# -- continuous batching and the token budget --------------------------------------------
def test_a_finished_slot_is_refilled_the_next_step():
    h = Harness(max_num_seqs=2)
    short, long_, third = h.add(max_tokens=1), h.add(max_tokens=5), h.add()
    out = h.step()
    assert scheduled(out) == {short.request_id: 8, long_.request_id: 8}
    assert short.request_id in h.finished and short.status is RequestStatus.FINISHED_LENGTH
    out = h.step()
    assert scheduled(out) == {long_.request_id: 1, third.request_id: 8}
    h.run()
    h.assert_all_free()


def test_budget_is_shared_by_decodes_and_prefill_chunks():
    h = Harness(max_num_batched_tokens=16)
    d1, d2 = h.add(4, max_tokens=20), h.add(4, max_tokens=20)
    h.step()
    big = h.add(40, max_tokens=2)
    chunks = []
    while big.num_computed_tokens < 40:
        out = h.step()
        assert scheduled(out)[d1.request_id] == 1 and scheduled(out)[d2.request_id] == 1, "decodes continue"
        chunks.append(scheduled(out)[big.request_id])
        assert out.num_tokens == 2 + chunks[-1] <= 16
    assert chunks == [14, 14, 12]
    assert big.num_output_tokens == 1
    h.run()
    assert all(r.num_output_tokens == r.sampling.max_tokens for r in (d1, d2, big))
    h.assert_all_free()


def test_prefill_only_samples_at_the_end_of_the_prompt():
    h = Harness(max_num_batched_tokens=5)
    r = h.add(12, max_tokens=3)
    outs = [h.step() for _ in range(3)]
    assert [(s.start_pos, len(s.token_ids), s.sample) for o in outs for s in o.seqs] == [
        (0, 5, False), (5, 5, False), (10, 2, True)]
    assert r.num_output_tokens == 1
    h.run()
    h.assert_all_free()


def test_chunked_prefill_disabled_whole_prompt_or_nothing():
    h = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    d1, d2 = h.add(4, max_tokens=3), h.add(4, max_tokens=3)
    h.step()
    big = h.add(15, max_tokens=2)  # 15 > 16 - 2 decodes: waits for a step with room
    small = h.add(2, max_tokens=2)
    out = h.step()
    assert scheduled(out) == {d1.request_id: 1, d2.request_id: 1}, "nobody jumps the head of the queue"
    h.step()  # d1, d2 finish here
    out = h.step()
    assert scheduled(out)[big.request_id] == 15
    h.run()
    assert big.num_output_tokens == 2 and small.num_output_tokens == 2
    h.assert_all_free()


def test_chunked_prefill_disabled_rejects_what_can_never_fit_a_step():
    h = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    h.add(10, max_tokens=7)  # 16 tokens in one step at worst: fine
    with pytest.raises(PromptTooLongError):
        h.add(17, max_tokens=1)
    with pytest.raises(PromptTooLongError):  # a recompute after preemption would need 17
        h.add(10, max_tokens=8)


def test_max_num_seqs():
    h = Harness(max_num_seqs=3)
    reqs = [h.add(4, max_tokens=6) for _ in range(7)]
    out = h.step()
    assert len(out.seqs) == 3 and len(h.s.running) == 3
    while h.s.has_unfinished():
        out = h.step()
        assert len(out.seqs) <= 3
    assert all(r.num_output_tokens == 6 for r in reqs)
    h.assert_all_free()


# -- lanes and aging -----------------------------------------------------------------------
def test_lanes_interactive_then_standard_then_batch():
    h = Harness(max_num_seqs=1)
    b, s, i = h.add(lane=B, max_tokens=1), h.add(lane=S, max_tokens=1), h.add(lane=I, max_tokens=1)
    order = [next(iter(scheduled(h.step()))) for _ in range(3)]
    assert order == [i.request_id, s.request_id, b.request_id]
    h.assert_all_free()


def test_within_a_lane_first_come_first_served():
    h = Harness(max_num_seqs=1)
    reqs = [h.add(lane=S, max_tokens=1) for _ in range(3)]
    assert [next(iter(scheduled(h.step()))) for _ in range(3)] == [r.request_id for r in reqs]


@pytest.mark.parametrize("waited, batch_first", [(0.0, False), (1.5, False), (2.01, True), (10.0, True)])
def test_aging_admits_an_old_batch_request_ahead_of_newer_interactive_ones(waited, batch_first):
    aging = 5.0
    h = Harness(max_num_seqs=1, aging_seconds=aging)
    batch = h.add(lane=B, max_tokens=1)
    h.clock.advance(waited * aging)
    inter = [h.add(lane=I, max_tokens=1) for _ in range(2)]
    first = next(iter(scheduled(h.step())))
    assert (first == batch.request_id) == batch_first
    h.run()
    assert batch.num_output_tokens == 1 and all(r.num_output_tokens == 1 for r in inter)


def test_batch_never_starves_under_a_steady_interactive_stream():
    h = Harness(max_num_seqs=2, aging_seconds=5.0)
    batch = h.add(lane=B, max_tokens=2)
    for step in range(60):
        h.add(lane=I, max_tokens=3)
        h.add(lane=I, max_tokens=3)
        h.step(dt=1.0)
        if batch.request_id in h.finished:
            break
    assert batch.request_id in h.finished and step <= 14


def test_aged_batch_request_is_not_preempted_by_the_next_interactive_arrival():
    # A tight pool under a steady stream of interactive requests: the batch request is
    # admitted by aging; it must then keep its place instead of being preempted by each
    # new arrival (preemption by recompute would throw its progress away every time).
    h = Harness(num_blocks=10, block_size=4, max_num_batched_tokens=64, aging_seconds=2.0)
    batch = h.add(8, lane=B, max_tokens=12)
    for step in range(150):
        h.add(8, lane=I, max_tokens=6)
        h.step(dt=1.0)
        if batch.request_id in h.finished:
            break
    assert batch.request_id in h.finished, f"batch starved: {batch.num_preemptions} preemptions"
    assert batch.num_output_tokens == 12
    h.run()
    h.assert_all_free()


# -- preemption ----------------------------------------------------------------------------
def test_preemption_picks_the_lowest_lane_newest_request_and_it_resumes():
    h = Harness(num_blocks=4, block_size=4)
    old_b, new_b, inter = h.add(4, lane=B, max_tokens=8), h.add(4, lane=B, max_tokens=8), h.add(4, lane=I, max_tokens=8)
    out = h.step()
    assert len(out.seqs) == 3 and h.kv.pool.num_free_blocks == 1
    out = h.step()  # every request needs a second block; only one is free
    assert out.preempted == [new_b.request_id]
    assert new_b.status is RequestStatus.WAITING and new_b in h.s.waiting
    assert new_b.num_computed_tokens == 0 and new_b.block_ids == [] and new_b.num_preemptions == 1
    assert new_b.num_output_tokens == 1, "sampled tokens survive a preemption"
    assert set(scheduled(out)) == {inter.request_id, old_b.request_id}
    h.run()
    for r in (old_b, new_b, inter):
        assert r.num_output_tokens == 8 and r.status is RequestStatus.FINISHED_LENGTH
    assert h.s.num_preemptions >= 1
    h.assert_all_free()


def test_a_resumed_request_recomputes_prompt_and_outputs_then_samples_once():
    h = Harness(num_blocks=4, block_size=4, prefix=False)
    a, b = h.add(4, lane=S, max_tokens=8), h.add(4, lane=B, max_tokens=8)
    h.step()
    while b.status is not RequestStatus.WAITING:
        h.step()
    before = list(b.output_token_ids)
    assert before and b.num_preemptions == 1
    while b.status is RequestStatus.WAITING:
        out = h.step()
    [seq] = [s for s in out.seqs if s.request_id == b.request_id]
    assert seq.start_pos == 0 and seq.token_ids == b.prompt_token_ids + before and seq.sample
    assert b.output_token_ids[:-1] == before and b.num_output_tokens == len(before) + 1
    h.run()
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    h.assert_all_free()


def test_a_request_that_does_not_fit_preempts_itself_when_it_is_the_lowest():
    h = Harness(num_blocks=3, block_size=4)
    hi, lo = h.add(4, lane=I, max_tokens=8), h.add(4, lane=B, max_tokens=8)
    h.step()
    h.step()  # both need a second block; 1 free: hi takes it, lo preempts itself
    assert lo.status is RequestStatus.WAITING and hi.status is RequestStatus.RUNNING
    h.run()
    assert hi.num_output_tokens == 8 and lo.num_output_tokens == 8
    h.assert_all_free()


def test_an_interactive_arrival_preempts_a_running_batch_request():
    h = Harness(num_blocks=4, block_size=4)
    batch = h.add(12, lane=B, max_tokens=4)  # 3 blocks
    h.step()
    inter = h.add(8, lane=I, max_tokens=2)  # needs 2, 1 free
    out = h.step()
    assert out.preempted == [batch.request_id]
    assert scheduled(out) == {inter.request_id: 8}
    assert batch.status is RequestStatus.WAITING and batch.num_computed_tokens == 0
    h.run()
    assert batch.num_output_tokens == 4 and inter.num_output_tokens == 2
    h.assert_all_free()


@pytest.mark.parametrize("running_lane, waiting_lane, preempts", [
    (B, I, True), (B, S, True), (S, I, True),
    (S, S, False), (I, I, False), (I, S, False), (I, B, False), (S, B, False), (B, B, False),
])
def test_waiting_requests_preempt_only_strictly_lower_lanes(running_lane, waiting_lane, preempts):
    h = Harness(num_blocks=4, block_size=4)
    running = h.add(12, lane=running_lane, max_tokens=4)
    h.step()
    waiting = h.add(8, lane=waiting_lane, max_tokens=2)
    out = h.step()
    assert (out.preempted == [running.request_id]) == preempts
    assert (waiting.status is RequestStatus.RUNNING) == preempts
    h.run()
    assert running.num_output_tokens == 4 and waiting.num_output_tokens == 2
    h.assert_all_free()


def test_a_blocked_head_admits_nobody_behind_it_and_preempts_nothing_useful():
    h = Harness(num_blocks=6, block_size=4)
    hog = h.add(16, lane=I, max_tokens=4)  # 4 blocks, then 5
    h.step()
    big = h.add(12, lane=S, max_tokens=2)  # needs 3, 2 free, cannot preempt interactive
    small = h.add(2, lane=B, max_tokens=2)
    out = h.step()
    assert set(scheduled(out)) == {hog.request_id} and not out.preempted
    h.run()
    assert big.num_output_tokens == 2 and small.num_output_tokens == 2
    h.assert_all_free()


def test_a_plan_dropped_by_preemption_never_becomes_a_prefix_hit():
    # The batch request's second chunk (positions 12..17) is planned, then the interactive
    # arrival preempts it in the same step, so that chunk's KV is never written. Its full
    # block must not be published: the batch request's own resume would hit it.
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=12)
    h.s.guard.tokens = 6  # the background's share of a step once the interactive lane is busy
    batch = h.add(18, lane=B, max_tokens=2)
    h.step()
    assert batch.num_computed_tokens == 12
    inter = h.add(6, lane=I, max_tokens=1)
    out = h.step()
    assert out.preempted == [batch.request_id] and inter.request_id in scheduled(out)
    h.run()  # the fake runner asserts every position read was written by the right prefix
    assert batch.num_output_tokens == 2
    assert batch.num_cached_tokens == 0  # metering counts the first admission only
    h.assert_all_free()


# -- admission errors ----------------------------------------------------------------------
def test_requests_that_can_never_fit_are_refused_at_add():
    h = Harness(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(PromptTooLongError):
        h.add(18, max_tokens=3)  # 21 > max_model_len
    with pytest.raises(PromptTooLongError):
        h.add(14, max_tokens=3)  # 17 tokens = 5 blocks > the whole pool of 4
    ok = h.add(13, max_tokens=3)  # exactly the pool
    assert list(h.s.waiting) == [ok]
    h.run()
    assert ok.num_output_tokens == 3
    h.assert_all_free()


def test_max_waiting_raises_overloaded():
    h = Harness(max_waiting=2)
    h.add()
    h.add()
    with pytest.raises(EngineOverloadedError):
        h.add()
    h.step()  # both admitted: the queue has room again
    h.add()


def test_duplicate_request_id_is_refused():
    h = Harness()
    h.add(rid="x")
    with pytest.raises(AssertionError):
        h.add(rid="x")


# -- abort ---------------------------------------------------------------------------------
def _abort_scenario(stage: str) -> None:
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
    other = h.add(4, lane=I, max_tokens=10)
    victim = h.add(20, lane=B, max_tokens=6, adapter="a")
    if stage == "waiting":
        h.s.guard.tokens = 1  # the rest of the budget is the foreground's
        h.add(1, lane=I, max_tokens=10)  # fill max_num_seqs first
        h.add(1, lane=I, max_tokens=10)
        h.step()
        assert victim.status is RequestStatus.WAITING
    elif stage == "mid-prefill":
        h.step()
        assert 0 < victim.num_computed_tokens < 20
    elif stage == "decoding":
        while victim.num_output_tokens < 2:
            h.step()
    elif stage == "preempted":
        while victim.num_output_tokens < 1:
            h.step()
        h.add(12, lane=I, max_tokens=10)  # 3 blocks more than there are: preempts victim
        while victim.num_preemptions == 0:
            h.step()
        assert victim.status is RequestStatus.WAITING
    elif stage == "in-flight":
        out = h.schedule()
        while victim.num_output_tokens < 1 or victim.request_id not in scheduled(out):
            h.execute_and_update(out)
            out = h.schedule()
        h.abort(victim.request_id)
        h.execute_and_update(out)  # the step's token for the aborted request is dropped
    if stage != "in-flight":
        h.abort(victim.request_id)
    assert victim.request_id not in h.s.requests and victim.block_ids == []
    assert h.s.adapters.num_pinned == 0, "the aborted request's adapter pin is released"
    outputs = victim.num_output_tokens
    assert h.s.finish(victim.request_id, RequestStatus.FINISHED_ABORTED) is None, "aborting twice is a no-op"
    h.run()
    assert victim.num_output_tokens == outputs and other.num_output_tokens == 10
    h.assert_all_free()


@pytest.mark.parametrize("stage", ["waiting", "mid-prefill", "decoding", "preempted", "in-flight"])
def test_abort_at_any_point_frees_everything(stage):
    _abort_scenario(stage)


def test_abort_the_only_request_returns_the_pool():
    h = Harness(num_blocks=8, block_size=4)
    r = h.add(10, max_tokens=5)
    h.step()
    assert h.kv.pool.num_free_blocks < 8
    h.abort(r.request_id)
    h.assert_all_free()
    assert h.s.finish("nope", RequestStatus.FINISHED_ABORTED) is None


# -- static policy ---------------------------------------------------------------------------
def test_static_policy_admits_nothing_while_the_previous_batch_runs():
    h = Harness(policy="static", max_num_seqs=4)
    a, b = h.add(max_tokens=1), h.add(max_tokens=4)
    h.step()
    assert a.request_id in h.finished
    late = h.add(max_tokens=1)
    while b.request_id not in h.finished:
        out = h.step()
        assert late.request_id not in scheduled(out), "admitted while the batch still runs"
    out = h.step()
    assert late.request_id in scheduled(out)
    h.run()
    h.assert_all_free()


def test_static_batch_members_held_back_by_the_budget_still_join_it():
    h = Harness(policy="static", max_num_seqs=4, max_num_batched_tokens=10)
    a, b = h.add(10, max_tokens=3), h.add(8, max_tokens=3)
    out = h.step()
    assert scheduled(out) == {a.request_id: 10}
    h.add(2, max_tokens=1)
    out = h.step()
    assert scheduled(out) == {a.request_id: 1, b.request_id: 8}, "b belongs to the running batch"
    h.run()
    assert all(r.num_output_tokens == 3 for r in (a, b))
    h.assert_all_free()


def test_continuous_policy_admits_while_others_run():
    h = Harness(max_num_seqs=4)
    h.add(max_tokens=5)
    h.step()
    late = h.add(max_tokens=1)
    assert late.request_id in scheduled(h.step())


# -- stop conditions -------------------------------------------------------------------------
def _run_with_tokens(h: Harness, req: Request, tokens: list[int]) -> None:
    it = iter(tokens)
    while req.request_id not in h.finished:
        h.step(token=lambda r: next(it) if r is req else fake_token(r))


def test_stops_on_eos():
    h = Harness()
    r = h.add(ignore_eos=False, max_tokens=10)
    _run_with_tokens(h, r, [5, 6, EOS, 7])
    assert r.output_token_ids == [5, 6, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    h.assert_all_free()


def test_ignore_eos_runs_to_max_tokens():
    h = Harness()
    r = h.add(ignore_eos=True, max_tokens=4)
    _run_with_tokens(h, r, [EOS, EOS, EOS, EOS])
    assert r.num_output_tokens == 4 and r.status is RequestStatus.FINISHED_LENGTH


def test_stop_token_ids():
    h = Harness()
    r = h.add(max_tokens=10, stop_token_ids=(42,))
    _run_with_tokens(h, r, [5, 42, 6])
    assert r.output_token_ids == [5, 42]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_max_tokens_is_length():
    h = Harness()
    r = h.add(ignore_eos=False, max_tokens=3)
    _run_with_tokens(h, r, [5, 6, 7, 8])
    assert r.output_token_ids == [5, 6, 7] and r.status is RequestStatus.FINISHED_LENGTH


def test_min_tokens_suppresses_eos_and_stop_tokens():
    h = Harness()
    r = h.add(ignore_eos=False, max_tokens=10, min_tokens=3, stop_token_ids=(42,))
    _run_with_tokens(h, r, [EOS, 42, EOS, 9])
    assert r.output_token_ids == [EOS, 42, EOS] and r.status is RequestStatus.FINISHED_STOPPED


def test_first_token_time_is_set_once():
    h = Harness()
    r = h.add(max_tokens=3)
    h.step(dt=1.0)
    t = r.first_token_time
    assert t is not None
    h.run(dt=1.0)
    assert r.first_token_time == t


# -- prefix cache through the scheduler ---------------------------------------------------
def test_prefix_hits_are_per_tenant_and_per_adapter():
    h = Harness(num_blocks=32, block_size=4)
    prompt = list(range(200, 221))
    first = h.add(prompt=prompt, salt="t1", adapter="a", max_tokens=2)
    h.run()
    same = h.add(prompt=prompt, salt="t1", adapter="a", max_tokens=2)
    other_tenant = h.add(prompt=prompt, salt="t2", adapter="a", max_tokens=2)
    other_adapter = h.add(prompt=prompt, salt="t1", adapter="b", max_tokens=2)
    h.run()
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 20
    assert other_tenant.num_cached_tokens == 0 and other_adapter.num_cached_tokens == 0
    h.assert_all_free()


def test_identical_prompts_in_one_step_do_not_read_each_others_unwritten_kv():
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=12)
    prompt = list(range(300, 320))
    a = h.add(prompt=prompt, max_tokens=3)
    b = h.add(prompt=prompt, max_tokens=3)
    h.run()
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3
    h.assert_all_free()


# -- adapter residency: a row cap (max_loras) ----------------------------------------------
def test_at_most_max_loras_adapters_and_base_requests_are_not_blocked():
    h = Harness(max_loras=2)
    ra, rb, rc = h.add(adapter="a", max_tokens=3), h.add(adapter="b", max_tokens=3), h.add(adapter="c", max_tokens=3)
    base = h.add(max_tokens=3)
    out = h.step()
    assert set(scheduled(out)) == {ra.request_id, rb.request_id, base.request_id}
    assert rc.status is RequestStatus.WAITING
    assert sorted(slot for slot, _ in out.adapter_loads) == [0, 1]
    assert {ref.name for _, ref in out.adapter_loads} == {"a", "b"}
    h.run()
    assert rc.num_output_tokens == 3
    h.assert_all_free()


def test_adapter_loads_are_reported_once_per_load():
    h = Harness(max_loras=2)
    loads = []
    h.add(adapter="a", max_tokens=3)
    h.add(adapter="a", max_tokens=3)
    loads += h.step().adapter_loads
    h.add(adapter="a", max_tokens=2)  # already resident
    loads += h.step().adapter_loads
    while h.s.has_unfinished():
        loads += h.step().adapter_loads
    h.add(adapter="a", max_tokens=1)  # resident though unpinned: no reload
    h.add(adapter="b", max_tokens=1)  # a free slot
    loads += h.step().adapter_loads
    h.add(adapter="c", max_tokens=1)  # evicts the least recently used: a
    loads += h.step().adapter_loads
    h.add(adapter="a", max_tokens=1)  # a was evicted: loaded again
    loads += h.step().adapter_loads
    assert [(slot, ref.name) for slot, ref in loads] == [(0, "a"), (1, "b"), (0, "c"), (1, "a")]
    h.run()
    h.assert_all_free()


def test_starved_adapter_rotates_in_after_aging():
    aging = 5.0
    h = Harness(max_loras=1, aging_seconds=aging)
    h.add(adapter="hot", max_tokens=3)
    cold = h.add(adapter="cold", max_tokens=2)
    t0 = h.clock()
    admitted_at = None
    for _ in range(40):
        h.add(adapter="hot", max_tokens=3)  # the hot adapter never drains on its own
        out = h.step(dt=1.0)
        if cold.request_id in scheduled(out) and admitted_at is None:
            admitted_at = h.clock() - 1.0
    assert admitted_at is not None, "the cold adapter starved"
    assert aging <= admitted_at - t0 <= aging + 5
    assert cold.num_output_tokens == 2
    h.run()
    h.assert_all_free()


def test_base_requests_flow_while_an_adapter_waits_to_rotate_in():
    h = Harness(max_loras=1, aging_seconds=2.0)
    h.add(adapter="hot", max_tokens=4)
    h.add(adapter="cold", max_tokens=1)
    for _ in range(10):
        h.add(adapter="hot", max_tokens=4)
        base = h.add(max_tokens=1)
        out = h.step(dt=1.0)
        assert base.request_id in scheduled(out)
    h.run()
    h.assert_all_free()


# -- adapter residency: memory, not a slot count ----------------------------------------------
def test_adapters_beyond_any_slot_count_run_in_one_step_when_memory_allows():
    h = Harness(max_loras=None, num_blocks=256, pages=3, max_num_seqs=32, max_num_batched_tokens=512)
    reqs = [h.add(adapter=f"a{i}", max_tokens=2) for i in range(20)]
    out = h.step()
    assert set(scheduled(out)) == {r.request_id for r in reqs}, "every adapter runs in the first step"
    assert sorted(row for row, _ in out.adapter_loads) == list(range(20)), "dense rows, each loaded once"
    assert h.kv.pool.num_adapter_pages == 20 * 3
    h.run()
    assert all(r.num_output_tokens == 2 for r in reqs)
    h.assert_all_free()


def test_admission_counts_kv_and_adapter_pages_together():
    # 12 blocks: a 8-token prompt + 4 tokens out needs 3 KV blocks, its adapter 4 pages.
    h = Harness(max_loras=None, num_blocks=12, pages=4, max_num_batched_tokens=64)
    a, b, c = (h.add(adapter=n, max_tokens=4) for n in "abc")
    out = h.step()
    # a: 2 KV + 4 pages, b: 2 + 4 = 12 blocks; c's pages do not fit beside them.
    assert set(scheduled(out)) == {a.request_id, b.request_id}
    assert c.status is RequestStatus.WAITING and h.s.adapters.row_of("digest-c") is None
    h.run()
    assert c.num_output_tokens == 4
    h.assert_all_free()


def test_an_adapter_in_use_is_never_evicted_and_an_idle_one_stays_resident():
    pool = BlockPool(8)
    mem = AdapterMemory(pool)
    a, b, c = ref("a"), ref("b"), ref("c")
    assert mem.acquire(a, 3) and mem.acquire(b, 3)
    assert pool.num_free_blocks == 2
    assert not mem.can_acquire(c.digest, 3) and not mem.acquire(c, 3), "a and b are in use: nothing to evict"
    mem.release(b.digest)
    assert pool.num_free_blocks == 5, "an idle adapter's pages are reclaimable"
    assert mem.row_of(b.digest) == 1, "idle, still resident"
    assert mem.acquire(b, 3) and mem.take_evicted() == [], "used again: no reload"
    mem.release(b.digest)
    assert mem.acquire(c, 3), "c takes free blocks first, then b's pages"
    assert mem.row_of(b.digest) is None and mem.take_evicted() == [b]
    assert mem.row_of(c.digest) == 1 and mem.row_of(a.digest) == 0, "c reuses b's row"
    assert pool.adapter_pages(a.digest) is not None
    pool.check_invariants()


def test_row_cap_evicts_the_least_recently_used_idle_adapter():
    mem = AdapterMemory(BlockPool(64), max_rows=2)
    a, b, c = ref("a"), ref("b"), ref("c")
    assert mem.acquire(a, 1) and mem.acquire(b, 1)
    assert not mem.can_acquire(c.digest, 1), "both rows pinned"
    mem.release(a.digest)
    mem.release(b.digest)
    assert mem.acquire(c, 1) and mem.take_evicted() == [a], "a went idle first"
    assert mem.resident() == {c.digest: 0, b.digest: 1}
    assert mem.loads([(0, c), (1, b)]) == [(0, c), (1, b)] and mem.loads([(0, c), (1, b)]) == []


def test_kv_pressure_evicts_an_idle_adapter_before_preempting():
    h = Harness(max_loras=None, num_blocks=10, pages=4, max_num_batched_tokens=64)
    h.add(adapter="a", max_tokens=1)
    h.run()
    assert h.s.adapters.row_of("digest-a") is not None, "idle and resident"
    # A base request needing every block: the idle adapter's pages go, nobody is preempted.
    big = h.add(prompt_len=36, max_tokens=4)
    out = h.step()
    assert big.request_id in scheduled(out) and [r.name for r in out.adapter_evictions] == ["a"]
    assert h.s.num_preemptions == 0
    h.run()
    h.assert_all_free()


def test_cached_kv_and_idle_adapters_compete_in_one_lru_order():
    pool = BlockPool(6)
    mem = AdapterMemory(pool)
    assert mem.acquire(ref("a"), 2)
    kv = pool.allocate(2)
    pool.cache(kv[0], b"h0")
    pool.cache(kv[1], b"h1")
    mem.release("digest-a")  # idle first ...
    pool.free(kv)  # ... then the cached KV: a is the least recently used
    assert pool.num_free_blocks == 6
    pool.allocate(3)  # the 2 plain free blocks, then a page of a: a goes whole
    assert mem.take_evicted() == [ref("a")] and pool.lookup(b"h0") is not None and pool.lookup(b"h1") is not None
    pool.allocate(2)  # a's other page, then the older cached block
    assert pool.lookup(b"h1") is None or pool.lookup(b"h0") is None
    pool.check_invariants()


def test_an_adapter_larger_than_the_pool_does_not_hold_the_others_back():
    h = Harness(max_loras=None, num_blocks=12, pages={"huge": 20}, aging_seconds=1.0)
    huge = h.add(adapter="huge", max_tokens=2)
    h.step(dt=5.0)
    others = [h.add(adapter=n, max_tokens=2) for n in "ab"]
    for _ in range(10):
        h.step(dt=1.0)
    assert huge.status is RequestStatus.WAITING and all(r.num_output_tokens == 2 for r in others)
    h.abort(huge.request_id)
    h.assert_all_free()


def test_memory_short_adapters_rotate_in_after_aging():
    # Room for one adapter beside the KV: a hot adapter that never drains would starve the cold one.
    aging = 5.0
    h = Harness(max_loras=None, num_blocks=16, pages=8, aging_seconds=aging)
    h.add(adapter="hot", max_tokens=3)
    cold = h.add(adapter="cold", max_tokens=2)
    t0, admitted_at = h.clock(), None
    for _ in range(40):
        h.add(adapter="hot", max_tokens=3)
        out = h.step(dt=1.0)
        if cold.request_id in scheduled(out) and admitted_at is None:
            admitted_at = h.clock() - 1.0
    assert admitted_at is not None, "the cold adapter starved"
    assert aging <= admitted_at - t0 <= aging + 5
    h.run()
    assert cold.num_output_tokens == 2
    h.assert_all_free()

# -- randomized stress ---------------------------------------------------------------------
@pytest.mark.parametrize("seed, kw", [
    (0, dict()),
    (1, dict(enable_chunked_prefill=False, max_num_batched_tokens=40)),
    (2, dict(policy="static")),
    (3, dict(prefix=False, max_loras=1)),
    (5, dict(max_loras=None, pages=3)),  # adapters bounded by memory: pages compete with KV
    (4, dict(block_size=1, num_blocks=40)),
])
def test_randomized_stress(seed, kw):
    rng = random.Random(seed)
    kw = dict(dict(num_blocks=16, block_size=4, max_num_batched_tokens=24, max_num_seqs=5,
                   max_loras=2, aging_seconds=3.0, max_model_len=64), **kw)
    h = Harness(**kw)
    prefixes = [[rng.randrange(100, 200) for _ in range(8)] for _ in range(3)]
    aborted = set()
    for step in range(300):
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            if step >= 240:
                break
            n = rng.randint(1, 20)
            prompt = rng.choice(prefixes)[: rng.randint(0, 8)] + [rng.randrange(100, 200) for _ in range(n)]
            h.add(prompt=prompt, lane=rng.choice(list(Lane)), max_tokens=rng.randint(1, 10),
                  adapter=rng.choice([None, "a", "b", "c"]), salt=rng.choice(["", "t2"]))
        if h.s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(h.s.requests))
            h.abort(rid)
            aborted.add(rid)
        h.step(dt=rng.choice((0.0, 0.5, 1.0)))
    h.run(dt=1.0)
    assert h.s.num_preemptions > 0, "the small pool was meant to force preemption"
    for rid, r in h.reqs.items():
        if rid in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
        else:
            assert r.num_output_tokens == r.sampling.max_tokens, rid
            assert r.status is RequestStatus.FINISHED_LENGTH
    h.assert_all_free()


def test_a_paused_request_takes_no_steps_and_keeps_its_blocks():
    h = Harness()
    a, b = h.add(max_tokens=8), h.add(max_tokens=8)
    h.step()
    a.paused = True
    blocks = list(a.block_ids)
    for _ in range(3):
        out = h.step()
        assert [s.request_id for s in out.seqs] == [b.request_id]
    assert a.block_ids == blocks and a.status is RequestStatus.RUNNING and a.num_output_tokens == 1
    a.paused = False
    h.run()
    assert h.finished[a.request_id].num_output_tokens == 8
