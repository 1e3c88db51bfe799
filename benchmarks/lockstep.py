"""Engines compared in lockstep: several in-process engines serve the same workload, their
steps interleaved one by one, each timed on its own steps.

These machines are shared: their speed drifts 15-20% within minutes, so two engines timed
one after the other meet different machines, and a ratio of their throughputs says more
about the drift than about the engines. Interleaved step by step, whatever else runs
slows every engine alike, and each engine's throughput, step time and TTFT are counted in
its own time: the seconds of its own steps since the requests arrived. An engine that
waits for an adapter load takes idle steps; the wall time from an idle step to its next
step counts as its own (a load runs beside whatever else steps, as it would alone).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workload import Workload, percentile

from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams

# max_tokens -> the sampling parameters of one request
ParamsFor = Callable[[int], SamplingParams]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def warm_engine(engine: LLMEngine, wl: Workload, adapters: list[str | None]) -> float:
    """Every batch width (LLMEngine.warm_up), the base model, then each adapter once: its
    seconds."""
    engine.warm_up()
    engine.generate([wl.prompts[0][:8]], greedy(2))
    start = time.perf_counter()
    for name in dict.fromkeys(a for a in adapters if a is not None):
        engine.add_request(wl.prompts[0][:8], greedy(1), adapter=name)
    while engine.has_unfinished_requests():
        if not engine.step():
            time.sleep(0.005)  # adapters load in a background thread: do not spin on the GIL
    return time.perf_counter() - start


@dataclass
class Run:
    """One engine's share of a lockstep run, in its own time."""
    seconds: float = 0.0
    steps: int = 0
    idle_steps: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    preemptions: int = 0
    warm_seconds: float = 0.0  # loading its adapters before the run (warm_engine)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps

    def ttft_p(self, p: float) -> float:
        return percentile(self.ttft, p)


def run_lockstep(engines: dict[str, LLMEngine], wl: Workload, adapters: dict[str, list[str | None]],
                 params: dict[str, ParamsFor] | None = None, first: int = 0, warm: bool = True) -> dict[str, Run]:
    """Every engine serves `wl` (all requests at once; engine k with adapters[k][i] and
    params[k], greedy by default), after `warm_engine` unless `warm` is False, their steps
    interleaved one by one starting with engine number `first`."""
    names = list(engines)
    names = names[first % len(names):] + names[:first % len(names)]
    runs = {k: Run() for k in names}
    if warm:
        for k in names:
            runs[k].warm_seconds = warm_engine(engines[k], wl, adapters[k])
    pending: dict[str, set[str]] = {}
    for k in names:
        make = (params or {}).get(k, greedy)
        pending[k] = {engines[k].add_request(p, make(n), adapter=a)
                      for p, n, a in zip(wl.prompts, wl.max_tokens, adapters[k])}
        runs[k].preemptions = -engines[k].scheduler.num_preemptions
    idle_since: dict[str, float] = {}
    running = list(names)
    while running:
        for k in list(running):
            run, engine = runs[k], engines[k]
            start = time.perf_counter()
            if k in idle_since:  # it was waiting on a load all the while
                run.seconds += start - idle_since.pop(k)
            outs = engine.step()
            end = time.perf_counter()
            run.seconds += end - start
            run.steps += 1
            for o in outs:
                run.tokens += len(o.new_token_ids)
                if o.new_token_ids and o.request_id in pending[k]:
                    pending[k].discard(o.request_id)
                    run.ttft.append(run.seconds)
            if not outs and engine.idle_step:
                run.idle_steps += 1
                idle_since[k] = end
                if len(running) == 1:
                    time.sleep(0.002)  # nothing else to step: do not spin on the GIL
            if not engine.has_unfinished_requests():
                running.remove(k)
    for k in names:
        runs[k].preemptions += engines[k].scheduler.num_preemptions
    return runs
