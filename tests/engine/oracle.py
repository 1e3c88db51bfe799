"""The correctness oracle: transformers' greedy `generate` on the same checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_tokens: list[int], adapter_dir=None) -> list[list[int]]:
    """Greedy continuations, one prompt at a time (no padding, so nothing can differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    # Like ignore_eos: EOS may be generated but does not stop generation. (min_new_tokens
    # would instead forbid EOS, which changes the greedy choice.)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def run_greedy_with_adapters(engine, prompts: list[list[int]], adapters: list[str | None],
                             max_tokens: list[int]) -> list[list[int]]:
    """Our engine's greedy tokens per request; checks no request errored and no block leaked."""
    from loraplex.engine.request import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), adapter=a)
           for p, n, a in zip(prompts, max_tokens, adapters)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.finish_reason != "error", o.stop_reason
            outs[o.request_id] += o.new_token_ids
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    return [outs[i] for i in ids]
