"""Which drafts the scheduler verifies, and what verifying them keeps, without a model."""
from __future__ import annotations

from loraplex.engine.config import SchedulerConfig
from loraplex.engine.request import Lane, Request, RequestStatus, SamplingParams
from loraplex.engine.sched.block_pool import KVCacheManager
from loraplex.engine.sched.lane_guard import CostModel
from loraplex.engine.sched.scheduler import Scheduler

EOS = 2


class Drafts:
    """Proposes `self.tokens[rid]` (cut to k) and remembers what it was asked."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.asked: list[tuple[str, int]] = []

    def __call__(self, req: Request, k: int) -> list[int]:
        self.asked.append((req.request_id, k))
        return self.tokens.get(req.request_id, [])[:k]


class CompiledGrammar:
    """What the scheduler asks of a request's grammar: whether it finished compiling."""

    def ready(self) -> bool:
        return True


def make(budget: int = 64, num_blocks: int = 64, max_drafts: int = 4, block_size: int = 4):
    drafts = Drafts()
    kv = KVCacheManager(num_blocks, block_size, True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, 512, propose=drafts, max_drafts=max_drafts)
    return s, drafts


def add(s: Scheduler, rid: str, prompt_len: int = 6, lane: Lane = Lane.STANDARD, max_tokens: int = 20,
        **sampling) -> Request:
    req = Request(rid, [100 + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens, **sampling),
                  lane, eos_token_ids=(EOS,))
    s.add_request(req)
    return req


def prefill(s: Scheduler, *reqs: Request) -> None:
    """Run the prompts and one sampled token each: every request is then decoding."""
    out = s.schedule()
    s.update(out, {seq.request_id: [7] for seq in out.seqs if seq.sample})
    assert all(r.num_output_tokens == 1 for r in reqs)


def test_drafts_ride_on_decodes_and_verification_keeps_the_agreeing_prefix():
    s, drafts = make()
    req = add(s, "a")
    prefill(s, req)
    drafts.tokens["a"] = [11, 12, 13, 14]
    out = s.schedule()
    (seq,) = out.seqs
    assert (seq.token_ids, seq.num_drafts, seq.start_pos) == ([7, 11, 12, 13, 14], 4, 6)
    assert len(seq.block_ids) * 4 >= 6 + 5, "the drafts' slots are allocated"
    # The model agrees with the first two drafts, then says 99 where the third said 13.
    s.update(out, {"a": [11, 12, 99, 50, 51]})
    assert req.output_token_ids == [7, 11, 12, 99]
    assert req.num_computed_tokens == 6 + 3, "the last kept token's KV is not computed yet"
    assert len(req.block_ids) == s.kv.blocks_needed(req.num_tokens), "rejected drafts' blocks go back"
    spec = s.speculation
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 4, 2)
    assert spec.accepted_per_position == [1, 1, 0, 0]
    s.kv.pool.check_invariants()


def test_all_drafts_kept_gives_one_token_more():
    s, drafts = make()
    req = add(s, "a")
    prefill(s, req)
    drafts.tokens["a"] = [11, 12]
    out = s.schedule()
    s.update(out, {"a": [11, 12, 13]})
    assert req.output_token_ids == [7, 11, 12, 13] and req.num_computed_tokens == 6 + 3


def test_a_stop_token_among_kept_drafts_ends_the_request_there():
    s, drafts = make()
    req = add(s, "a", ignore_eos=False)
    prefill(s, req)
    drafts.tokens["a"] = [11, EOS, 13]
    out = s.schedule()
    finished = s.update(out, {"a": [11, EOS, 13, 14]})
    assert finished == [req] and req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [7, 11, EOS]
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_drafts_never_overshoot_max_tokens():
    s, drafts = make()
    req = add(s, "a", max_tokens=3)
    prefill(s, req)
    drafts.tokens["a"] = [11, 12, 13, 14]
    out = s.schedule()
    assert out.seqs[0].num_drafts == 1, "two more tokens at most: one draft and the sample after it"
    finished = s.update(out, {"a": [11, 12]})
    assert finished == [req] and req.output_token_ids == [7, 11, 12]


def test_drafts_take_only_the_spare_budget():
    s, drafts = make(budget=8)
    a, b = add(s, "a", prompt_len=3), add(s, "b", prompt_len=3)
    prefill(s, a, b)
    drafts.tokens = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    waiting = add(s, "new", prompt_len=5)  # a prefill chunk that must not be displaced
    out = s.schedule()
    by_id = {seq.request_id: seq for seq in out.seqs}
    assert len(by_id["new"].token_ids) == 5, "real work is planned before any draft"
    assert by_id["a"].num_drafts + by_id["b"].num_drafts == 1 and out.num_tokens == 8
    assert waiting.status is RequestStatus.RUNNING


