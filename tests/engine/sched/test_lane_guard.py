"""The lane guard: which lane is in front, how much of a step the lanes behind it get,
and what that does to an interactive request's first token under a batch flood.

The flood test runs the real scheduler against a simulated clock: each step "takes" what
this machine's measured cost model says (a fixed cost plus per-token costs), so the
latencies are plain arithmetic, the same on every machine.
"""
from __future__ import annotations

import random
import zlib

import pytest

from loraplex.engine.sched.block_pool import KVCacheManager
from loraplex.engine.config import SchedulerConfig
from loraplex.engine.sched.lane_guard import LaneGuard, Split, StepCost
from loraplex.engine.request import Lane, Request, SamplingParams
from loraplex.engine.sched.scheduler import Scheduler, SchedulerOutput
from tests.engine.sched.test_scheduler import B, I, S, Harness, scheduled

# -- the guard alone ---------------------------------------------------------------------------


def test_one_busy_lane_is_not_split():
    g = LaneGuard(hold_seconds=10, target_seconds=0.05, max_batched_tokens=1024)
    assert g.split({int(B)}, now=0.0) is None
    assert g.split(set(), now=1.0) is None


def test_the_highest_busy_lane_is_the_foreground_and_stays_it_for_the_hold():
    g = LaneGuard(hold_seconds=10, target_seconds=0.05, max_batched_tokens=1024)
    first = Split(int(I), 16.0, 512)
    assert g.split({int(I), int(B)}, now=0.0) == first and first.background_tokens == 16
    # The interactive lane went quiet: batch stays throttled for the hold, then is alone.
    assert g.split({int(B)}, now=9.9) == first
    assert g.split({int(B)}, now=10.1) is None
    split = g.split({int(S), int(B)}, now=11.0)
    assert split.top == int(S)
    assert split.is_background(int(B)) and not split.is_background(int(S))


def _steps(g: LaneGuard, fixed: float, per_decode: float, per_prompt: float, n: int = 64) -> None:
    rng = random.Random(0)
    for _ in range(n):
        decoded, prompt = rng.randrange(1, 40), rng.choice([0, 0, 64, 300])
        g.observe(decoded, prompt, fixed + per_decode * decoded + per_prompt * prompt)


def test_the_share_is_sized_from_the_measured_cost_of_a_token():
    g = LaneGuard(hold_seconds=10, target_seconds=0.05, max_batched_tokens=1024)
    for _ in range(7):
        g.observe(8, 0, 0.05)
    assert g.tokens == 16  # too few steps to tell a token's cost from the step's
    _steps(g, 0.02, 0.004, 0.0018)  # this CPU: a decoded token is the dearer kind
    assert g.tokens == int(0.05 / 0.004)
    assert (g.decode_weight, g.prompt_weight) == (1.0, pytest.approx(0.45))
    split = g.split({int(I), int(B)}, now=0.0)
    assert split.background_tokens == int(12 / 0.45)  # prompt tokens cost less: more fit
    _steps(g, 0.01, 0.00001, 0.00002)  # a GPU: tokens are nearly free, up to half a step
    assert g.tokens == 512
    _steps(g, 0.02, 0.5, 0.5)  # slower than the target for one token: one token still
    assert g.tokens == 1


def test_the_running_fit_is_the_fit_of_the_last_window_alone():
    # Steps with a real cost per token (and noise), so both fits are decisions, not ties.
    rng, rows = random.Random(3), []
    long_run = StepCost(window=64)
    for _ in range(1000):  # the window wraps many times, the sums rebuilt along the way
        decoded, prompt = rng.randrange(0, 64), rng.choice([0, 16, 128, 512])
        row = (decoded, prompt, 0.01 + 0.002 * decoded + 0.0005 * prompt + rng.uniform(0.0, 0.005))
        rows.append(row)
        long_run.add(*row)
    fresh = StepCost(window=64)
    for row in rows[-64:]:
        fresh.add(*row)
    fitted = fresh.slopes()
    assert fitted is not None and long_run.slopes() is not None
    assert long_run.slopes() == pytest.approx(fitted, rel=1e-9)
    assert fitted == pytest.approx((0.002, 0.0005), rel=0.05)


