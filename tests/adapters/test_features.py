"""An adapter's kind tags are read off what PEFT saved, and the store records them with each
version; a version recorded before kinds were reads as unknown until its files come again."""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loraplex.adapters import AdapterStore, BaseShapes, load_peft_adapter
from loraplex.adapters.features import TAG_PATTERN, adapter_features

ALL_NORMS = "input_layernorm,post_attention_layernorm,norm"
KINDS: list[tuple[dict[str, Any], bool, tuple[str, ...]]] = [
    ({}, False, ()),
    ({"use_rslora": True}, False, ("rslora",)),
    ({"lora_config": {"use_dora": True}}, False, ("dora",)),
    ({"use_rslora": True, "lora_config": {"use_dora": True}}, False, ("rslora", "dora")),
    ({"lora_config": {"lora_bias": True}}, False, ("lora_bias",)),
    ({"lora_config": {"trainable_token_indices": [3, 7]}}, False, ("trainable_tokens:embed_tokens",)),
    # A tied base: PEFT ties the lm_head to the embedding's rows, so the served head changes too.
    ({"lora_config": {"trainable_token_indices": [3, 7]}}, True, ("trainable_tokens:embed_tokens,lm_head",)),
    ({"lora_config": {"modules_to_save": ["lm_head", "embed_tokens", "input_layernorm", "post_attention_layernorm",
                                          "norm"]}}, False,
     (f"modules_to_save:embed_tokens,{ALL_NORMS},lm_head",)),
    ({"lora_config": {"modules_to_save": ["layers.1.input_layernorm"],
                      "trainable_token_indices": {"embed_tokens": [1], "lm_head": [2, 5]}}}, False,
     ("trainable_tokens:embed_tokens,lm_head", "modules_to_save:input_layernorm")),
]


@pytest.mark.parametrize("kwargs, tied, tags", KINDS, ids=[",".join(t) or "plain" for _, _, t in KINDS])
def test_each_kind_has_its_tags(make_adapter: Callable[..., Path], base: BaseShapes, kwargs: dict[str, Any],
                                tied: bool, tags: tuple[str, ...]) -> None:
    folder = make_adapter(rank=4, seed=7, target_modules=["q_proj", "v_proj"], **kwargs)
    adapter = load_peft_adapter(folder, dataclasses.replace(base, tie_word_embeddings=tied))
    assert adapter_features(adapter) == tags
    assert all(re.fullmatch(TAG_PATTERN, t) for t in tags)


def _drop_features(store: AdapterStore, name: str) -> None:
    """Rewrite the store's index as a loraplex that kept no kinds wrote it."""
    path = store.root / "index.json"
    doc = json.loads(path.read_text())
    entry = doc["adapters"][name]
    for record in (entry["current"], *entry["history"]):
        record.pop("features")
    path.write_text(json.dumps(doc))


def test_the_store_records_each_versions_kind(make_adapter: Callable[..., Path], base: BaseShapes,
                                              tmp_path: Path) -> None:
    dora = make_adapter(rank=4, seed=8, target_modules=["q_proj"], lora_config={"use_dora": True})
    plain = make_adapter(rank=4, seed=9, target_modules=["q_proj"])
    store = AdapterStore(tmp_path / "store", base)
    assert store.add("a", dora).features == ("dora",)
    assert store.add("a", plain, replace=True).features == ()
    assert [v.features for v in store.versions("a")] == [(), ("dora",)]

    _drop_features(store, "a")
    assert [v.features for v in store.versions("a")] == [None, None]  # unknown, not plain
    before = store.get("a")
    again = store.add("a", plain, replace=True)  # the same content: only its kind is filled in
    assert again == dataclasses.replace(before, features=())
    assert store.get("a") == again and store.versions("a")[1].features is None
