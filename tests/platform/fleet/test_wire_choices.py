"""n > 1 over the worker wire: each choice keeps its index and prompt logprobs, and
coalescing never joins two choices' tokens."""
from __future__ import annotations

import pytest

from loraplex.engine.output import RequestOutput
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.request import SamplingParams
from loraplex.platform.fleet.wire import (
    coalesce_choices,
    output_from_json,
    output_to_json,
    sampling_from_json,
    sampling_to_json,
)


def _out(index: int, tokens: list[int], finished: bool = False, reason: str | None = None, **kw) -> RequestOutput:
    return RequestOutput("r", tokens, "".join(chr(97 + t) for t in tokens), finished, reason, 5, 0,
                         len(tokens), index=index, **kw)


def test_choice_fields_round_trip():
    sp = SamplingParams(n=4, seed=3, prompt_logprobs=2)
    assert sampling_from_json(sampling_to_json(sp)) == sp
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        sampling_from_json({"prompt_logprobs": "2"})
    out = _out(2, [1, 2], prompt_logprobs=[None, (-0.5, [(7, -0.1), (8, -0.9)])])
    assert output_from_json("r", output_to_json(out)) == out


def test_coalescing_keeps_choices_apart():
    first = _out(0, [1], prompt_logprobs=[None, (-1.0, [])])
    outs = [first, _out(0, [2]), _out(1, [3]), _out(1, [4], reason="length"), _out(1, [], reason=None),
            _out(0, [5], True, "stop")]
    joined = coalesce_choices(outs)
    assert [(o.index, o.new_token_ids, o.finish_reason) for o in joined] == \
        [(0, [1, 2], None), (1, [3, 4], "length"), (1, [], None), (0, [5], "stop")]
    assert joined[0].prompt_logprobs == first.prompt_logprobs
    assert joined[-1].finished
