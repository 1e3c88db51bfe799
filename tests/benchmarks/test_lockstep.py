"""The lockstep runner: engines serve one workload with their steps interleaved, each
timed on its own steps."""
from __future__ import annotations

import argparse

from benchmarks import bench_sampling
from benchmarks.lockstep import run_lockstep
from benchmarks.workload import random_lengths
from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"), num_threads=1,
                                  scheduler=SchedulerConfig(max_num_seqs=4),
                                  cache=CacheConfig(num_blocks=64, enable_prefix_caching=False)))


def test_every_engine_serves_the_whole_workload_in_its_own_time(tiny_llama_dir):
    wl = random_lengths(6, input_len=24, input_range=8, output_len=6, output_range=3, vocab=(100, 1000))
    engines = {"greedy": _engine(tiny_llama_dir), "sampled": _engine(tiny_llama_dir)}
    params = {"sampled": lambda n: SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True)}
    runs = run_lockstep(engines, wl, {k: [None] * 6 for k in engines}, params)
    for name, run in runs.items():
        assert run.tokens == wl.num_output_tokens, name  # every request ran to its max_tokens
        assert len(run.ttft) == 6 and all(0 < t <= run.seconds for t in run.ttft), name
        assert run.steps >= max(wl.max_tokens) and run.idle_steps == 0 and run.tok_s > 0
    # max_num_seqs 4 of 6 requests: the same plan, so the same number of steps each
    assert runs["greedy"].steps == runs["sampled"].steps
    again = run_lockstep(engines, wl, {k: [None] * 6 for k in engines}, params, first=1, warm=False)
    assert list(again) == ["sampled", "greedy"] and again["greedy"].tokens == wl.num_output_tokens


def test_bench_sampling_compares_every_mode_with_greedy_in_one_run(tiny_llama_dir, capsys):
    args = argparse.Namespace(model=str(tiny_llama_dir), dtype="float32", threads=1, num_prompts=4, rounds=2)
    best = bench_sampling.run_engine(args)
    assert list(best) == list(bench_sampling.MODES) and all(v > 0 for v in best.values())
    out = capsys.readouterr().out
    assert "round 2:" in out and "1.00x greedy" in out and "top_p 0.95" in out
