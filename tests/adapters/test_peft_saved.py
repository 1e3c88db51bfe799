"""Saved modules beside LoRA (modules_to_save, trainable_token_indices) load exactly as PEFT
saved them; what loraplex cannot serve is refused with a message naming why."""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.adapters import BaseShapes, load_peft_adapter
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.peft_config import parse_lora_config
from tests.adapters.test_peft import peft_model, reject

TOKENS = [7, 3, 200]
DELTA = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
NORMS = ["input_layernorm", "post_attention_layernorm", "norm"]  # every RMSNorm, whichever PEFT


@pytest.fixture(scope="module")
def tokens_dir(make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(rank=4, seed=5, target_modules=["q_proj"], init_scale=0.3,
                        lora_config={"trainable_token_indices": TOKENS})


@pytest.fixture(scope="module")
def saved_dir(make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(rank=4, seed=6, target_modules=["v_proj"], init_scale=0.3,
                        lora_config={"modules_to_save": ["embed_tokens", "lm_head", *NORMS]})


def test_trainable_tokens_load_as_peft_saved_them(tokens_dir: Path, base_dir: Path, base: BaseShapes) -> None:
    saved = load_peft_adapter(tokens_dir, base).saved
    layer = peft_model(base_dir, tokens_dir).base_model.model.model.embed_tokens.token_adapter
    delta = layer.trainable_tokens_delta["default"].detach()
    assert saved.embed_rows.ids.tolist() == sorted(TOKENS)  # sorted for the engine's search, rows with them
    for i, token in enumerate(TOKENS):
        row = saved.embed_rows.rows[sorted(TOKENS).index(token)]
        assert torch.equal(row, delta[i])
        assert not torch.equal(row, layer.base_layer.weight[token])  # synth retrained them
    # The base is untied: the lm_head keeps its own rows; nothing else is saved.
    assert saved.head_rows is None and saved.embed is None and saved.head is None and not saved.norms


def test_tied_base_shares_the_rows_with_the_lm_head(tokens_dir: Path, base: BaseShapes) -> None:
    saved = load_peft_adapter(tokens_dir, dataclasses.replace(base, tie_word_embeddings=True)).saved
    assert saved.head_rows is saved.embed_rows


def test_saved_modules_load_as_peft_saved_them(saved_dir: Path, base_dir: Path, base: BaseShapes) -> None:
    adapter = load_peft_adapter(saved_dir, base)
    model = peft_model(base_dir, saved_dir).base_model.model
    saved = adapter.saved
    copy = lambda module: module.modules_to_save["default"].weight.detach()  # noqa: E731
    assert torch.equal(saved.embed, copy(model.model.embed_tokens))
    assert torch.equal(saved.head, copy(model.lm_head))
    assert torch.equal(saved.final_norm, copy(model.model.norm))
    assert sorted(saved.norms) == [(i, n) for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    for (i, name), w in saved.norms.items():
        assert torch.equal(w, copy(getattr(model.model.layers[i], name)))
    assert adapter.size_bytes == sum(t.nbytes for w in adapter.weights.values() for t in w.tensors()) + sum(
        t.nbytes for t in saved.tensors())


def test_norm_saves_what_the_installed_peft_saves(make_adapter: Callable[..., Path], base_dir: Path,
                                                  base: BaseShapes) -> None:
    folder = make_adapter(rank=4, seed=8, target_modules=["v_proj"], init_scale=0.3,
                          lora_config={"modules_to_save": ["norm"]})
    model = peft_model(base_dir, folder).base_model.model.model
    wrapped = [(i, n) for i, layer in enumerate(model.layers) for n in ("input_layernorm", "post_attention_layernorm")
               if hasattr(getattr(layer, n), "modules_to_save")]
    saved = load_peft_adapter(folder, base).saved
    assert sorted(saved.norms) == wrapped
    assert torch.equal(saved.final_norm, model.norm.modules_to_save["default"].weight.detach())


@pytest.mark.parametrize("version, every_norm",
                         [("0.21.2", True), (None, True), ("0.22.0", False), ("1.3.0rc1", False)])
def test_norm_means_what_the_writing_peft_meant(saved_dir: Path, base: BaseShapes, files: Any, tmp_path: Path,
                                                version: str | None, every_norm: bool) -> None:
    """"norm" is a plain suffix to PEFT before 0.22 (every RMSNorm is saved), a dotted one
    from 0.22 (the final norm alone); `peft_version` says which PEFT wrote the config."""
    shutil.copytree(saved_dir, folder := tmp_path / "a")
    config = files.read_config(folder) | {"modules_to_save": ["norm"]}
    config.pop("peft_version") if version is None else config.update(peft_version=version)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in files.read_tensors(saved_dir).items() if "embed_tokens" not in k and "lm_head" not in k}
    files.write_tensors(folder, tensors)
    if every_norm:
        assert len(load_peft_adapter(folder, base).saved.norms) == 2 * base.num_layers
    else:
        reject(folder, base, "unexpected tensor base_model.model.model.layers.0.input_layernorm.weight")
        files.write_tensors(folder, {k: v for k, v in tensors.items() if "layernorm" not in k})
        saved = load_peft_adapter(folder, base).saved
        assert not saved.norms and saved.final_norm is not None
    config["peft_version"] = "main"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    reject(folder, base, "peft_version 'main' is not a version number")


@pytest.mark.parametrize("changes, message", [
    (dict(modules_to_save=["o_proj"], target_modules=["q_proj"]),
     "modules_to_save entry 'o_proj' names model.layers.0.self_attn.o_proj (a projection); only embed_tokens, "
     "lm_head and the norms"),
    (dict(modules_to_save=["rotary_emb"]), "names model.rotary_emb (a module)"),
    (dict(modules_to_save=["model"]), "modules_to_save entry 'model' names model (a module)"),
    (dict(modules_to_save=["classifier"]), "modules_to_save entry 'classifier' matches no module of the base model"),
    (dict(modules_to_save="lm_head"), "modules_to_save must be a list of module names"),
    (dict(trainable_token_indices=[3, 256]), "trainable token id 256 is outside the vocabulary (0..255)"),
    (dict(trainable_token_indices=[3, 3]), "lists a token id twice"),
    (dict(trainable_token_indices={"score": [3]}), "trainable_token_indices names 'score'; only embed_tokens"),
    (dict(trainable_token_indices=[3], modules_to_save=["embed_tokens"]),
     "model.embed_tokens is in both modules_to_save and trainable_token_indices"),
    (dict(trainable_token_indices="3"), "trainable_token_indices must be a list of token ids"),
])
def test_what_cannot_be_served_is_refused(lora_copy: Path, base: BaseShapes, files: Any, changes: dict,
                                          message: str) -> None:
    files.write_config(lora_copy, **changes)
    reject(lora_copy, base, message)


def test_tied_bases_refuse_what_peft_would_tie_otherwise(base: BaseShapes) -> None:
    tied = dataclasses.replace(base, tie_word_embeddings=True)
    raw = {"peft_type": "LORA", "target_modules": ["q_proj"]}
    for extra, message in (
        ({"modules_to_save": ["embed_tokens"], "ensure_weight_tying": True}, "ensure_weight_tying=true with a saved"),
        ({"trainable_token_indices": {"embed_tokens": [1, 2], "lm_head": [3]}, "ensure_weight_tying": True},
         "needs the same trainable_token_indices"),
        ({"trainable_token_indices": [1], "modules_to_save": ["lm_head"]}, "with a saved lm_head on a base model"),
    ):
        with pytest.raises(AdapterValidationError, match=message):
            parse_lora_config(raw | extra, tied, 64)
        parse_lora_config(raw | extra, base, 64)  # untied: nothing to tie, served
    # Different rows for the lm_head (no ensure_weight_tying): PEFT keeps them apart.
    spec = parse_lora_config(raw | {"trainable_token_indices": {"embed_tokens": [1], "lm_head": [3]}}, tied, 64)
    assert spec.saved.tokens == {"model.embed_tokens": (1,), "lm_head": (3,)} and not spec.saved.head_shares_embed_rows


def test_saved_tensors_must_match_the_config(saved_dir: Path, tokens_dir: Path, base: BaseShapes, files: Any,
                                             tmp_path: Path) -> None:
    folder = tmp_path / "a"
    shutil.copytree(saved_dir, folder)
    tensors = files.read_tensors(saved_dir)
    files.write_tensors(folder, {k: v for k, v in tensors.items() if "lm_head" not in k})
    reject(folder, base, "missing base_model.model.lm_head.weight (named by modules_to_save")
    files.write_tensors(folder, tensors | {"base_model.model.lm_head.weight": torch.zeros(255, 64)})
    reject(folder, base, "tensor base_model.model.lm_head.weight has shape [255, 64], expected [256, 64]")
    files.write_tensors(folder, tensors)
    files.write_config(folder, modules_to_save=["lm_head"])
    reject(folder, base, "unexpected tensor base_model.model.model.embed_tokens.weight: modules_to_save in "
                         "adapter_config.json does not name it")
    folder = tmp_path / "b"
    shutil.copytree(tokens_dir, folder)
    files.write_config(folder, trainable_token_indices=[7, 3])
    reject(folder, base, f"tensor {DELTA} has shape [3, 64], expected [2, 64]")


def test_saved_modules_are_digested(tokens_dir: Path, saved_dir: Path, base: BaseShapes, files: Any,
                                    tmp_path: Path) -> None:
    """Which token ids the rows replace is content: the same rows for other ids are another
    adapter. A worker's blob check digests the saved tensors as loading does."""
    from loraplex.adapters.blobs import verify_blob

    folder = tmp_path / "other_ids"
    shutil.copytree(tokens_dir, folder)
    files.write_config(folder, trainable_token_indices=[8, 3, 200])
    assert load_peft_adapter(folder, base).digest != load_peft_adapter(tokens_dir, base).digest
    for source in (tokens_dir, saved_dir):
        verify_blob(source, load_peft_adapter(source, base).digest)
