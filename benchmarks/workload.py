"""The seeded heavy-tailed workload every engine benchmark shares."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def heavy_tailed(n: int = 64, mean_prompt: int = 218, min_out: int = 16, max_out: int = 256,
                 seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> Workload:
    """Prompt lengths log-normal around `mean_prompt`; output lengths log-normal with a
    long tail, clipped to [min_out, max_out] (the shape of real chat traffic)."""
    rng = random.Random(seed)
    sigma = 0.6
    mu = math.log(mean_prompt) - sigma ** 2 / 2
    lengths = [max(4, min(4 * mean_prompt, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
    prompts = [[rng.randrange(*vocab) for _ in range(length)] for length in lengths]
    outs = [max(min_out, min(max_out, int(rng.lognormvariate(math.log(40), 1.0)))) for _ in range(n)]
    return Workload(prompts, outs)


def left_padded(prompts: list[list[int]]):
    """(input ids, attention mask) for transformers' batched `generate`, which needs left padding."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))
    return s[k]


def random_lengths(n: int = 64, input_len: int = 256, input_range: int = 128, output_len: int = 128,
                   output_range: int = 64, seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> Workload:
    """vLLM bench's random dataset: prompt and output lengths uniform in
    [len - range, len + range], prompt tokens uniform over `vocab`."""
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, input_len - input_range), input_len + input_range) for _ in range(n)]
    prompts = [[rng.randrange(*vocab) for _ in range(length)] for length in lengths]
    outs = [rng.randint(max(1, output_len - output_range), output_len + output_range) for _ in range(n)]
    return Workload(prompts, outs)
