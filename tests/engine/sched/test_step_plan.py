"""A class's budget within a step: tokens, and for the background, measured cost."""
from __future__ import annotations

from loraplex.engine.sched.step_plan import Budget


def test_a_plain_budget_counts_tokens():
    b = Budget(10)
    assert b.room(4) == 4 and b.room(30) == 10
    b.take(10)
    assert b.exhausted() and b.room(1) == 0
    b.give_back(3)
    assert b.room(5) == 3


def test_prompt_tokens_cost_what_they_weigh_and_a_decode_costs_a_unit():
    b = Budget(100, units=5.0, decode_weight=1.0, prompt_weight=0.5)
    assert b.room(40) == 10  # ten prompt tokens cost five units
    b.take(6)  # a prompt chunk: 3 units
    assert b.room(40) == 4 and b.room(1) == 1
    b.take(1)  # a decode: 1 unit
    assert b.room(40) == 2
    b.take(1)  # 0 units left
    assert b.exhausted() and b.room(1) == 0
    b.give_back(6)
    assert b.units == 3.0 and b.tokens == 98


def test_the_token_cap_holds_whatever_the_units():
    b = Budget(8, units=100.0, decode_weight=1.0, prompt_weight=0.1)
    assert b.room(500) == 8
