"""The weights of an adapter mixture: PEFT's cat combination, and the components it refuses."""
from __future__ import annotations

import pytest
import torch

from loraplex.adapters import AdapterValidationError, load_peft_adapter
from loraplex.adapters.mixtures import mix_adapters


def _delta(adapter, key) -> torch.Tensor:
    w = adapter.weights[key]
    return (w.b @ w.a) * w.scale


def test_cat_is_the_weighted_sum_of_the_deltas(make_adapter, base):
    a = load_peft_adapter(make_adapter(rank=4, alpha=8, seed=1, init_scale=0.3), base)
    b = load_peft_adapter(make_adapter(rank=8, alpha=4, seed=2, init_scale=0.3, target_modules=["q_proj"],
                                       use_rslora=True), base)
    mix = mix_adapters("sha256:" + "0" * 64, [("a", a, 0.7), ("b", b, -1.5)], max_rank=64)
    assert mix.digest == "sha256:" + "0" * 64
    assert set(mix.weights) == set(a.weights) | set(b.weights)
    q, v = (0, "q_proj"), (0, "v_proj")
    assert mix.weights[q].rank == 12 and mix.weights[v].rank == 4 and mix.rank == 12
    assert mix.weights[q].scale == 1.0
    torch.testing.assert_close(_delta(mix, q), 0.7 * _delta(a, q) - 1.5 * _delta(b, q))
    torch.testing.assert_close(_delta(mix, v), 0.7 * _delta(a, v))  # targeted by `a` only


def test_summed_rank_above_the_cap_is_refused(make_adapter, base):
    a = load_peft_adapter(make_adapter(rank=8, seed=3), base)
    b = load_peft_adapter(make_adapter(rank=8, seed=4), base)
    with pytest.raises(AdapterValidationError, match="summed rank 16 .* max_lora_rank 12"):
        mix_adapters("sha256:x", [("a", a, 1.0), ("b", b, 1.0)], max_rank=12)


@pytest.mark.parametrize("extra, what", [({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "lora_B biases"),
                                         ({"modules_to_save": ["lm_head"]}, "saved modules")])
def test_components_beyond_plain_lora_are_refused(make_adapter, base, extra, what):
    plain = load_peft_adapter(make_adapter(rank=4, seed=5), base)
    other = load_peft_adapter(make_adapter(rank=4, seed=6, lora_config=extra), base)
    with pytest.raises(AdapterValidationError, match=f"'odd' uses {what}"):
        mix_adapters("sha256:x", [("plain", plain, 1.0), ("odd", other, 1.0)], max_rank=64)
