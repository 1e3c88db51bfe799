"""Which drafts a step verifies, and what verifying them keeps. Plain data, no tensors.

Drafts ride in the step's spare token budget only, after every decode and prefill chunk
has been planned, interactive lane first: speculation never displaces real work. A
request speculates when its drafts pay: each drafted token costs about what a prompt
token costs (the step's measured cost model, `StepCost`), and is worth the step's cost
per output token times the chance it is accepted (the request's running acceptance
rate). At low load a step's fixed cost dominates and nearly any draft pays; when the
batch is compute-bound a token computed costs what it produces and only drafts that are
almost always right still pay, so speculation backs off by itself.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from ..request import Request
from .block_pool import KVCacheManager
from .lane_guard import CostModel
from .step_plan import ScheduledSeq, SchedulerOutput

# A request's acceptance rate starts here and moves this much toward each step's outcome.
_PRIOR_ACCEPTANCE = 0.5
_EMA = 0.3
# A request whose drafts stopped paying still tries one draft this often (in its steps),
# so a request whose output turns repetitive is noticed.
_PROBE_EVERY = 16


class Speculation:
    """Contract: `extend(out, requests, drafts, room, cost)` widens the planned decodes of
    step `out` with their drafts (`drafts(req, k)` proposes at most k) while `room` tokens of
    the step's budget and free KV blocks allow, never preempting anyone for them;
    `accepted(seq, sampled)` is what verifying `seq` keeps; `record(req, proposed,
    accepted)` feeds the request's acceptance rate; `forget(request_id)` at its end."""

    def __init__(self, max_drafts: int, max_model_len: int, kv: KVCacheManager) -> None:
        self.max_drafts, self.max_model_len, self.kv = max_drafts, max_model_len, kv
        self._rate: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        # Per accepted position (0 = the first draft), as vLLM's per-position counter.
        self.accepted_per_position = [0] * max_drafts
        # adapter name ("" for the base model) -> [draft tokens, accepted tokens]
        self.by_adapter: dict[str, list[int]] = {}

    def extend(self, out: SchedulerOutput, requests: dict[str, Request],
               drafts: Callable[[Request, int], list[int]], room: int, cost: CostModel | None) -> None:
        seqs = out.seqs
        decoded = sum(1 for s in seqs if len(s.token_ids) == 1)
        threshold = cost.break_even(decoded, out.num_tokens - decoded) if cost else 0.0
        for i in self._candidates(seqs, requests):
            if room <= 0:
                return
            seq, req = seqs[i], requests[seqs[i].request_id]
            k = min(self._want(req, threshold), room, self._limit(req))
            proposed = drafts(req, k) if k > 0 else []
            if not proposed or not self.kv.allocate_slots(req, 1 + len(proposed)):
                continue
            seqs[i] = replace(seq, token_ids=seq.token_ids + proposed, num_drafts=len(proposed),
                              block_ids=list(req.block_ids))
            room -= len(proposed)

    def accepted(self, seq: ScheduledSeq, sampled: list[int]) -> list[int]:
        """The tokens verifying `seq` produces: its drafts up to the first one the model's
        own sample differs from, then that sample (or, all drafts kept, the next one)."""
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts:]
        n = 0
        while n < len(drafts) and sampled[n] == drafts[n]:
            n += 1
        return sampled[:n + 1]

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        rate = self._rate.get(req.request_id, _PRIOR_ACCEPTANCE)
        self._rate[req.request_id] = (1 - _EMA) * rate + _EMA * accepted / proposed
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_position[pos] += 1
        counts = self.by_adapter.setdefault(req.adapter.name if req.adapter else "", [0, 0])
        counts[0] += proposed
        counts[1] += accepted

    def rate(self, request_id: str) -> float | None:
        """The request's running acceptance rate; None before its first verified draft."""
        return self._rate.get(request_id)

    def forget(self, request_id: str) -> None:
        self._rate.pop(request_id, None)
        self._skipped.pop(request_id, None)

    def _candidates(self, seqs: list[ScheduledSeq], requests: dict[str, Request]) -> Iterable[int]:
        """Indices of planned plain decodes that may speculate, highest lane first, then
        the requests most likely to be right."""
        idx = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 and s.sample
               and requests[s.request_id].grammar is None]
        return sorted(idx, key=lambda i: (requests[seqs[i].request_id].lane,
                                          -self._rate.get(seqs[i].request_id, _PRIOR_ACCEPTANCE)))

    def _want(self, req: Request, threshold: float) -> int:
        """Drafts worth verifying: the j-th is kept only if the j - 1 before it were, with
        chance rate^j, so drafting stops where rate^j no longer beats the break-even."""
        rate = self._rate.get(req.request_id, _PRIOR_ACCEPTANCE)
        if rate > threshold:
            if threshold <= 0 or rate >= 1:
                return self.max_drafts
            return max(1, min(self.max_drafts, int(math.log(threshold) / math.log(rate))))
        skipped = self._skipped.get(req.request_id, 0) + 1
        self._skipped[req.request_id] = skipped % _PROBE_EVERY
        return 1 if skipped >= _PROBE_EVERY else 0

    def _limit(self, req: Request) -> int:
        """Drafts that cannot overshoot max_tokens or the context (the sample after the
        last draft is an output token too)."""
        return min(req.sampling.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
