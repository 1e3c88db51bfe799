"""SmolLM2 (fp32) with an adapter of every kind PEFT saves (DoRA, lora_bias, trainable
tokens, saved norms) and a mixture of two plain adapters, in one batch with a plain
adapter and base requests: every request equals transformers + PEFT."""
from __future__ import annotations

import pytest

from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.mixtures import parse_mixture
from loraplex.engine.tokenizer import Tokenizer
from tests.engine.lora.test_oracle import _engine
from tests.engine.oracle import hf_greedy, hf_greedy_mixture, run_greedy_with_adapters

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of Japan?", "Tell me about the ocean.", "Write a haiku about the sea.",
             "List three prime numbers.", "Why do birds sing?", "How can I improve my writing?"]
MIXTURE = "m1*0.6+m2*0.4"
# One request per row: (question index, adapter or None); each gets MAX_TOKENS greedy tokens.
REQUESTS = [(0, None), (1, "dora"), (2, "bias"), (1, "tokens"), (3, "norms"), (4, MIXTURE), (5, "m1"), (2, None)]
MAX_TOKENS = 12


def _adapters(model_dir, root, tokens: list[int]) -> dict:
    """(rank, targets, LoraConfig extras) per adapter; weights small enough that the text
    stays sane, large enough to change it."""
    spec = {
        # PEFT recomputes DoRA's weight norms every forward: few targets keep the oracle quick.
        "dora": (8, ("q_proj", "v_proj", "o_proj"), {"use_dora": True}),
        "bias": (8, None, {"lora_bias": True}),
        # The base ties lm_head to the embedding: PEFT ties the retrained rows to the head too.
        "tokens": (4, ("q_proj", "v_proj"), {"trainable_token_indices": tokens}),
        "norms": (4, ("o_proj",), {"modules_to_save": ["input_layernorm", "post_attention_layernorm", "norm"]}),
        "m1": (8, None, {}),
        "m2": (4, ("q_proj", "v_proj", "down_proj"), {}),
    }
    scale = {"tokens": 0.2, "norms": 0.2, "m1": 0.05, "m2": 0.05}  # noise relative to the saved rows and norms
    return {name: make_random_peft_adapter(model_dir, root / name, rank=rank, alpha=2 * rank, seed=i + 7,
                                           init_scale=scale.get(name, 0.03), lora_config=extra,
                                           **({"target_modules": t} if t else {}))
            for i, (name, (rank, t, extra)) in enumerate(spec.items())}


def _reference(model_dir, dirs, prompt, assign: str) -> list[int]:
    if "*" in assign:
        return hf_greedy_mixture(model_dir, [prompt], [MAX_TOKENS], dirs, dict(parse_mixture(assign)))[0]
    return hf_greedy(model_dir, [prompt], [MAX_TOKENS], adapter_dir=dirs[assign])[0]


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    tok = Tokenizer(smollm2_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[q]}]) for q, _ in REQUESTS]
    # The retrained tokens: words of the question the tokens adapter answers.
    tokens = sorted(set(tok.encode(QUESTIONS[1])))[:4]
    dirs = _adapters(smollm2_dir, tmp_path_factory.mktemp("smollm2-kinds"), tokens)
    assign = [a for _, a in REQUESTS]
    base = hf_greedy(smollm2_dir, prompts, [MAX_TOKENS] * len(prompts))
    ref = [_reference(smollm2_dir, dirs, p, a) if a else b for p, a, b in zip(prompts, assign, base)]
    return dirs, prompts, assign, ref, base


def test_every_kind_changes_the_output(setup):
    """The oracle means nothing if an adapter leaves the greedy tokens as they were."""
    _, _, assign, ref, base = setup
    changed = {a for a, r, b in zip(assign, ref, base) if a is not None and r != b}
    assert changed == {a for a in assign if a is not None}


def test_one_batch_of_every_kind_matches_peft(smollm2_dir, tmp_path, setup):
    dirs, prompts, assign, ref, _ = setup
    engine, _ = _engine(smollm2_dir, tmp_path / "store", dirs, max_loras=8)
    assert run_greedy_with_adapters(engine, prompts, assign, [MAX_TOKENS] * len(prompts)) == ref
