"""n > 1 choices from one prefill, and prompt logprobs, through the whole engine (tiny llama)."""
from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.request import SamplingParams

BLOCK = 16


def _engine(model_dir, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=128),
                                  scheduler=SchedulerConfig(**sched)))


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _assert_idle(engine: LLMEngine) -> None:
    assert not engine.scheduler.requests and not engine._groups and not engine._choice_of
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return _engine(tiny_llama_dir)


def test_n_choices_share_one_prefill_and_have_their_own_seed(engine):
    prompt = _prompt(40)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, n=4)
    hits, queries, computed = engine.kv.num_hits, engine.kv.num_queries, engine.num_prompt_tokens
    outs = engine.generate([prompt], sp, cache_salt="n4-a")
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(o.request_id == outs[0].request_id and len(o.new_token_ids) == 12 for o in outs)
    # Choices 1..3 hit choice 0's two full prompt blocks; only the partial tail is recomputed.
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert engine.kv.num_hits - hits == 3 * full
    assert engine.kv.num_queries - queries == 4 * len(prompt)
    assert engine.num_prompt_tokens - computed == len(prompt) + 3 * (len(prompt) - full)
    assert [o.num_cached_tokens for o in outs] == [0, full, full, full]
    assert len({tuple(o.new_token_ids) for o in outs}) == 4  # distinct seed streams
    _assert_idle(engine)
    # Reproducible, and choice i is the n = 1 request with seed + i.
    again = engine.generate([prompt], sp, cache_salt="n4-b")
    assert [o.new_token_ids for o in again] == [o.new_token_ids for o in outs]
    alone = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=13, ignore_eos=True))
    assert alone[0].new_token_ids == outs[2].new_token_ids
    _assert_idle(engine)


def test_n_choices_stream_per_index_and_finish_once(engine):
    rid = engine.add_request(_prompt(20, 1), SamplingParams(max_tokens=5, temperature=0.7, seed=3, n=3,
                                                            ignore_eos=True))
    finished, reasons = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            if o.finish_reason is not None:
                reasons[o.index] = o.finish_reason
            finished.append(o.finished)
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert finished.count(True) == 1 and finished[-1]  # the request ends with its last choice
    _assert_idle(engine)


def test_abort_ends_every_choice(engine):
    rid = engine.add_request(_prompt(40, 2), SamplingParams(max_tokens=50, n=4, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    _assert_idle(engine)
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=0)


def _reference_prompt_logprobs(model_dir, prompt: list[int], top: int) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out = []
    for pos in range(1, len(prompt)):
        row = lp[pos - 1]
        t = torch.topk(row, top)
        out.append((float(row[prompt[pos]]), t.indices.tolist(), t.values.tolist()))
    return out


@pytest.mark.parametrize("chunk", [512, 24])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, chunk):
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=chunk)
    prompt = _prompt(70, 3)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # cache the prompt
    hits = engine.kv.num_hits
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, n=2))
    assert engine.kv.num_hits - hits == (len(prompt) - 1) // BLOCK * BLOCK  # only choice 1 used the cache
    got = out[0].prompt_logprobs
    assert out[1].prompt_logprobs is None
    assert len(got) == len(prompt) and got[0] is None
    ref = _reference_prompt_logprobs(tiny_llama_dir, prompt, 2)
    for (chosen, top), (r_chosen, r_ids, r_vals) in zip(got[1:], ref):
        assert chosen == pytest.approx(r_chosen, abs=1e-3)
        assert [t for t, _ in top] == r_ids
        assert [v for _, v in top] == pytest.approx(r_vals, abs=1e-3)
    _assert_idle(engine)


def test_n_choices_survive_preemption(tiny_llama_dir, engine):
    prompt = _prompt(40, 4)
    sp = SamplingParams(max_tokens=40, temperature=0.9, seed=2, ignore_eos=True, n=4)
    roomy = engine.generate([prompt], sp, cache_salt="roomy")
    # 4 choices x 80 tokens need 20 blocks of 16; 12 force preemptions along the way.
    small = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                   cache=CacheConfig(block_size=BLOCK, num_blocks=12)))
    tight = small.generate([prompt], sp)
    assert small.scheduler.num_preemptions > 0
    assert [o.new_token_ids for o in tight] == [o.new_token_ids for o in roomy]
    _assert_idle(small)
