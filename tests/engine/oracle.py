"""The correctness oracle: transformers' greedy `generate` on the same checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch

from loraplex.engine.spec import DraftProposer


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_tokens: list[int], adapter_dir=None) -> list[list[int]]:
    """Greedy continuations, one prompt at a time (no padding, so nothing can differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return _greedy(model, prompts, max_tokens)


def hf_greedy_mixture(model_dir: Path | str, prompts: list[list[int]], max_tokens: list[int],
                      adapter_dirs: dict[str, Path], weights: dict[str, float]) -> list[list[int]]:
    """Greedy continuations with PEFT's `add_weighted_adapter(combination_type="cat")` of
    the adapters in `adapter_dirs` named in `weights`, in `weights`' order."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(weights)
    model = PeftModel.from_pretrained(model, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.add_weighted_adapter(names, [weights[n] for n in names], "mixture", combination_type="cat")
    model.set_adapter("mixture")
    return _greedy(model, prompts, max_tokens)


def _greedy(model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
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


def schedule_whatever_the_timing(engine, adapters=()) -> None:
    """Which requests run together follows when each adapter's background load ends and,
    past `aging_seconds`, how long the run has taken, so a busy machine may run other
    steps (and, say, never run out of KV blocks). `adapters` (names) are loaded into the
    CPU tier first, so where it holds them all no load races the steps; the scheduler's
    clock advances 10 ms a step, so aging follows steps, not the machine's speed."""
    for name in adapters:
        engine.lora.prefetch(engine.lora.ref(name)).result(timeout=120)
    now, step = [0.0], engine.step

    def step_at_fixed_pace():
        now[0] += 0.01
        return step()

    engine.scheduler.clock = lambda: now[0]
    engine.step = step_at_fixed_pace


class OracleDrafts(DraftProposer):
    """Drafts read off the reference output (a random model repeats nothing for prompt
    lookup to find), with the drafts at every `wrong_every`-th output position (offset by
    the prompt's length) replaced by a wrong token, so verification both keeps and
    rejects drafts, the same ones however requests share steps. Keyed by the prompt, so
    it serves however the engine names or splits requests; `asked` records the prompts
    drafts were asked for."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], wrong_every: int = 3) -> None:
        self.ref = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.wrong_every = wrong_every
        self.asked: set[tuple[int, ...]] = set()

    def propose(self, req, k: int) -> list[int]:
        prompt = tuple(req.prompt_token_ids)
        self.asked.add(prompt)
        n = req.num_output_tokens
        drafts = list(self.ref.get(prompt, [])[n:n + k])
        for i in range(len(drafts)):
            if (len(prompt) + n + i) % self.wrong_every == 0:
                drafts[i] = drafts[i] + 1  # any other token is wrong for a greedy reference
        return drafts


def draft_whatever_the_timing(engine) -> None:
    """How many drafts a request gets follows the measured step times (a busy machine
    fits another cost model); these tests fix it away, so every request drafts as many
    tokens as its drafts allow and the same drafts are verified on any machine."""
    engine.scheduler.guard.cost.model = lambda: None