def test_steps_that_do_not_vary_or_measure_nothing_change_nothing():
    g = LaneGuard(hold_seconds=10, target_seconds=0.05, max_batched_tokens=1024)
    for _ in range(64):
        g.observe(8, 0, 0.05)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        g.observe(8, 100, bad)
    assert g.tokens == 16 and len(g.cost) == 64


def test_a_one_token_budget_stays_the_foregrounds():
    g = LaneGuard(hold_seconds=10, target_seconds=0.05, max_batched_tokens=1)
    assert g.split({int(I), int(B)}, now=0.0).background_tokens == 0
    _steps(g, 0.01, 0.00001, 0.00002)
    assert g.tokens == 0


# -- the scheduler under a split ---------------------------------------------------------------


def test_background_work_gets_its_share_of_each_step_while_interactive_runs():
    h = Harness(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=64)
    batch = [h.add(4, lane=B, max_tokens=50) for _ in range(12)]
    h.step()
    assert sum(scheduled(h.step()).values()) == 12  # batch alone: every request decodes
    h.s.guard.tokens = share = 4
    inter = h.add(40, lane=I, max_tokens=3)
    for _ in range(3):
        plan = scheduled(h.step())
        background = sum(n for rid, n in plan.items() if rid != inter.request_id)
        assert 1 <= background <= share  # throttled, never starved
    assert inter.request_id in h.finished
    assert all(r.num_output_tokens == 5 for r in batch[:share])  # the oldest keep going


def test_batch_is_throttled_for_the_hold_after_interactive_leaves_then_gets_everything():
    h = Harness(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=64, lane_hold_seconds=10.0)
    for _ in range(40):
        h.add(4, lane=B, max_tokens=100)
    h.add(4, lane=I, max_tokens=1)
    h.step(dt=1.0)  # the interactive request finishes in its first step
    assert sum(scheduled(h.step(dt=1.0)).values()) <= h.s.guard.tokens < 64
    h.clock.advance(10.0)
    assert sum(scheduled(h.step()).values()) == 64  # the hold is over: the whole budget


def test_an_interactive_arrival_takes_a_seat_from_new_batch_work_not_from_the_aged_head():
    h = Harness(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=3, aging_seconds=1.0)
    old, new1, new2 = h.add(4, lane=B, max_tokens=50), h.add(4, lane=B, max_tokens=50), h.add(4, lane=B, max_tokens=50)
    h.step(dt=5.0)  # every seat is batch's, all aged past the interactive lane
    inter = h.add(4, lane=I, max_tokens=2)
    out = h.step()
    assert out.preempted == [new2.request_id] and inter.request_id in scheduled(out)
    assert old.request_id in scheduled(out)  # the head keeps its seat and its share
    h.run()
    assert all(r.num_output_tokens == 50 for r in (old, new1, new2))
    h.assert_all_free()


def test_without_chunked_prefill_the_background_takes_what_the_foreground_leaves():
    h = Harness(num_blocks=256, max_num_batched_tokens=64, enable_chunked_prefill=False)
    inter = h.add(4, lane=I, max_tokens=8)
    batch = h.add(40, lane=B, max_tokens=2)  # more than the share: it must still run whole
    plan = scheduled(h.step())
    assert plan == {inter.request_id: 4, batch.request_id: 40}


# -- an interactive lane beside a batch flood, on a simulated clock ----------------------------

# What a step costs on a 2-core AVX2 machine with SmolLM2 in bf16 (seconds): a fixed cost,
# then per prompt token and per decoded token (attention over ~500 tokens of context).
STEP_FIXED, PER_PROMPT_TOKEN, PER_DECODE_TOKEN = 0.02, 0.0018, 0.004


def _cost(out: SchedulerOutput) -> float:
    decode = sum(1 for s in out.seqs if len(s.token_ids) == 1)
    return STEP_FIXED + PER_DECODE_TOKEN * decode + PER_PROMPT_TOKEN * (out.num_tokens - decode)


