"""Iteration-level scheduler: one token budget per step, lanes, preemption, adapters.

`schedule()` decides and returns plain data; `update()` applies a step's sampled
tokens. Neither touches tensors, so both are unit-tested without a model.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable

from ..config import SchedulerConfig
from ..errors import EngineOverloadedError, PromptTooLongError
from ..request import AdapterRef, Lane, Request, RequestStatus
from .adapter_memory import AdapterMemory
from .block_pool import KVCacheManager
from .fair_lanes import waiting_queue
from .lane_guard import LaneGuard, Split
from .request_queue import POLICIES
from .speculation import Speculation
from .step_plan import Budget, ScheduledSeq, SchedulerOutput, StepPlan


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 max_loras: int | None = None, adapter_ready: Callable[[AdapterRef], bool] | None = None,
                 adapter_pages: Callable[[AdapterRef], int] | None = None,
                 propose: Callable[[Request, int], list[int]] | None = None, max_drafts: int = 0) -> None:
        self.config = config
        # Whether an adapter's weights can go onto the device now (loaded in the CPU
        # tier); a request whose adapter is not ready waits without blocking others.
        self.adapter_ready = adapter_ready or (lambda ref: True)
        # KV blocks a ready adapter's device copy takes (asked only once it is ready).
        self.adapter_pages = adapter_pages or (lambda ref: 1)
        self.kv = kv
        self.max_model_len = max_model_len
        # Adapters share the KV pool's memory; `max_loras` optionally caps how many are resident.
        self.adapters = AdapterMemory(kv.pool, max_loras)
        self.waiting = waiting_queue(config, lambda: self.clock())
        self.policy = POLICIES[config.policy](config.max_num_seqs)
        self.foreground_lane: Lane | None = None  # as of the last plan
        self.guard = LaneGuard(config.lane_hold_seconds, config.background_step_seconds,
                               config.max_num_batched_tokens)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # The lane each running request was admitted at, aging included: its order among
        # the running requests of its class (foreground or background).
        self._run_lane: dict[str, int] = {}
        self.num_preemptions = 0
        # Preemptions by the lane the victim ran at (aging included).
        self.preemptions_by_lane: dict[Lane, int] = {lane: 0 for lane in Lane}
        self.clock = time.monotonic  # replaceable in tests
        # Prompt tokens already billed to each request's tenant: a recompute after a
        # preemption is the scheduler's choice, not the tenant's, and is not billed again.
        self._billed: dict[str, int] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)
        # Speculative decoding: `propose(req, k)` drafts up to k tokens; None: off.
        self.propose = propose
        self.speculation = Speculation(max_drafts, max_model_len, kv) if propose and max_drafts else None

    # -- admission --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        need = req.num_prompt_tokens + req.sampling.max_tokens
        if need > self.max_model_len:
            raise PromptTooLongError(
                f"this request needs {need} tokens ({req.num_prompt_tokens} prompt + "
                f"{req.sampling.max_tokens} max_tokens) but the model's context is {self.max_model_len}")
        if self.kv.blocks_needed(need) > self.kv.pool.num_blocks:
            raise PromptTooLongError(
                f"this request needs {need} tokens of KV cache but the whole pool holds "
                f"{self.kv.pool.num_blocks * self.kv.block_size}")
        if not self.config.enable_chunked_prefill and need - 1 > self.config.max_num_batched_tokens:
            # Without chunking every prefill (and every recompute after a preemption, up to
            # need - 1 tokens) runs in one step; a longer one would wait forever at the head.
            raise PromptTooLongError(
                f"this request may need {need - 1} tokens in one step but chunked prefill is off "
                f"and max_num_batched_tokens is {self.config.max_num_batched_tokens}")
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(f"{len(self.waiting)} requests are already waiting; try again later")
        self.waiting.check(req)
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        req.status = RequestStatus.WAITING
        req.enqueue_time = self.clock()
        self.requests[req.request_id] = req
        self.waiting.push(req)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, req.request_id))

    def expire(self) -> list[Request]:
        """Finish every request past its deadline (FINISHED_TIMEOUT), freeing what it holds."""
        now, expired = self.clock(), []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, rid = heapq.heappop(self._deadlines)
            req = self.requests.get(rid)
            if req is not None and req.deadline == deadline:
                expired.append(self.finish(rid, RequestStatus.FINISHED_TIMEOUT))
        return expired

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step's plan --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = StepPlan(SchedulerOutput())
        self.running.sort(key=self._running_priority)
        split = self._split()
        self.foreground_lane = None if split is None else Lane(split.top)
        total = self.config.max_num_batched_tokens
        if split is None:
            budget = Budget(total)
            self._continue(list(self.running), budget, step, lambda req: self.running[-1])
            self._admit(step, budget, 0, len(Lane) - 1, self._lower_lane_victim)
        else:
            self._schedule_split(step, split, total)
        out = step.out
        out.seqs = list(step.scheduled.values())
        if self.speculation is not None:
            self.speculation.extend(out, self.requests, self.propose,
                                    self.config.max_num_batched_tokens - out.num_tokens, self.guard.cost.model())
        self._charge_prefill(out)
        out.adapter_evictions = self.adapters.take_evicted()
        out.adapter_loads = self.adapters.loads(
            [(s.adapter_slot, self.requests[s.request_id].adapter) for s in out.seqs if s.adapter_slot >= 0])
        return out

    def _schedule_split(self, step: StepPlan, split: Split, total: int) -> None:
        """The foreground first, from its budget; the background from its share. The
        background's first request, once it has waited as long as aging takes to reach the
        foreground's lane, is served before the foreground and never preempted for it:
        lower lanes are throttled while a higher lane is held, never starved."""
        # Without chunked prefill a capped background could never fit a whole prompt:
        # it then takes what the foreground leaves, as strict priority would.
        chunked = self.config.enable_chunked_prefill
        if chunked:
            bg_budget = Budget(split.background_tokens, split.background_units, split.decode_weight,
                               split.prompt_weight)
            fg_budget = Budget(total - split.background_tokens)
        else:
            bg_budget = fg_budget = Budget(total)
        fg = [r for r in self.running if not split.is_background(r.lane)]
        now = self.clock()

        def aged(req: Request) -> bool:
            return self.waiting.effective_lane(req, now) <= split.top

        def bg_victim(req: Request) -> Request | None:  # the newest unprotected background request
            rest = self._background(split)
            rest = rest[1:] if rest and aged(rest[0]) else rest
            return rest[-1] if rest else None

        bg = self._background(split)
        due = bool(bg) and aged(bg[0])

        if due:
            self._continue(bg[:1], bg_budget, step, lambda req: bg_victim(req) or self._last_running(fg) or req)
        self._continue(fg, fg_budget, step, lambda req: bg_victim(req) or self._last_running(fg))
        self._continue(bg[1:] if due else bg, bg_budget, step, bg_victim)

        def admit_bg() -> None:
            self._admit(step, bg_budget, split.top + 1, len(Lane) - 1, self._lower_lane_victim)

        # With nothing of the background running, its aged head is admitted first: freed
        # seats and blocks go to it before the foreground's next arrival.
        head = next(self.waiting.iter_lanes(split.top + 1, len(Lane) - 1), None) if not bg else None
        head_first = head is not None and aged(head)
        if head_first:
            admit_bg()
        self._admit(step, fg_budget, 0, split.top, bg_victim, seats=True)
        if not head_first:
            admit_bg()

    def _last_running(self, reqs: list[Request]) -> Request | None:
        return next((r for r in reversed(reqs) if r.status is RequestStatus.RUNNING), None)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """How long a planned step took to execute (the engine measures it)."""
        decoded = sum(1 for s in out.seqs if len(s.token_ids) == 1)
        self.guard.observe(decoded, out.num_tokens - decoded, seconds)

    def _split(self) -> Split | None:
        busy = {int(r.lane) for r in self.running}
        busy.update(int(lane) for lane, n in self.waiting.lane_sizes().items() if n)
        return self.guard.split(busy, self.clock())

    def _background(self, split: Split) -> list[Request]:
        """Running background requests in priority order: the first, once it has aged to
        the foreground's lane, is the one the foreground never preempts."""
        return [r for r in self.running if split.is_background(r.lane)]

    def _continue(self, reqs: list[Request], budget: Budget, step: StepPlan,
                  victim_of: Callable[[Request], Request]) -> None:
        """Plan the next tokens of running requests, in order, from `budget`; when the KV
        pool is full, preempt `victim_of(req)` (which may be `req` itself) until it fits."""
        for req in reqs:
            if budget.exhausted():
                return
            if req.status is not RequestStatus.RUNNING or req.paused:
                continue  # preempted earlier in this step, or its reader fell behind
            n = budget.room(req.num_tokens - req.num_computed_tokens)
            if n <= 0 or (not self.config.enable_chunked_prefill and n < req.num_tokens - req.num_computed_tokens):
                continue
            while not self.kv.allocate_slots(req, n):
                victim = victim_of(req)
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                step.add(self._plan(req, n), budget)

    def _charge_prefill(self, out: SchedulerOutput) -> None:
        for seq in out.seqs:
            req = self.requests[seq.request_id]
            billed = self._billed.get(req.request_id, 0)
            end = min(seq.start_pos + len(seq.token_ids), req.num_prompt_tokens)
            if end > max(seq.start_pos, billed):
                self.waiting.charge(req, input_tokens=end - max(seq.start_pos, billed))
                self._billed[req.request_id] = end

    def _running_priority(self, req: Request) -> tuple[int, float]:
        return self._run_lane.get(req.request_id, int(req.lane)), req.arrival_time

    def _plan(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        row = self.adapters.row_of(req.adapter.digest) if req.adapter else -1
        return ScheduledSeq(req.request_id, req.token_slice(start, start + n), start,
                            list(req.block_ids), start + n == req.num_tokens, row)

    def _admit(self, step: StepPlan, budget: Budget, first: int, last: int,
               victim_of: Callable[[Request], Request | None], seats: bool = False) -> None:
        """Start waiting requests of lanes [first, last] from `budget`; `victim_of(req)`
        names a running request `req` may preempt for KV (and, with `seats`, for a seat)."""
        if budget.exhausted() or (len(self.running) >= self.config.max_num_seqs and not seats):
            return
        starving = None  # the first request kept out because its adapter's pages do not fit
        for req in self.policy.candidates(self.waiting, len(self.running), first, last):
            if budget.exhausted():
                return
            if req.grammar is not None and not req.grammar.ready():
                continue  # its grammar is still compiling; the others go ahead
            if req.waits_for_leader():
                continue  # admitted once its sibling's prompt blocks are cached
            if req.request_id in step.out.preempted:
                continue  # preempted for someone this step: its blocks are theirs
            pages = 0
            if req.adapter is not None:
                d = req.adapter.digest
                if self.adapters.row_of(d) is None:
                    if not self.adapter_ready(req.adapter):
                        continue
                    pages = self.adapter_pages(req.adapter)
                if not self.adapters.can_acquire(d, pages):
                    if pages + self.kv.blocks_needed(req.num_tokens) <= self.kv.pool.num_blocks:
                        starving = starving or req  # memory frees up: it rotates in
                    continue  # else it can never fit: it must not hold the others back
                if starving is not None and self.clock() - starving.enqueue_time > self.config.aging_seconds:
                    # Memory is short: let the pinned adapters drain so the starving one
                    # fits; hot adapters cannot monopolise the device.
                    continue
            if not self._make_seat(req, step, victim_of if seats else None):
                return
            cached, n_cached = self.kv.get_computed_blocks(req)
            n = budget.room(req.num_tokens - n_cached)
            if n <= 0:
                return  # not one more prompt token fits
            if not self.config.enable_chunked_prefill and n < req.num_tokens - n_cached:
                return  # the head request waits for a step with room for all of it
            placed = self._place(req, n, cached, pages, step, victim_of)
            if placed is None:
                return  # memory full: admit nobody behind it either
            if not placed:
                starving = starving or req  # its adapter's pages do not fit beside the KV
                continue
            self._start(req, n_cached, step.out, first)
            step.add(self._plan(req, n), budget)

    def _place(self, req: Request, n: int, cached: list[int], pages: int, step: StepPlan,
               victim_of: Callable[[Request], Request | None]) -> bool | None:
        """KV blocks for `n` tokens of `req` and its adapter (`pages` if not resident),
        preempting `victim_of(req)` while they do not fit. None: the KV does not fit;
        False: the KV fits but the adapter's pages do not (nothing is held either way)."""
        while True:
            if self.kv.allocate_slots(req, n, cached):
                if req.adapter is None or self.adapters.acquire(req.adapter, pages):
                    return True
                self.kv.free(req)
                kv_fits = True
            else:
                kv_fits = False
            victim = victim_of(req)
            if victim is None:
                return False if kv_fits else None
            self._preempt(victim, step)

    def _make_seat(self, req: Request, step: StepPlan,
                   victim_of: Callable[[Request], Request | None] | None) -> bool:
        while len(self.running) >= self.config.max_num_seqs:
            victim = victim_of(req) if victim_of is not None else None
            if victim is None:
                return False
            self._preempt(victim, step)
        return True

    def _start(self, req: Request, n_cached: int, out: SchedulerOutput, floor: int) -> None:
        self.policy.admitted(req)
        self.waiting.remove(req)
        req.num_computed_tokens = n_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_cached
        req.status = RequestStatus.RUNNING
        now = self.clock()
        if req.scheduled_time is None:
            req.scheduled_time = now
        self._run_lane[req.request_id] = max(floor, self.waiting.effective_lane(req, now))
        self.running.append(req)

    def _lower_lane_victim(self, req: Request) -> Request | None:
        """A request may preempt running work admitted at a strictly lower lane."""
        cands = [r for r in self.running if self._running_priority(r)[0] > req.lane]
        return max(cands, key=self._running_priority) if cands else None

    def _preempt(self, victim: Request, step: StepPlan) -> None:
        """Preempt by recompute: drop the KV, requeue; greedy output stays identical."""
        self.running.remove(victim)
        self.preemptions_by_lane[Lane(self._run_lane.pop(victim.request_id, int(victim.lane)))] += 1
        step.drop(victim.request_id)
        self.kv.free(victim)
        if victim.adapter is not None:
            self.adapters.release(victim.adapter.digest)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        victim.enqueue_time = self.clock()
        self.waiting.push(victim)
        self.policy.requeued(victim)
        self.num_preemptions += 1
        step.out.preempted.append(victim.request_id)

    # -- after the step -----------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens and append each sampled request's new tokens (one, or
        with drafts what verifying them kept); returns the requests that finished."""
        finished = []
        now = self.clock()
        for seq in out.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            prev = req.num_computed_tokens
            tokens = sampled.get(seq.request_id, []) if seq.sample else []
            if seq.num_drafts:
                tokens = self.speculation.accepted(seq, tokens)
                self.speculation.record(req, seq.num_drafts, len(tokens) - 1)
            # A rejected draft's KV is not the request's: it is computed again, over.
            req.num_computed_tokens += len(seq.token_ids) - seq.num_drafts + max(len(tokens) - 1, 0)
            self.kv.cache_computed(req, prev)
            for token in tokens:
                req.output_token_ids.append(token)
                self.waiting.charge(req, output_tokens=1)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = req.stop_status(token, self.max_model_len)
                if status is not None:
                    self.finish(req.request_id, status)
                    finished.append(req)
                    break
            if seq.num_drafts and req.status is RequestStatus.RUNNING:
                self.kv.trim(req, req.num_tokens)
        return finished

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish or abort at any point; frees the request's blocks and adapter pin."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._billed.pop(request_id, None)
        if self.speculation is not None:
            self.speculation.forget(request_id)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._run_lane.pop(request_id, None)
            if req.adapter is not None:
                self.adapters.release(req.adapter.digest)
        else:
            self.waiting.remove(req)
            self.policy.dropped(req)
        self.kv.free(req)
        req.status = status
        return req

    # -- introspection ----------------------------------------------------------
    def lane_counts(self) -> dict[str, dict[str, int]]:
        counts = {lane.name.lower(): {"running": 0, "waiting": 0} for lane in Lane}
        for r in self.running:
            counts[r.lane.name.lower()]["running"] += 1
        # Per lane, not a walk of the queue: stats are taken after every step.
        for lane, n in self.waiting.lane_sizes().items():
            counts[lane.name.lower()]["waiting"] = n
        return counts