def test_the_interactive_lane_speculates_first():
    s, drafts = make(budget=5)
    std, inter = add(s, "std", prompt_len=2), add(s, "int", prompt_len=2, lane=Lane.INTERACTIVE)
    prefill(s, std, inter)
    drafts.tokens = {"std": [1, 2, 3, 4], "int": [5, 6, 7, 8]}
    out = s.schedule()
    by_id = {seq.request_id: seq for seq in out.seqs}
    assert (by_id["int"].num_drafts, by_id["std"].num_drafts) == (3, 0)


def test_drafts_need_free_blocks_and_preempt_nobody():
    s, drafts = make(num_blocks=4, block_size=4)
    a, b = add(s, "a", prompt_len=7, max_tokens=8), add(s, "b", prompt_len=7, max_tokens=8)
    prefill(s, a, b)  # 8 tokens each: the pool's 4 blocks are in use
    drafts.tokens = {"a": [1, 2, 3], "b": [4, 5, 6]}
    out = s.schedule()
    assert {seq.request_id for seq in out.seqs} == {"a", "b"} and not out.preempted
    assert all(seq.num_drafts == 0 for seq in out.seqs)


def test_requests_with_a_grammar_do_not_speculate():
    s, drafts = make()
    req = add(s, "a")
    req.grammar = CompiledGrammar()
    prefill(s, req)
    drafts.tokens["a"] = [1, 2]
    out = s.schedule()
    assert out.seqs[0].num_drafts == 0 and drafts.asked == []


def test_speculation_backs_off_when_the_batch_is_compute_bound():
    s, drafts = make(budget=256)
    reqs = [add(s, f"r{i}", prompt_len=3) for i in range(32)]
    prefill(s, *reqs)
    for r in reqs:
        drafts.tokens[r.request_id] = [1, 2, 3, 4]
    # A step's cost per token dwarfs its fixed cost: a draft pays only if nearly always right.
    compute_bound = CostModel(fixed=0.001, per_decode=0.01, per_prompt=0.01)
    assert compute_bound.break_even(32, 0) > 0.95
    s.guard.cost.model = lambda: compute_bound
    out = s.schedule()
    assert all(seq.num_drafts == 0 for seq in out.seqs)
    # Mostly a fixed cost (one request, memory-bound step): any plausible draft pays.
    light = CostModel(fixed=0.02, per_decode=0.0002, per_prompt=0.0002)
    assert light.break_even(1, 0) < 0.02


def drafting(steps: int, model_agrees: bool) -> tuple[Scheduler, list[int]]:
    """One decoding request, break-even 0.27, its drafts always right or always wrong:
    how many it drafts at each step."""
    s, drafts = make()
    prefill(s, add(s, "a", max_tokens=200))
    s.guard.cost.model = lambda: CostModel(fixed=0.01, per_decode=0.001, per_prompt=0.003)
    drafted = []
    for _ in range(steps):
        drafts.tokens["a"] = [11, 12, 13, 14]
        out = s.schedule()
        k = out.seqs[0].num_drafts
        drafted.append(k)
        s.update(out, {"a": ([11, 12, 13, 14][:k] if model_agrees else [9] * k) + [15]})
    return s, drafted


def test_a_request_whose_drafts_fail_stops_drafting_then_probes():
    s, drafted = drafting(40, model_agrees=False)
    assert s.speculation.rate("a") < 0.27, "below the break-even"
    assert drafted[0] == 1, "a fresh request is presumed right half the time: one draft pays, two do not"
    assert drafted[-16:].count(0) == 15 and drafted[-16:].count(1) == 1, drafted


def test_finished_requests_leave_no_speculation_state():
    s, drafts = make()
    req = add(s, "a", max_tokens=2)
    prefill(s, req)
    drafts.tokens["a"] = [1, 2]
    out = s.schedule()
    assert out.seqs[0].num_drafts == 0, "max_tokens 2 leaves room for the sample alone"
    s.update(out, {"a": [5]})
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert s.speculation.rate("a") is None


def test_drafts_grow_with_the_acceptance_rate():
    _, drafted = drafting(12, model_agrees=True)
    assert drafted[0] == 1 and drafted[-1] == 4 and drafted == sorted(drafted), drafted
