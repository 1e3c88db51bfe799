"""How the LoRA manager loads adapter mixtures (engine/mixtures.py): a mixture's digest is
no version its source holds, so the manager remembers, per mixture digest, the components
a request named, and builds the mixture from them when the CPU tier loads it."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ..request import AdapterRef

if TYPE_CHECKING:
    from loraplex.adapters import LoRAAdapter

# Recipes remembered (a few digests and weights each); a request re-teaches its own.
MAX_RECIPES = 4096


class MixtureRecipes:
    """Mixture digest -> its ref (components and weights), LRU; shared by the caller's,
    the engine's and the loader's threads."""

    def __init__(self) -> None:
        self._refs: OrderedDict[str, AdapterRef] = OrderedDict()
        self._lock = threading.Lock()

    def know(self, adapter: AdapterRef | str) -> str:
        """Remember `adapter` if it is a mixture; its digest."""
        if isinstance(adapter, str):
            return adapter
        if adapter.mixture:
            with self._lock:
                self._refs[adapter.digest] = adapter
                self._refs.move_to_end(adapter.digest)
                while len(self._refs) > MAX_RECIPES:
                    self._refs.popitem(last=False)
        return adapter.digest

    def load(self, source, digest: str, dtype: torch.dtype, max_rank: int) -> LoRAAdapter:
        """The adapter `digest` names: a known mixture built from its components (each
        loaded from `source`), else `source`'s own version."""
        from loraplex.adapters.mixtures import mix_adapters

        with self._lock:
            ref = self._refs.get(digest)
        if ref is None:
            return source.load(digest, dtype=dtype)
        parts = [(c.name, source.load(c.digest, dtype=dtype), w) for c, w in ref.mixture]
        return mix_adapters(digest, parts, max_rank)
