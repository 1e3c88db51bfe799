"""Speculative decoding on the real model: prompt lookup finds what a copying answer
repeats, and what the engine returns is what plain decoding returns, token for token."""
from __future__ import annotations

import pytest

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.engine.tokenizer import Tokenizer
from tests.engine.oracle import draft_whatever_the_timing, hf_greedy

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
        "step. All that glitters is not gold.")


def _engine(model_dir, speculative: bool, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=256), scheduler=SchedulerConfig(**sched),
        speculative=SpeculativeConfig("ngram" if speculative else None, 4)))


@pytest.fixture(scope="module")
def copy_prompts(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    asks = [f"Repeat this text exactly, nothing else:\n{TEXT}",
            f"Rewrite this text in capital letters:\n{TEXT}",
            "What is the capital of France?"]
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in asks]


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    plain, spec = _engine(smollm2_dir, False), _engine(smollm2_dir, True)
    draft_whatever_the_timing(spec)
    return plain, spec


def _tokens(engine, prompts, params):
    return [o.new_token_ids for o in engine.generate(prompts, params)]


def test_greedy_equals_transformers_and_drafts_are_accepted(smollm2_dir, copy_prompts, engines):
    _, spec = engines
    ref = hf_greedy(smollm2_dir, copy_prompts, [40, 40, 16])
    before = spec.scheduler.speculation.num_accepted_tokens
    assert _tokens(spec, copy_prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                        for n in (40, 40, 16)]) == ref
    assert spec.scheduler.speculation.num_accepted_tokens - before >= 20, "a copied answer is mostly drafts"
    spec.kv.pool.check_invariants()
    assert spec.kv.pool.num_free_blocks == spec.kv.pool.num_blocks


def test_seeded_sampling_and_choices_are_unchanged(copy_prompts, engines):
    plain, spec = engines
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7 + i, n=2, logprobs=2,
                             presence_penalty=0.3) for i in range(len(copy_prompts))]
    before = spec.scheduler.speculation.num_accepted_tokens
    want = plain.generate(copy_prompts, params)
    got = spec.generate(copy_prompts, params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    # Each kept token's logprob is the target model's at its position, as plain decoding reports.
    for g, w in zip(got, want):
        assert len(g.logprobs) == len(w.logprobs) == len(g.new_token_ids)
        assert [[t for t, _ in top] for _, top in g.logprobs] == [[t for t, _ in top] for _, top in w.logprobs]
        assert [c for c, _ in g.logprobs] == pytest.approx([c for c, _ in w.logprobs], abs=1e-3)
    assert spec.scheduler.speculation.num_accepted_tokens > before


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(copy_prompts, engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=60, temperature=0, stop=["thousand"])
    want, got = plain.generate(copy_prompts[:1], params)[0], spec.generate(copy_prompts[:1], params)[0]
    assert "thousand" not in got.new_text and got.finish_reason == "stop" and got.stop_reason == "thousand"
    assert (got.new_text, got.new_token_ids, got.num_output_tokens) == \
        (want.new_text, want.new_token_ids, want.num_output_tokens)