def _simulate(arrivals: list[tuple[float, Lane, int, int, str]], until: float, **config) -> dict[str, list[float]]:
    """Run the scheduler over `arrivals` (time, lane, prompt, output tokens, kind) on a
    clock that each step advances by its cost; returns the first-token latencies of each
    kind, and under "done" how many batch requests finished."""
    clock = [0.0]
    cfg = SchedulerConfig(**{"max_num_seqs": 128, "max_num_batched_tokens": 1024, **config})
    s = Scheduler(cfg, KVCacheManager(4096, 16, True), max_model_len=2048)
    s.clock = lambda: clock[0]
    pending, reqs, kind = sorted(arrivals, key=lambda a: a[0]), [], {}
    while clock[0] < until:
        while pending and pending[0][0] <= clock[0]:
            at, lane, prompt, output, kind[f"r{len(reqs)}"] = pending.pop(0)
            rid = f"r{len(reqs)}"
            req = Request(rid, [100 + zlib.crc32(f"{rid}:{i}".encode()) % 30000 for i in range(prompt)],
                          SamplingParams(max_tokens=output, ignore_eos=True), lane, None, "", (2,), arrival_time=at)
            s.add_request(req)
            reqs.append(req)
        if not s.has_unfinished():
            clock[0] = pending[0][0] if pending else until
            continue
        out = s.schedule()
        cost = _cost(out)
        clock[0] += cost
        s.update(out, {q.request_id: [7] for q in out.seqs if q.sample})
        s.observe_step(out, cost)
    ttft: dict = {"interactive": [], "batch": [], "warm": []}
    for r in reqs:
        if r.first_token_time is not None:
            ttft[kind[r.request_id]].append(r.first_token_time - r.arrival_time)
    ttft["done"] = sum(1 for r in reqs if kind[r.request_id] == "batch" and r.num_output_tokens == r.sampling.max_tokens)
    return ttft


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _workload(seed: int, duration: float, batch_rate: float) -> list[tuple[float, Lane, int, int, str]]:
    rng, out = random.Random(seed), []
    for lane, rate, prompt in ((I, 0.5, 128), (B, batch_rate, 512)):
        t = rng.expovariate(rate) if rate else duration
        while t < duration:
            out.append((t, lane, prompt, 32, lane.name.lower()))
            t += rng.expovariate(rate)
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_interactive_first_tokens_hold_under_a_batch_flood(seed):
    duration = 120.0
    # Capacity for 512+32-token batch requests under this cost model is about 1 per second.
    alone = _simulate(_workload(seed, duration, 0.0), duration)
    flood = _workload(seed, duration, 2.0)
    # The interactive lane was busy before the flood began (the hold is warm), as in service.
    warm = [(0.0, I, 128, 1, "warm")] + flood
    guarded = _simulate(warm, duration)
    strict = _simulate(warm, duration, background_step_seconds=1e9)  # the share grows to half a step
    fcfs = _simulate([(t, S, p, o, k) for t, _, p, o, k in warm], duration)
    base = _p99(alone["interactive"])
    assert _p99(guarded["interactive"]) <= 1.5 * base
    assert _p99(strict["interactive"]) > 1.5 * base and _p99(fcfs["interactive"]) > 10 * base
    assert guarded["done"] >= 10  # batch still makes progress


def test_the_engine_measures_every_step_it_executes(tiny_llama_dir):
    from tests.engine.test_engine_oracle import _engine

    engine = _engine(tiny_llama_dir, max_num_batched_tokens=32, block_size=8)
    for i in range(3):
        engine.add_request(list(range(5, 45 + i)), SamplingParams(max_tokens=4, ignore_eos=True), lane="batch")
    engine.add_request(list(range(7, 20)), SamplingParams(max_tokens=2, ignore_eos=True), lane="interactive")
    assert engine.stats().foreground_lane is None  # nothing planned yet
    engine.step()
    stats = engine.stats()
    assert stats.foreground_lane is Lane.INTERACTIVE
    assert stats.background_step_tokens == engine.scheduler.guard.tokens > 0
    steps = 1
    while engine.has_unfinished_requests():
        engine.step()
        steps += 0 if engine.idle_step else 1
    assert len(engine.scheduler.guard.cost) == steps > 4
