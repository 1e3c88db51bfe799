"""Iteration-level scheduler: one token budget per step, lanes, preemption, adapters.

`schedule()` decides and returns plain data; `update()` applies a step's sampled
tokens. Neither touches tensors, so both are unit-tested without a model.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable
from dataclasses import dataclass, field

from .adapter_slots import AdapterSlots
from .block_pool import KVCacheManager
from .config import SchedulerConfig
from .errors import EngineOverloadedError, PromptTooLongError
from .fair_lanes import FairLaneQueue
from .fairness import FairnessConfig
from .request import AdapterRef, Lane, Request, RequestStatus
from .request_queue import POLICIES, LaneQueue, RequestQueue


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this step reaches the last known token
    adapter_slot: int  # -1: base model


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # (slot, adapter) pairs the runner must load before executing this step.
    adapter_loads: list[tuple[int, AdapterRef]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 max_loras: int = 8, adapter_ready: Callable[[AdapterRef], bool] | None = None) -> None:
        self.config = config
        # Whether an adapter's weights can go into a device slot now (loaded in the CPU
        # tier); a request whose adapter is not ready waits without blocking others.
        self.adapter_ready = adapter_ready or (lambda ref: True)
        self.kv = kv
        self.max_model_len = max_model_len
        self.slots = AdapterSlots(max_loras)
        self.waiting = _waiting_queue(config, lambda: self.clock())
        self.policy = POLICIES[config.policy](config.max_num_seqs)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # The lane each running request was admitted at, aging included: its priority while
        # it runs, so an aged batch request is not preempted by the next interactive arrival.
        self._run_lane: dict[str, int] = {}
        self.num_preemptions = 0
        # Preemptions by the lane the victim ran at (aging included).
        self.preemptions_by_lane: dict[Lane, int] = {lane: 0 for lane in Lane}
        self.clock = time.monotonic  # replaceable in tests
        # Prompt tokens already billed to each request's tenant: a recompute after a
        # preemption is the scheduler's choice, not the tenant's, and is not billed again.
        self._billed: dict[str, int] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)

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
        out = SchedulerOutput()
        budget = [self.config.max_num_batched_tokens]
        scheduled: dict[str, ScheduledSeq] = {}
        self.running.sort(key=self._running_priority)
        i = 0
        while i < len(self.running) and budget[0] > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget[0])
            if not self.config.enable_chunked_prefill and n < req.num_tokens - req.num_computed_tokens:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, out, scheduled, budget)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the list shrank under us
            scheduled[req.request_id] = self._plan(req, n)
            budget[0] -= n
            i += 1
        self._admit(out, scheduled, budget)
        out.seqs = list(scheduled.values())
        self._charge_prefill(out)
        return out

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
        slot = self.slots.slot_of(req.adapter.digest) if req.adapter else -1
        return ScheduledSeq(req.request_id, req.token_slice(start, start + n), start,
                            list(req.block_ids), start + n == req.num_tokens, slot)

    def _admit(self, out: SchedulerOutput, scheduled: dict[str, ScheduledSeq], budget: list[int]) -> None:
        if budget[0] <= 0 or len(self.running) >= self.config.max_num_seqs:
            return
        starving = None  # the first request kept out by adapter slots
        for req in self.policy.candidates(self.waiting, len(self.running)):
            if budget[0] <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.grammar is not None and not req.grammar.ready():
                continue  # its grammar is still compiling; the others go ahead
            if req.waits_for_leader():
                continue  # admitted once its sibling's prompt blocks are cached
            if req.adapter is not None:
                d = req.adapter.digest
                if not self.slots.can_acquire(d):
                    starving = starving or req
                    continue
                if self.slots.slot_of(d) is None and not self.adapter_ready(req.adapter):
                    continue
                if starving is not None and self.clock() - starving.enqueue_time > self.config.aging_seconds:
                    # Let pinned adapters drain so the starving one gets a slot:
                    # a hot adapter cannot monopolise the slots.
                    continue
            cached, n_cached = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - n_cached, budget[0])
            if not self.config.enable_chunked_prefill and n < req.num_tokens - n_cached:
                return  # the head request waits for a step with room for all of it
            while not self.kv.allocate_slots(req, n, cached):
                victim = self._lower_lane_victim(req)
                if victim is None:
                    return  # memory full: admit nobody behind it either
                self._preempt(victim, out, scheduled, budget)
            self._start(req, n_cached, out)
            scheduled[req.request_id] = self._plan(req, n)
            budget[0] -= n

    def _start(self, req: Request, n_cached: int, out: SchedulerOutput) -> None:
        if req.adapter is not None:
            slot, load = self.slots.acquire(req.adapter)
            if load:
                out.adapter_loads.append((slot, req.adapter))
        self.policy.admitted(req)
        self.waiting.remove(req)
        req.num_computed_tokens = n_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_cached
        req.status = RequestStatus.RUNNING
        now = self.clock()
        if req.scheduled_time is None:
            req.scheduled_time = now
        self._run_lane[req.request_id] = self.waiting.effective_lane(req, now)
        self.running.append(req)

    def _lower_lane_victim(self, req: Request) -> Request | None:
        """Interactive traffic may preempt running work admitted at a strictly lower lane."""
        cands = [r for r in self.running if self._running_priority(r)[0] > req.lane]
        return max(cands, key=self._running_priority) if cands else None

    def _preempt(self, victim: Request, out: SchedulerOutput, scheduled: dict[str, ScheduledSeq],
                 budget: list[int]) -> None:
        """Preempt by recompute: drop the KV, requeue; greedy output stays identical."""
        self.running.remove(victim)
        self.preemptions_by_lane[Lane(self._run_lane.pop(victim.request_id, int(victim.lane)))] += 1
        planned = scheduled.pop(victim.request_id, None)
        if planned is not None:
            budget[0] += len(planned.token_ids)
        self.kv.free(victim)
        if victim.adapter is not None:
            self.slots.release(victim.adapter.digest)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        victim.enqueue_time = self.clock()
        self.waiting.push(victim)
        self.policy.requeued(victim)
        self.num_preemptions += 1
        out.preempted.append(victim.request_id)

    # -- after the step -----------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens; returns requests that finished."""
        finished = []
        now = self.clock()
        for seq in out.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            prev = req.num_computed_tokens
            req.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_computed(req, prev)
            if not seq.sample:
                continue
            token = sampled[seq.request_id]
            req.output_token_ids.append(token)
            self.waiting.charge(req, output_tokens=1)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._check_stop(req, token)
            if status is not None:
                self.finish(req.request_id, status)
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish or abort at any point; frees the request's blocks and adapter pin."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._billed.pop(request_id, None)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._run_lane.pop(request_id, None)
            if req.adapter is not None:
                self.slots.release(req.adapter.digest)
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


def _waiting_queue(config: SchedulerConfig, clock: Callable[[], float]) -> RequestQueue:
    if config.scheduling == "fcfs":
        return LaneQueue(config.aging_seconds, clock)
    # max_waiting 0 (refuse everything) is the scheduler's own check; the shares need >= 1.
    fairness = FairnessConfig(max_waiting=max(1, config.max_waiting), tenant_share=config.tenant_queue_share)
    return FairLaneQueue(config.aging_seconds, clock, fairness)
