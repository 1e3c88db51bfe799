"""Adapter mixtures: one request served with several adapters' weighted sum, as PEFT's
`add_weighted_adapter(combination_type="cat")` computes it.

A mixture is one more adapter to everything downstream: an `AdapterRef` whose name is
canonical and whose digest hashes its components' digests and weights, so the prefix
cache, the LoRA manager's tiers and its device rows treat it as an adapter of its own,
and a component's new version makes a new mixture. Its weights are built when the CPU
tier loads it (adapters/mixtures.py): the components' low-rank factors concatenated,
never a merged dense delta.

The canonical name lists the components sorted by name, each as `name*weight` with the
weight in Python's shortest round-trip form, joined by `+`: "a*0.7+b*0.3". Adapter names
never hold `*` or `+`, so a mixture's name is never a stored adapter's.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence

from loraplex.adapters.store import NAME_RE

from .errors import InvalidRequestError
from .request import AdapterRef

MAX_COMPONENTS = 4
# |weight| at most this: weights stay in plain decimal form (no "e+" exponent, whose "+"
# the name syntax uses), and a weight this large already swamps the base model.
MAX_WEIGHT = 1000.0
_DOMAIN = b"loraplex-lora-mixture-v1\0"
_NAME = NAME_RE.pattern.lstrip("^").rstrip("$")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_COMPONENT = re.compile(rf"({_NAME})\*({_NUMBER})")
_SPEC = re.compile(rf"{_COMPONENT.pattern}(?:\+{_COMPONENT.pattern})*")

Components = tuple[tuple[str, float], ...]


def is_mixture(name: object) -> bool:
    """Whether an adapter name (a `model` or a URL's adapter) spells a mixture."""
    return isinstance(name, str) and "*" in name


def parse_mixture(text: str) -> Components:
    """The components of a mixture spelled `a*0.7+b*0.3` (any order, any number form),
    checked and in canonical order; InvalidRequestError naming the problem."""
    if not isinstance(text, str) or len(text) > 2048 or _SPEC.fullmatch(text) is None:
        raise InvalidRequestError(f"invalid adapter mixture {str(text)[:100]!r}: write it as name*weight joined "
                                  "by '+', e.g. a*0.7+b*0.3")
    return check_components([(m.group(1), float(m.group(2))) for m in _COMPONENT.finditer(text)])


def parse_adapters_field(value: object) -> Components:
    """The `adapters` extension field: [{"name": str, "weight": number}, ...]."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError('adapters must be a non-empty list of {"name": ..., "weight": ...} objects')
    pairs = []
    for item in value:
        if not isinstance(item, dict) or set(item) - {"name", "weight"} or "name" not in item:
            raise InvalidRequestError('each entry of adapters must be {"name": str, "weight": number}')
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise InvalidRequestError(f"adapters: the weight of {item['name']!r} must be a number")
        pairs.append((item["name"], float(weight)))
    return check_components(pairs)


def check_components(pairs: Sequence[tuple[object, float]]) -> Components:
    """At most MAX_COMPONENTS distinct adapter names with finite, non-zero weights of at
    most MAX_WEIGHT in magnitude, sorted by name."""
    if not 1 <= len(pairs) <= MAX_COMPONENTS:
        raise InvalidRequestError(f"an adapter mixture names 1 to {MAX_COMPONENTS} adapters, not {len(pairs)}")
    names = [n for n, _ in pairs]
    for name in names:
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise InvalidRequestError(f"adapters: {str(name)[:100]!r} is not an adapter name")
    if len(set(names)) != len(names):
        raise InvalidRequestError("adapters: each adapter may appear once in a mixture")
    for name, weight in pairs:
        if not math.isfinite(weight) or weight == 0 or abs(weight) > MAX_WEIGHT:
            raise InvalidRequestError(f"adapters: the weight of {name!r} must be a finite non-zero number "
                                      f"between -{MAX_WEIGHT:g} and {MAX_WEIGHT:g}, got {weight!r}")
    return tuple(sorted((str(n), float(w)) for n, w in pairs))


def mixture_name(components: Components) -> str:
    return "+".join(f"{name}*{weight!r}" for name, weight in components)


def mixture_ref(refs: Sequence[tuple[AdapterRef, float]]) -> AdapterRef:
    """The mixture of these component versions (checked, canonical order)."""
    order = check_components([(r.name, w) for r, w in refs])  # a mixture's name is no adapter name
    by_name = {r.name: r for r, _ in refs}
    parts = tuple((by_name[n], w) for n, w in order)
    blob = json.dumps([[r.digest, w] for r, w in parts], separators=(",", ":")).encode()
    return AdapterRef(mixture_name(order), "sha256:" + hashlib.sha256(_DOMAIN + blob).hexdigest(), parts)


def resolve_mixture(name: str, resolve: Callable[[str], AdapterRef]) -> AdapterRef:
    """The mixture `name` spells, each component's current version from `resolve`."""
    return mixture_ref([(resolve(n), w) for n, w in parse_mixture(name)])
