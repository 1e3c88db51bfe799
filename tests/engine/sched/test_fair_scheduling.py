"""Tenant-fair scheduling through the real Scheduler, without a model.

A driver plays the engine: it feeds arrivals, runs `schedule()`, "samples" a token for
every sequence that reaches its end (never EOS; each request stops at its max_tokens),
and measures each tenant's service from the plans themselves: w_in per prompt token
computed for the first time, w_out per sampled token. The bound is the one
`tests/engine/sched/test_fairness.py` checks on the bare queue (Sheng et al., OSDI'24, Thm 4.4):
two tenants backlogged over an interval get weighted service within
2·max(w_in·L, w_out·M) / min weight of each other, L the longest prompt, M the tokens
the KV pool holds.
"""
from __future__ import annotations

import itertools
import random

import pytest

from loraplex.engine.sched.block_pool import KVCacheManager
from loraplex.engine.config import SchedulerConfig
from loraplex.engine.errors import EngineOverloadedError
from loraplex.engine.errors import TenantShareExceededError
from loraplex.engine.request import Lane, Request, RequestStatus, SamplingParams
from loraplex.engine.sched.scheduler import Scheduler
from tests.engine.sched.test_fairness import pair_gaps

W_IN, W_OUT = 1.0, 2.0
BLOCKS, BLOCK_SIZE = 64, 4
MEMORY = BLOCKS * BLOCK_SIZE
MAX_PROMPT, MAX_OUTPUT = 40, 24


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(scheduling: str = "fair", **kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    # At most 4 x (40 + 24) tokens run: they always fit the pool, so no preemption
    # (the theorem's setting) unless a test makes one.
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_waiting", 100_000)
    kw.setdefault("tenant_queue_share", 1.0)
    s = Scheduler(SchedulerConfig(scheduling=scheduling, **kw), KVCacheManager(BLOCKS, BLOCK_SIZE, False), 512)
    s.clock = Clock()
    return s


_ids = itertools.count()
_prompt_done: dict[str, int] = {}


def request(tenant: str, prompt: int, output: int, *, weight: float = 1.0, lane: Lane = Lane.STANDARD,
            arrival: float = 0.0, deadline: float | None = None) -> Request:
    return Request(f"{tenant}-{next(_ids)}", [7] * prompt, SamplingParams(max_tokens=output, ignore_eos=True),
                   lane, arrival_time=arrival, tenant=tenant, tenant_weight=weight, deadline=deadline)


def step(s: Scheduler, service: dict[str, float]) -> list[str]:
    """One engine step; adds each tenant's weighted service; returns the ids admitted."""
    before = {r.request_id for r in s.running}
    out = s.schedule()
    sampled = {}
    for seq in out.seqs:
        req = s.requests[seq.request_id]
        # Prompt tokens computed for the first time: a recompute after a preemption is
        # the scheduler's choice, not service to the tenant.
        prompt_end = min(seq.start_pos + len(seq.token_ids), req.num_prompt_tokens)
        first = max(seq.start_pos, _prompt_done.get(req.request_id, 0))
        if prompt_end > first:
            service[req.tenant] += W_IN * (prompt_end - first) / req.tenant_weight
            _prompt_done[req.request_id] = prompt_end
        if seq.sample:
            sampled[seq.request_id] = [11]
            service[req.tenant] += W_OUT / req.tenant_weight
    s.update(out, sampled)
    s.clock.t += 0.01
    return [seq.request_id for seq in out.seqs if seq.request_id not in before]


def flood(rng: random.Random, tenant: str, per_step: float, steps: int, weight: float = 1.0,
          start: int = 0) -> dict[int, list[Request]]:
    out: dict[int, list[Request]] = {}
    acc = 0.0
    for t in range(start, steps):
        acc += per_step
        while acc >= 1:
            acc -= 1
            out.setdefault(t, []).append(request(tenant, rng.randint(1, MAX_PROMPT), rng.randint(1, MAX_OUTPUT),
                                                 weight=weight, arrival=t + rng.random()))
    return out


def run(s: Scheduler, *floods: dict[int, list[Request]], steps: int, tenants: tuple[str, ...] = ("a", "b")):
    """Yield (step, service so far, backlogged tenants) after each step."""
    service = {t: 0.0 for t in tenants}
    for t in range(steps):
        for f in floods:
            for r in sorted(f.get(t, ()), key=lambda r: r.arrival_time):
                s.add_request(r)
        step(s, service)
        yield t, dict(service), {r.tenant for r in s.waiting}


def bound(min_weight: float = 1.0) -> float:
    return 2 * max(W_IN * MAX_PROMPT, W_OUT * MEMORY) / min_weight


def test_ten_times_the_requests_gets_service_within_the_bound():
    steps = 500
    floods = lambda: (flood(random.Random(1), "a", 3.0, steps), flood(random.Random(2), "b", 0.3, steps))
    fair = list(run(make_scheduler("fair"), *floods(), steps=steps))
    assert sum({"a", "b"} <= b for *_, b in fair) > steps * 0.8  # both backlogged nearly throughout
    gaps = pair_gaps(fair, "a", "b")
    assert max(gaps) <= bound()
    # The same traffic first come first served: the flooding tenant takes ~10x.
    fcfs = list(run(make_scheduler("fcfs"), *floods(), steps=steps))
    assert max(pair_gaps(fcfs, "a", "b")) > 3 * bound()
    assert fcfs[-1][1]["a"] > 5 * fcfs[-1][1]["b"]
    assert fair[-1][1]["a"] < 1.5 * fair[-1][1]["b"]


def test_work_conserving_an_idle_tenants_share_goes_to_the_other():
    steps = 400
    trace = list(run(make_scheduler(), flood(random.Random(3), "a", 3.0, steps),
                     flood(random.Random(4), "b", 1.0, 20), steps=steps))
    b_last = max(i for i, (*_, backlogged) in enumerate(trace) if "b" in backlogged)
    assert b_last < steps // 2
    total = lambda s: s["a"] + s["b"]
    both = (total(trace[b_last][1]) - total(trace[10][1])) / (b_last - 10)
    (_, s2, _), (_, s3, _) = trace[b_last + 50], trace[-1]
    a_alone = (s3["a"] - s2["a"]) / (steps - 1 - b_last - 50)
    assert s3["b"] == s2["b"]
    assert a_alone == pytest.approx(both, rel=0.2)


@pytest.mark.parametrize("wa", [2.0, 3.0])
def test_weights_shift_the_shares(wa):
    steps = 600
    trace = list(run(make_scheduler(), flood(random.Random(5), "a", 2.0, steps, weight=wa),
                     flood(random.Random(6), "b", 2.0, steps), steps=steps))
    assert max(pair_gaps(trace, "a", "b")) <= bound()  # services divided by the weights
    raw_a, raw_b = trace[-1][1]["a"] * wa, trace[-1][1]["b"]
    assert raw_a / raw_b == pytest.approx(wa, rel=0.15)


def test_lanes_admit_first_and_aging_still_lifts_batch():
    s = make_scheduler(max_num_seqs=1, aging_seconds=5.0)
    service = {"a": 0.0, "b": 0.0}
    # b was served a lot (its counter is high), a little: inside the standard lane a wins,
    # but b's interactive request goes ahead of every standard one.
    s.waiting.charge(request("b", 1, 1), input_tokens=10_000)
    a = [s.add_request(r) or r for r in (request("a", 4, 1, arrival=t) for t in range(3))]
    bi = request("b", 4, 1, lane=Lane.INTERACTIVE, arrival=5.0)
    s.add_request(bi)
    assert step(s, service) == [bi.request_id]
    assert step(s, service) == [a[0].request_id]
    # A batch request that waited past the aging period climbs to the interactive lane.
    batch = request("b", 4, 1, lane=Lane.BATCH, arrival=9.0)
    s.add_request(batch)
    s.clock.t += 11.0
    s.add_request(request("a", 4, 1, lane=Lane.INTERACTIVE, arrival=10.0))
    assert step(s, service) == [batch.request_id]


def test_fair_order_inside_a_lane_follows_the_counters():
    s = make_scheduler(max_num_seqs=1)
    service = {"a": 0.0, "b": 0.0}
    a = [request("a", 30, 1, arrival=t) for t in range(4)]
    b = [request("b", 30, 1, arrival=10 + t) for t in range(2)]
    for r in a + b:
        s.add_request(r)
    admitted = [rid for _ in range(12) for rid in step(s, service)]
    # a's head first (oldest), then b (a was charged), then alternating while both wait.
    assert admitted == [a[0].request_id, b[0].request_id, a[1].request_id, b[1].request_id,
                        a[2].request_id, a[3].request_id]


def test_each_tenants_share_of_the_waiting_queue_is_bounded():
    s = make_scheduler(max_waiting=8, tenant_queue_share=0.25, max_num_seqs=1)
    for i in range(2):
        s.add_request(request("x", 4, 1))
    with pytest.raises(TenantShareExceededError) as e:
        s.add_request(request("x", 4, 1))
    assert e.value.reason == "tenant_queue_share_exceeded" and (e.value.waiting, e.value.limit) == (2, 2)
    for i in range(4):
        s.add_request(request("heavy", 4, 1, weight=2.0))  # weight 2: twice the share
    with pytest.raises(TenantShareExceededError):
        s.add_request(request("heavy", 4, 1, weight=2.0))
    s.add_request(request("", 4, 1))  # no tenant: no share, only the whole queue's size
    s.add_request(request("", 4, 1))
    with pytest.raises(EngineOverloadedError):
        s.add_request(request("y", 4, 1))
    assert len(s.waiting) == 8


def test_a_preempted_request_is_requeued_past_its_tenants_share_and_billed_once():
    s = make_scheduler(max_waiting=4, tenant_queue_share=0.25, max_num_seqs=4)  # a share of 1
    service = {"x": 0.0, "i": 0.0}
    big = request("x", MEMORY - 8, 4)  # fills the KV pool once its prompt is computed
    s.add_request(big)
    for _ in range(4):
        step(s, service)
    assert big.num_output_tokens == 1
    # x's second request does not fit beside it: it waits, filling x's share.
    x2 = request("x", 200, 1)
    s.add_request(x2)
    step(s, service)
    with pytest.raises(TenantShareExceededError):
        s.add_request(request("x", 4, 1))
    # An interactive arrival preempts big, which rejoins the queue while x's share is
    # full (the waiting x request is admitted after it, in the same step).
    s.add_request(request("i", 64, 1, lane=Lane.INTERACTIVE))
    step(s, service)
    assert big.status is RequestStatus.WAITING and big.num_preemptions == 1
    assert s.preemptions_by_lane == {Lane.INTERACTIVE: 0, Lane.STANDARD: 1, Lane.BATCH: 0}
    with pytest.raises(TenantShareExceededError):
        s.add_request(request("x", 4, 1))
    while s.requests:
        step(s, service)
    # big's prompt is billed once, its recompute not again; every sampled token once.
    assert x2.status is RequestStatus.FINISHED_LENGTH
    assert s.waiting.counter(Lane.STANDARD, "x") == W_IN * (MEMORY - 8 + 200) + W_OUT * (4 + 1)
    assert service["x"] == s.waiting.counter(Lane.STANDARD, "x")


def test_deadlines_free_waiting_and_running_requests():
    s = make_scheduler(max_num_seqs=1)
    now = s.clock()
    running = request("a", 8, 20, deadline=now + 1.0)
    waiting = request("b", 8, 20, deadline=now + 0.5)
    forever = request("c", 8, 20)
    for r in (running, waiting, forever):
        s.add_request(r)
    service = {"a": 0.0, "b": 0.0, "c": 0.0}
    step(s, service)
    assert running.status is RequestStatus.RUNNING and s.kv.pool.num_free_blocks < BLOCKS
    assert s.expire() == []
    s.clock.t = now + 0.6
    assert s.expire() == [waiting] and waiting.status is RequestStatus.FINISHED_TIMEOUT
    s.clock.t = now + 2.0
    assert s.expire() == [running] and running.status is RequestStatus.FINISHED_TIMEOUT
    assert running.num_output_tokens == 1 and not s.running
    assert set(s.requests) == {forever.request_id}
    step(s, service)
    assert forever.status is RequestStatus.RUNNING


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_lane_counts_match_the_queue(scheduling):
    s = make_scheduler(scheduling, max_num_seqs=1)
    for lane, n in ((Lane.INTERACTIVE, 2), (Lane.STANDARD, 1), (Lane.BATCH, 3)):
        for _ in range(n):
            s.add_request(request("a", 4, 1, lane=lane))
    step(s, {"a": 0.0})
    counts = s.lane_counts()
    assert {k: v["waiting"] for k, v in counts.items()} == {"interactive": 1, "standard": 1, "batch": 3}
    assert sum(v["running"] for v in counts.values()) == 0  # one token each: finished in its step
    assert s.waiting.lane_sizes() == {lane: sum(r.lane == lane for r in s.waiting) for lane in Lane}
