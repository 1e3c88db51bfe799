"""Prompt lookup proposes what followed the latest earlier occurrence of the last n tokens."""
from __future__ import annotations

import pytest

from loraplex.engine.config import SpeculativeConfig
from loraplex.engine.request import Request
from loraplex.engine.spec import NgramProposer, create_proposer


def req(prompt: list[int], output: list[int] = (), rid: str = "r") -> Request:
    r = Request(rid, list(prompt))
    r.output_token_ids = list(output)
    return r


def ngram(lo: int = 2, hi: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", 4, prompt_lookup_max=hi, prompt_lookup_min=lo))


def test_it_copies_what_followed_the_latest_match():
    p = ngram()
    # "5 6" occurs twice before the end; the latest occurrence was followed by 9 8 7.
    r = req([5, 6, 1, 2, 3, 5, 6, 9, 8, 7, 4, 5, 6])
    assert p.propose(r, 4) == [9, 8, 7, 4]
    assert p.propose(r, 2) == [9, 8]


def test_the_longest_match_wins():
    p = ngram(lo=1, hi=3)
    # Only "1 2 3" continues with 40; "3" alone was last followed by 50.
    r = req([1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2, 3])
    assert p.propose(r, 2) == [40, 41]


def test_nothing_to_copy_proposes_nothing():
    p = ngram()
    assert p.propose(req([1, 2, 3, 4, 5, 6]), 4) == []
    assert p.propose(req([7]), 4) == []
    assert p.propose(req([1, 2, 1, 2]), 0) == []


def test_a_match_near_the_end_proposes_what_there_is():
    p = ngram()
    assert p.propose(req([1, 2, 1, 2]), 4) == [1, 2]


def test_output_tokens_are_appended_as_they_come():
    p = ngram()
    r = req([10, 11, 12, 13, 14, 15])
    assert p.propose(r, 3) == []
    r.output_token_ids += [10, 11]  # the output starts repeating the prompt
    assert p.propose(r, 3) == [12, 13, 14]
    r.output_token_ids += [12, 13, 14, 15] * 40  # the array grows past its first size
    assert p.propose(r, 3) == [12, 13, 14]


def test_a_forgotten_request_starts_over():
    p = ngram()
    r = req([1, 2, 3, 1, 2])
    assert p.propose(r, 1) == [3]
    p.forget("r")
    assert p.propose(req([4, 5, 6, 4, 5]), 1) == [6]


@pytest.mark.parametrize("kw, message", [
    (dict(method="eagle"), "unknown speculative method"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
])
def test_bad_configs_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kw)


def test_the_method_picks_the_proposer():
    assert create_proposer(SpeculativeConfig()) is None
    assert isinstance(create_proposer(SpeculativeConfig("ngram")), NgramProposer)
