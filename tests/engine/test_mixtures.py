"""Adapter mixtures as requests name them: parsing, bounds, canonical refs."""
from __future__ import annotations

import pytest

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.mixtures import (MAX_COMPONENTS, is_mixture, mixture_ref, parse_adapters_field, parse_mixture,
                                      resolve_mixture)
from loraplex.engine.request import AdapterRef

REFS = {n: AdapterRef(n, f"sha256:{n * 64}"[:71]) for n in "abcde"}


def test_the_name_syntax_parses_to_canonical_components():
    assert parse_mixture("b*.3+a*0.70") == (("a", 0.7), ("b", 0.3))
    assert parse_mixture("my-ad.v2*-1e-3+x_y*2") == (("my-ad.v2", -0.001), ("x_y", 2.0))
    assert parse_mixture("a*1e+2") == (("a", 100.0),)
    assert is_mixture("a*1") and not is_mixture("a") and not is_mixture(None)


@pytest.mark.parametrize("text, why", [
    ("a", "name\\*weight"), ("a*", "name\\*weight"), ("a*0.5+", "name\\*weight"), ("a*x", "name\\*weight"),
    ("-a*1", "name\\*weight"), ("a*1+a*2", "once"), ("a*0", "non-zero"), ("a*1e400", "finite"),
    ("a*1001", "between"), ("a*1+b*1+c*1+d*1+e*1", f"1 to {MAX_COMPONENTS}"),
])
def test_bad_names_are_refused_with_the_reason(text, why):
    with pytest.raises(InvalidRequestError, match=why):
        parse_mixture(text)


def test_the_adapters_field():
    assert parse_adapters_field([{"name": "b", "weight": 0.3}, {"name": "a", "weight": 1}]) == (
        ("a", 1.0), ("b", 0.3))
    assert parse_adapters_field([{"name": "a"}]) == (("a", 1.0),)


@pytest.mark.parametrize("value, why", [
    ([], "non-empty list"), ("a*1", "non-empty list"), ([{"name": "a", "weight": "1"}], "must be a number"),
    ([{"name": "a", "weight": True}], "must be a number"), ([{"weight": 1}], "name"), (["a"], "name"),
    ([{"name": "a", "weight": 1, "scale": 2}], "name"), ([{"name": "a/b", "weight": 1}], "not an adapter name"),
    ([{"name": "a*1", "weight": 1}], "not an adapter name"), ([{"name": "a", "weight": float("nan")}], "finite"),
])
def test_bad_adapters_fields_are_refused(value, why):
    with pytest.raises(InvalidRequestError, match=why):
        parse_adapters_field(value)


def test_the_ref_names_and_hashes_its_components():
    mix = resolve_mixture("b*0.3+a*0.7", REFS.__getitem__)
    assert mix == mixture_ref([(REFS["a"], 0.7), (REFS["b"], 0.3)])  # canonical: sorted by name
    assert mix.name == "a*0.7+b*0.3" and mix.mixture == ((REFS["a"], 0.7), (REFS["b"], 0.3))
    assert mix.digest.startswith("sha256:") and len(mix.digest) == 71
    assert mixture_ref([(REFS["a"], 0.7), (REFS["b"], 0.31)]).digest != mix.digest
    newer_b = AdapterRef("b", "sha256:" + "f" * 64)
    assert mixture_ref([(REFS["a"], 0.7), (newer_b, 0.3)]).digest != mix.digest
    with pytest.raises(InvalidRequestError, match="not an adapter name"):
        mixture_ref([(mix, 1.0)])
