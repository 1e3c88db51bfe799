"""Prefill progress: with `report_prefill`, every prefill chunk that sampled no token yields
a token-less output saying how many prompt tokens the engine processed (metering bills
them if the request is aborted before its first token); without it, nothing changes."""
from __future__ import annotations

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams


def _chunked(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=4, num_blocks=128),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=16)))


def _outputs(engine: LLMEngine, prompt: list[int]) -> list:
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0), request_id="r")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_prefill_chunks_report_processed_prompt_tokens(tiny_llama_dir):
    prompt = list(range(100, 150))  # 50 tokens: four 16-token chunks
    engine = _chunked(tiny_llama_dir)
    engine.report_prefill = True
    outs = _outputs(engine, prompt)
    progress = [o for o in outs if not o.new_token_ids]
    assert [o.num_processed_prompt_tokens for o in progress] == [16, 32, 48]
    assert not any(o.finished for o in progress) and all(o.num_output_tokens == 0 for o in progress)
    tokens = [o for o in outs if o.new_token_ids]
    assert len(tokens) == 2 and all(o.num_processed_prompt_tokens == 50 for o in tokens)

    plain = _chunked(tiny_llama_dir)
    outs = _outputs(plain, prompt)
    assert all(o.new_token_ids for o in outs) and [o.new_token_ids for o in outs] == [o.new_token_ids for o in tokens]
