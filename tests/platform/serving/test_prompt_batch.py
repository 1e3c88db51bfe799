"""A completion's prompt list: its prompts' engine streams merged into one."""
from __future__ import annotations

import asyncio

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.platform.serving.prompt_batch import merge_prompt_streams


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=16, num_blocks=256)))


def test_a_merged_stream_whose_reader_stops_reading_pauses_every_prompt(tiny_llama_dir):
    """The merge holds a few outputs per prompt, so a reader that stops reading leaves
    each prompt's stream away with an output, and the engine pauses every request; read
    again, each prompt's output is what it is alone."""
    sampling = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11]]
    want = [o.new_token_ids for o in _engine(tiny_llama_dir).generate(prompts, sampling)]
    ae = AsyncEngine(_engine(tiny_llama_dir), pause_backlog=100_000, stall_seconds=0.05)

    async def main() -> tuple[list[list[int]], list[int]]:
        merged = merge_prompt_streams([ae.generate(p, sampling, request_id=f"p{i}") for i, p in enumerate(prompts)],
                                      1, "merged")
        got = [await anext(merged)]  # then the reader is away
        while len(ae.engine.scheduler.requests) < 2 or not all(r.paused for r in ae.engine.scheduler.requests.values()):
            await asyncio.sleep(0.01)
        made = [r.num_output_tokens for r in ae.engine.scheduler.requests.values()]
        got += [o async for o in merged]
        return [[t for o in got if o.index == i for t in o.new_token_ids] for i in range(2)], made

    try:
        tokens, made = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        ae.shutdown()
    assert all(m < 1500 for m in made), "paused before their end"
    assert tokens == want
