"""Speculation beside everything else a batch carries: constrained rows (which never
speculate), prefix-cache hits and n > 1 choices keep their outputs."""
from __future__ import annotations

import json
import random

import jsonschema

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.engine.structured import StructuredOutput
from tests.engine.oracle import OracleDrafts, draft_whatever_the_timing, hf_greedy

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"]}


def _engine(model_dir, proposer=None) -> LLMEngine:
    spec = SpeculativeConfig("ngram", 4) if proposer else SpeculativeConfig()
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=8, num_blocks=512),
                                  scheduler=SchedulerConfig(max_num_seqs=16), speculative=spec), proposer=proposer)


def test_constrained_rows_prefix_hits_and_choices_beside_drafts(tiny_llama_dir):
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    free = [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (3, 9, 17)]
    constrained = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 12)]
    ref = hf_greedy(tiny_llama_dir, free, [16, 16, 16])
    plain, spec = _engine(tiny_llama_dir), _engine(tiny_llama_dir, OracleDrafts(free, ref))
    draft_whatever_the_timing(spec)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    shaped = SamplingParams(max_tokens=60, temperature=0, structured_output=StructuredOutput.json_schema(SCHEMA))
    prompts, params = free + constrained, [greedy] * 3 + [shaped] * 2
    want = plain.generate(prompts, params)
    assert [o.new_token_ids for o in spec.generate(free[:1], greedy)] == ref[:1]  # caches the shared prefix
    hits = spec.kv.num_hits
    got = spec.generate(prompts, params)
    assert [o.new_token_ids for o in got[:3]] == ref
    assert spec.kv.num_hits > hits, "the shared prefix was a cache hit"
    for w, g in zip(want[3:], got[3:]):
        assert g.new_token_ids == w.new_token_ids and g.finish_reason == "stop"
        jsonschema.validate(json.loads(g.new_text), SCHEMA)
    speculation = spec.scheduler.speculation
    assert 0 < speculation.num_accepted_tokens < speculation.num_draft_tokens
    assert spec.proposer.asked == {tuple(p) for p in free}, "constrained rows never draft"
    # n > 1: each choice is its own request and speculates on its own.
    two = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, n=2)
    choices = spec.generate(free[:1], two)
    assert [c.new_token_ids for c in choices] == [ref[0], ref[0]]
    spec.kv.pool.check_invariants()
    assert spec.kv.pool.num_free_blocks == spec.kv.pool.num_blocks
