"""The PEFT adapter kinds beyond plain LoRA: DoRA and lora_bias load exactly as PEFT saved
them; what loraplex still cannot serve is refused with a message."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.adapters import AdapterStore, BaseShapes, load_peft_adapter, max_adapter_bytes
from loraplex.adapters.limits import max_header_bytes
from tests.adapters.test_peft import assert_matches_peft, peft_layers, peft_model, reject
from tests.adapters.test_peft_saved import NORMS

MAG = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.fixture(scope="module")
def dora_dir(make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(rank=4, alpha=8, seed=3, lora_config={"use_dora": True})


@pytest.fixture(scope="module")
def bias_dir(make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(rank=4, alpha=8, seed=4, lora_config={"lora_bias": True})


def test_dora_loads_as_peft_saved_it(dora_dir: Path, base_dir: Path, base: BaseShapes, files: Any) -> None:
    adapter = load_peft_adapter(dora_dir, base)
    model = peft_model(base_dir, dora_dir)
    assert_matches_peft(adapter, model)
    for key, module in peft_layers(model).items():
        w = adapter.weights[key]
        assert torch.equal(w.magnitude, module.lora_magnitude_vector["default"].weight.detach()), key
        assert w.bias is None
    # synth perturbed the magnitudes away from PEFT's init (the norms of W), or DoRA would
    # only rescale by ||W|| / ||W + scale B A||.
    layer = peft_layers(model)[(0, "q_proj")]
    assert not torch.allclose(adapter.weights[(0, "q_proj")].magnitude, layer.weight.norm(dim=1))
    assert adapter.size_bytes == sum(t.nbytes for w in adapter.weights.values() for t in w.tensors())
    assert MAG in files.read_tensors(dora_dir)


def test_lora_bias_loads_as_peft_saved_it(bias_dir: Path, base_dir: Path, base: BaseShapes) -> None:
    adapter = load_peft_adapter(bias_dir, base)
    model = peft_model(base_dir, bias_dir)
    assert_matches_peft(adapter, model)
    for key, module in peft_layers(model).items():
        w = adapter.weights[key]
        assert w.bias.abs().sum() > 0 and torch.equal(w.bias, module.lora_B["default"].bias.detach()), key
        assert w.magnitude is None


def test_kinds_have_digests_of_their_own(dora_dir: Path, bias_dir: Path, base: BaseShapes, files: Any,
                                         tmp_path: Path) -> None:
    """The extra tensors are part of the content: dropping them (and the flag) is another adapter."""
    import shutil

    for folder, flag, suffix in ((dora_dir, "use_dora", "lora_magnitude_vector"), (bias_dir, "lora_bias", ".bias")):
        plain = tmp_path / flag
        shutil.copytree(folder, plain)
        files.write_tensors(plain, {k: v for k, v in files.read_tensors(plain).items() if not k.endswith(suffix)})
        files.write_config(plain, **{flag: False})
        assert load_peft_adapter(plain, base).digest != load_peft_adapter(folder, base).digest


def test_live_state_dict_names_load(dora_dir: Path, base: BaseShapes, files: Any, tmp_path: Path) -> None:
    """Checkpoints written from a live PeftModel's state_dict keep the adapter name."""
    import shutil

    folder = tmp_path / "live"
    shutil.copytree(dora_dir, folder)
    renamed = {k.replace("lora_magnitude_vector", "lora_magnitude_vector.default.weight")
                .replace("lora_A.weight", "lora_A.default.weight").replace("lora_B.weight", "lora_B.default.weight"): v
               for k, v in files.read_tensors(folder).items()}
    files.write_tensors(folder, renamed)
    assert load_peft_adapter(folder, base).digest == load_peft_adapter(dora_dir, base).digest


def test_flag_and_tensors_must_agree(dora_dir: Path, bias_dir: Path, lora_copy: Path, base: BaseShapes,
                                     files: Any, tmp_path: Path) -> None:
    import shutil

    files.write_config(lora_copy, use_dora=True)
    reject(lora_copy, base, "missing lora_magnitude_vector (use_dora=true) for model.layers.0.self_attn.q_proj")
    files.write_config(lora_copy, use_dora=False, lora_bias=True)
    reject(lora_copy, base, "missing the lora_B bias (lora_bias=true) for model.layers.0.self_attn.q_proj")
    dora = tmp_path / "dora"
    shutil.copytree(dora_dir, dora)
    files.write_config(dora, use_dora=False)
    reject(dora, base, "is a DoRA magnitude vector but adapter_config.json has use_dora=false")
    bias = tmp_path / "bias"
    shutil.copytree(bias_dir, bias)
    files.write_config(bias, lora_bias=False)
    reject(bias, base, "lora_B.bias is a lora_B bias but adapter_config.json has lora_bias=false")


def test_malformed_kind_tensors_are_refused(dora_dir: Path, base: BaseShapes, files: Any, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(dora_dir, folder)
    tensors = files.read_tensors(folder)
    tensors[MAG] = torch.ones(7)
    files.write_tensors(folder, tensors)
    reject(folder, base, f"tensor {MAG} has shape [7], expected [64]")
    tensors[MAG] = torch.full((64,), float("nan"))
    files.write_tensors(folder, tensors)
    reject(folder, base, f"tensor {MAG} contains NaN or infinite values")
    del tensors[MAG]
    tensors[MAG.replace("lora_magnitude_vector", "lora_A.bias")] = torch.ones(4)
    files.write_tensors(folder, tensors)
    reject(folder, base, "PEFT never saves a bias on lora_A")


def test_dora_with_lora_bias_is_refused(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, use_dora=True, lora_bias=True)
    reject(lora_copy, base, "use_dora=true with lora_bias=true is not supported (PEFT refuses the combination too)")


def test_kinds_still_refused(make_adapter: Callable[..., Path], lora_copy: Path, base: BaseShapes,
                             files: Any) -> None:
    files.write_config(lora_copy, use_dora="yes")
    reject(lora_copy, base, "use_dora must be true or false, not 'yes'")


def test_full_rank_dora_fits_the_upload_bound(make_adapter: Callable[..., Path], base: BaseShapes,
                                              tmp_path: Path) -> None:
    """The bound counts one vector per module, a saved embedding and lm_head and every norm:
    a DoRA adapter at the rank cap that saves them all still uploads."""
    lora = make_adapter(rank=8, alpha=16, lora_config={"use_dora": True,
                                                       "modules_to_save": ["embed_tokens", "lm_head", *NORMS]})
    # Rank 8 on every projection with its magnitude, and every saved module: exactly the
    # bound's tensor bytes.
    assert max_adapter_bytes(base, 8) == 8 + max_header_bytes(base) + load_peft_adapter(lora, base).size_bytes
    assert (lora / "adapter_model.safetensors").stat().st_size <= max_adapter_bytes(base, 8)
    store = AdapterStore(tmp_path / "store", base, max_rank=8)
    assert store.add("dora", lora).rank == 8



def test_blob_verification_digests_the_kinds_as_loading_does(dora_dir: Path, bias_dir: Path,
                                                             base: BaseShapes) -> None:
    """A worker verifies a fetched blob by its tensors' normalized names: magnitudes and
    biases included, so a DoRA or lora_bias version verifies as its upload digested."""
    from loraplex.adapters.blobs import verify_blob

    for folder in (dora_dir, bias_dir):
        verify_blob(folder, load_peft_adapter(folder, base).digest)
