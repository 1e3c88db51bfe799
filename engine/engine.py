"""The synchronous engine: `step()` = schedule -> execute -> update."""
from __future__ import annotations

import itertools
import logging
import math
import numbers
import time
from collections import Counter, deque
from dataclasses import dataclass, replace

import torch

from .checkpoint import ModelArch, resolve_model_dir
from .client import AdapterLoad, AdapterResidency, EngineStats, LaneDepth, SpecDecodeStats
from .config import EngineConfig
from .errors import InvalidRequestError, UnknownAdapterError
from .output import RequestOutput
from .output_processor import OutputProcessor
from .request import AdapterRef, Lane, Request, RequestStatus, SamplingParams
from .runner.model_runner import ModelRunner
from .sched.block_pool import KVCacheManager
from .sched.scheduler import Scheduler
from .spec import DraftProposer, create_proposer
from .structured.compile_pool import CompilePool
from .structured.grammar import GrammarCompiler, RequestGrammar, StructuredConfig
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Tenancy:
    """Who a request is for: its place in tenant-fair order, and its deadline."""

    tenant: str
    weight: float
    deadline: float | None  # scheduler clock; None: no limit


@dataclass
class _Group:
    """An n > 1 request: its choices run as requests `{id}#{index}`."""

    request_id: str
    child_ids: list[str]
    unfinished: set[str]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, lora_manager=None, proposer: DraftProposer | None = None
                 ) -> None:
        """`proposer`: where drafts come from when `config.speculative` is on (default: the
        one its `method` names)."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(config.model.model)
        self.arch = ModelArch.from_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.max_model_len = min(config.model.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.lora = lora_manager
        self.runner = ModelRunner(config, self.arch, str(self.model_dir), lora_manager)
        self.proposer = (proposer or create_proposer(config.speculative)) if config.speculative.enabled else None
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len,
                                   lora_manager.max_rows if lora_manager is not None else None,
                                   adapter_ready=lora_manager.ready if lora_manager is not None else None,
                                   adapter_pages=self._adapter_pages if lora_manager is not None else None,
                                   propose=self.proposer.propose if self.proposer else None,
                                   max_drafts=config.speculative.num_speculative_tokens)
        self.outputs = OutputProcessor(self.tokenizer, self._finish)
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[str, tuple[_Group, int]] = {}  # child id -> (group, index)
        self._ids = itertools.count()
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        self.idle_step = False
        # Adapter activity on the device, by adapter name: what metrics read.
        self.adapter_loads: Counter[str] = Counter()
        self.adapter_evictions: Counter[str] = Counter()
        self.recent_adapter_loads: deque[AdapterLoad] = deque(maxlen=256)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        sc: StructuredConfig = self.grammars.config
        # Used by the async layer before a request is queued; the engine thread never compiles.
        self.grammar_pool = CompilePool(self.grammars.compile, threads=sc.compile_threads,
                                        deadline=sc.compile_deadline, max_per_tenant=sc.max_compiles_per_tenant,
                                        cache_size=sc.cache_size, nice=sc.compile_nice)
        # Emit token-less outputs for prefill chunks (metering bills an abort mid-prefill).
        self.report_prefill = False

    # -- requests -----------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                    request_id: str | None = None, lane: Lane | str = Lane.STANDARD,
                    adapter: str | AdapterRef | None = None, cache_salt: str = "", tenant: str = "",
                    tenant_weight: float = 1.0, timeout: float | None = None, grammar: object = None) -> str:
        """Queue a request. `tenant` and `tenant_weight` place it in tenant-fair order;
        after `timeout` seconds (None: never) it finishes with reason "timeout".
        `grammar`: the compiled grammar of `sampling.structured_output` (from
        `grammar_pool`); without it the grammar is compiled here, blocking the caller."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if not math.isfinite(sampling.temperature):
            # SamplingParams lets NaN through (NaN < 0 is false); it would sample garbage.
            raise InvalidRequestError("temperature must be a finite number >= 0")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # Integers only: 1.5 would pass the range check and be truncated by torch.
        if not all(isinstance(t, numbers.Integral) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers")
        ids = [int(t) for t in ids]
        if any(not 0 <= t < self.arch.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.arch.vocab_size})")
        sampling.check_vocab(self.arch.vocab_size)
        _check_tenant(tenant, tenant_weight, timeout)
        if sampling.structured_output is not None and grammar is None:
            grammar = self.grammar_pool.compile_now(sampling.structured_output, tenant)
        tenancy = _Tenancy(tenant, float(tenant_weight),
                           None if timeout is None else self.scheduler.clock() + timeout)
        ref = self._adapter_ref(adapter)
        rid = request_id or f"req-{next(self._ids)}"
        if sampling.n == 1:
            self._add(rid, ids, sampling, Lane.parse(lane), ref, cache_salt, tenancy, grammar)
            return rid
        self._check_free(rid)
        group = _Group(rid, [f"{rid}#{i}" for i in range(sampling.n)], set())
        leader = None
        try:
            for i, cid in enumerate(group.child_ids):
                req = self._add(cid, ids, _choice_params(sampling, i), Lane.parse(lane), ref, cache_salt, tenancy,
                                grammar)
                if leader is not None and self.kv.enable_prefix_caching:
                    req.prefill_leader = leader
                leader = leader or req
                group.unfinished.add(cid)
                self._choice_of[cid] = (group, i)
        except BaseException:
            for cid in group.unfinished:  # all choices or none
                self._choice_of.pop(cid, None)
                self.abort_request(cid)
            raise
        self._groups[rid] = group
        return rid

    def _check_free(self, rid: str) -> None:
        if rid in self.scheduler.requests or rid in self.outputs or rid in self._groups:
            # The scheduler only asserts this; a reused id would cross two requests' streams.
            raise InvalidRequestError(f"request id {rid!r} is already in use")

    def _add(self, rid: str, ids: list[int], sampling: SamplingParams, lane: Lane, ref: AdapterRef | None,
             cache_salt: str, tenant: _Tenancy, grammar: object = None) -> Request:
        self._check_free(rid)
        req = Request(rid, ids, sampling, lane, ref, cache_salt, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                      tenant=tenant.tenant, tenant_weight=tenant.weight, deadline=tenant.deadline)
        if sampling.structured_output is not None:
            req.grammar = RequestGrammar(grammar, self.grammars.stop_token_ids)
        self.scheduler.add_request(req)
        if ref is not None:
            self.lora.retain(ref)
        self.outputs.add(req)
        return req

    def _adapter_ref(self, adapter: str | AdapterRef | None) -> AdapterRef | None:
        if adapter is None or isinstance(adapter, AdapterRef):
            return adapter
        if self.lora is None:
            raise UnknownAdapterError(f"adapter {adapter!r} is not registered (this engine serves no adapters)")
        return self.lora.ref(adapter)

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        for rid in group.child_ids if group is not None else [request_id]:
            self._choice_of.pop(rid, None)
            self._finish(rid, RequestStatus.FINISHED_ABORTED)
            self.outputs.drop(rid)

    def pause_request(self, request_id: str, paused: bool) -> None:
        """Pause (or resume) a request whose reader fell behind: it takes no steps until
        resumed, keeping its KV blocks and its seat (a preemption may still take them)."""
        group = self._groups.get(request_id)
        for rid in group.child_ids if group is not None else [request_id]:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.paused = paused

    def _finish(self, request_id: str, status: RequestStatus) -> Request | None:
        req = self.scheduler.finish(request_id, status)
        if req is not None:
            self._release(req)
        return req

    def _release(self, req: Request) -> None:
        if req.adapter is not None and self.lora is not None:
            self.lora.release(req.adapter.digest)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)

    def warm_up(self) -> float:
        """Meet every decode width and the full chunk size once before serving (seconds
        where a kernel builds state per shape, nothing where none does); returns the
        seconds it took. Steps that meet a new shape are slower."""
        start = time.perf_counter()
        s = self.config.scheduler
        self.runner.warm_up(sorted(set(range(1, s.max_num_seqs + 1)) | {s.max_num_batched_tokens}))
        return time.perf_counter() - start

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._expire() + self._fail_broken_adapters()
        plan = self.scheduler.schedule()
        # True when nothing could run (e.g. waiting on an adapter load): callers back off
        # instead of spinning, which would starve the loader thread of the GIL.
        self.idle_step = not plan.seqs
        if plan.adapter_loads or plan.adapter_evictions:
            self._load_adapters(plan)
        if not plan.seqs:
            return [self._as_choice(o) for o in failed]
        started = time.perf_counter()
        result = self.runner.execute(plan, self.scheduler.requests)
        self.scheduler.observe_step(plan, time.perf_counter() - started)
        reqs = {s.request_id: self.scheduler.requests[s.request_id] for s in plan.seqs}
        for rid, found in result.prompt_logprobs.items():
            reqs[rid].prompt_logprobs.update(found)
        first = {rid: reqs[rid].num_output_tokens for rid in result.tokens}
        finished = self.scheduler.update(plan, result.tokens)
        for req in finished:
            self._release(req)
        done = {r.request_id for r in finished}
        for s in plan.seqs:
            self.num_prompt_tokens += max(0, min(s.start_pos + len(s.token_ids), reqs[s.request_id].num_prompt_tokens)
                                          - s.start_pos)
        outs = [self.outputs.output(reqs[rid], n, result.logprobs[rid], rid in done) for rid, n in first.items()]
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in outs)
        if self.report_prefill:  # prompt chunks that sampled nothing (a first prefill, not a recompute)
            outs += [self.outputs.prefill(r) for r in (reqs[s.request_id] for s in plan.seqs)
                     if r.request_id not in result.tokens and r.request_id not in done and not r.num_output_tokens]
        outs = failed + outs
        return [self._as_choice(o) for o in outs] if self._choice_of else outs

    def _as_choice(self, out: RequestOutput) -> RequestOutput:
        """A child's output as its n > 1 request's: the request's id, the choice's index."""
        entry = self._choice_of.get(out.request_id)
        if entry is None:
            return out
        group, out.index = entry
        if out.finished:
            del self._choice_of[out.request_id]
            group.unfinished.discard(out.request_id)
            out.finished = not group.unfinished
            if out.finished:
                del self._groups[group.request_id]
        out.request_id = group.request_id
        return out

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        """Requests whose adapter could not be loaded finish with an error, alone."""
        if self.lora is None:
            return []
        broken = self.lora.failed()
        if not broken:
            return []
        outs = []
        for req in [r for r in self.scheduler.waiting if r.adapter and r.adapter.digest in broken]:
            self._finish(req.request_id, RequestStatus.FINISHED_ERROR)
            self.outputs.drop(req.request_id)
            req.stop_reason = f"adapter {req.adapter.name!r} could not be loaded: {broken[req.adapter.digest]}"
            outs.append(RequestOutput(req.request_id, [], "", True, "error", req.num_prompt_tokens, 0,
                                      req.num_output_tokens, stop_reason=req.stop_reason))
        return outs

    def _load_adapters(self, plan) -> None:
        """Forget the adapters the scheduler evicted, then load the step's new ones one by
        one, timed, before the runner executes it."""
        if plan.adapter_evictions:
            self.lora.evict(plan.adapter_evictions)
            self.adapter_evictions.update(ref.name for ref in plan.adapter_evictions)
        for row, ref in plan.adapter_loads:
            start = time.perf_counter()
            self.lora.load([(row, ref)])
            seconds = time.perf_counter() - start
            self.adapter_loads[ref.name] += 1
            self.recent_adapter_loads.append(AdapterLoad(sum(self.adapter_loads.values()), ref.name, seconds))
        plan.adapter_loads, plan.adapter_evictions = [], []

    def _adapter_pages(self, ref: AdapterRef) -> int:
        """Pool blocks an adapter's device copy takes: its bytes at its own ranks, where the
        pool was sized in bytes and the LoRA backend's rows grow. None where the rows are
        allocated up front (the memory plan sized them), or where `cache.num_blocks` fixes
        the KV blocks exactly. An adapter larger than the whole pool is refused (its
        requests fail) rather than left waiting for memory that never comes."""
        if not self.lora.backend.grows or self.config.cache.num_blocks is not None:
            return 0
        pages = -(-self.lora.device_bytes(ref) // self.runner.block_bytes)
        if pages >= self.kv.pool.num_blocks:
            self.lora.refuse(ref.digest, f"its weights need {pages} blocks of the {self.kv.pool.num_blocks}-block "
                                         f"KV pool; raise kv_cache_memory")
        return pages

    def _expire(self) -> list[RequestOutput]:
        """Requests past their deadline end here, with what they produced so far."""
        outs = []
        for req in self.scheduler.expire():
            self._release(req)
            outs.append(self.outputs.expired(req))
        return outs

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams] | None = None,
                 **kwargs) -> list[RequestOutput]:
        """Run prompts to completion; returns one cumulative output per prompt and choice,
        in order (a prompt with n choices gives n outputs, by index)."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        rids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                rids.append(self.add_request(p, sp, **kwargs))
        except BaseException:
            for rid in rids:  # all or nothing: no orphans left running in the engine
                self.abort_request(rid)
            raise
        results = {(rid, i): RequestOutput(rid, [], "", False, index=i)
                   for rid, sp in zip(rids, params) for i in range(sp.n)}
        while self.has_unfinished_requests():
            outs = self.step()
            if self.idle_step:
                time.sleep(0.002)
            for o in outs:
                r = results.get((o.request_id, o.index))
                if r is None:
                    continue
                r.new_token_ids += o.new_token_ids
                r.new_text += o.new_text
                r.logprobs += o.logprobs
                r.finished, r.finish_reason, r.stop_reason = o.finished, o.finish_reason, o.stop_reason
                r.num_prompt_tokens, r.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
                r.num_output_tokens = o.num_output_tokens
                r.prompt_logprobs = o.prompt_logprobs or r.prompt_logprobs
        return list(results.values())

    # -- introspection -------------------------------------------------------------
    def _adapters_per_step(self) -> int:
        """The most distinct adapters one step can run: one per sequence, or fewer rows."""
        rows = self.lora.max_rows
        seqs = self.config.scheduler.max_num_seqs
        return seqs if rows is None else min(rows, seqs)

    def stats(self) -> EngineStats:
        s = self.scheduler
        lanes = s.lane_counts()
        tiers = self.lora.tiers() if self.lora is not None else {}
        loras = self.config.lora if self.lora is not None else None
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), paused=sum(r.paused for r in s.running),
            lanes={lane: LaneDepth(**lanes[lane.name.lower()]) for lane in Lane},
            kv_cache_usage=self.kv.usage, num_blocks=self.kv.pool.num_blocks, block_size=self.config.cache.block_size,
            device=str(self.runner.device), num_preemptions=s.num_preemptions,
            prefix_cache_queries=self.kv.num_queries, prefix_cache_hits=self.kv.num_hits,
            adapters=AdapterResidency(tuple(tiers.get("device", ())), tuple(tiers.get("cpu", ()))),
            max_loras=self._adapters_per_step() if loras else 0, max_cpu_loras=loras.max_cpu_loras if loras else 0,
            time=time.time(), preemptions_by_lane=dict(s.preemptions_by_lane), adapter_loads=dict(self.adapter_loads),
            adapter_evictions=dict(self.adapter_evictions), recent_adapter_loads=tuple(self.recent_adapter_loads),
            foreground_lane=s.foreground_lane, background_step_tokens=s.guard.tokens,
            spec_decode=self._spec_stats())

    def _spec_stats(self) -> SpecDecodeStats | None:
        spec = self.scheduler.speculation
        if spec is None:
            return None
        return SpecDecodeStats(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                               tuple(spec.accepted_per_position), {k: (v[0], v[1]) for k, v in spec.by_adapter.items()})


def _choice_params(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of an n > 1 request: its own seed stream; prompt logprobs (the same
    for every choice) computed by choice 0 only, so the others may hit the prefix cache."""
    seed = None if sampling.seed is None else (sampling.seed + index) & 0x7FFF_FFFF_FFFF_FFFF
    return replace(sampling, n=1, seed=seed, prompt_logprobs=sampling.prompt_logprobs if index == 0 else None)


def _check_tenant(tenant: str, weight: float, timeout: float | None) -> None:
    if not isinstance(tenant, str):
        raise InvalidRequestError(f"tenant must be a string, got {type(tenant).__name__}")
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not (math.isfinite(weight) and weight > 0):
        raise InvalidRequestError(f"tenant_weight must be a finite number > 0, got {weight!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or not (math.isfinite(timeout) and timeout > 0)):
        raise InvalidRequestError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
