"""Load a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`), fully validated.

The safetensors header is read and checked (names, dtypes, shapes, byte ranges) before any
tensor is loaded, so a forged file costs a bounded read, not its declared size in memory.
A folder validated once may hold `loraplex_targets.json`, the targets its config resolved
to: later loads use it and never run the config's regular expressions again.

Only safetensors is read. A folder holding a pickled checkpoint (`adapter_model.bin`, `.pt`,
...) *and* `adapter_model.safetensors` loads from the safetensors file and never opens the
pickle, as PEFT itself prefers safetensors; a folder with only a pickle is refused.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .digest import adapter_digest
from .errors import AdapterTooLargeError, AdapterValidationError
from .limits import MAX_CONFIG_BYTES, max_header_bytes
from .peft_config import LoraSpec, parse_lora_config, targets_to_json
from .peft_saved import SavedModules, build_saved, pair_saved, saved_tensor_name
from .safetensors_header import FLOAT_DTYPES, TensorInfo, read_header
from .shapes import LORA_MODULES, MODULE_PARENT, BaseShapes, module_key

__all__ = [
    "BaseShapes",
    "LoRAAdapter",
    "LoRAWeight",
    "find_adapter_files",
    "load_peft_adapter",
    "normalized_tensor_name",
    "read_adapter_config",
    "write_resolved_targets",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
TARGETS_NAME = "loraplex_targets.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
DEFAULT_MAX_RANK = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# PEFT saves `base_model.model.<module>.lora_A.weight`; checkpoints written from a live
# PeftModel's state_dict keep the adapter name (`lora_A.default.weight`). Both normalize
# to the first form.
_TENSOR_RE = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.(?P<kind>weight|bias)"
    r"|lora_magnitude_vector(?:\.[^.]+\.weight|\.weight)?)"
)
# A tensor's role: "A", "B", "bias" (lora_B's, with lora_bias=true) or "magnitude" (DoRA),
# and the name PEFT saves it under, relative to the module.
_ROLE_SUFFIX = {"A": "lora_A.weight", "B": "lora_B.weight", "bias": "lora_B.bias",
                "magnitude": "lora_magnitude_vector"}


@dataclass(frozen=True, eq=False)
class LoRAWeight:
    """One projection's low-rank delta: `y += ((x @ a.T) @ b.T + bias) * scale`; with DoRA
    (`magnitude`) the projection's output is then rescaled per output feature (PEFT's
    `DoraLinearLayer`: magnitude / ||W + scale * b @ a|| per row of W)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float
    bias: torch.Tensor | None = None  # [out_features], lora_B's bias (lora_bias=true)
    magnitude: torch.Tensor | None = None  # [out_features], DoRA's lora_magnitude_vector

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.a, self.b, self.bias, self.magnitude) if t is not None]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A validated adapter; `digest` is its content identity (see `digest.adapter_digest`)."""

    digest: str
    rank: int  # the largest rank over all modules
    target_modules: tuple[str, ...]  # the projections that carry weights, in LORA_MODULES order
    alpha: float  # the config's lora_alpha; per-module values are folded into each scale
    use_rslora: bool
    size_bytes: int  # bytes of the loaded tensors (in the requested dtype)
    weights: dict[tuple[int, str], LoRAWeight] = field(repr=False)
    resolved_targets: list[list[Any]] = field(repr=False, default_factory=list)  # see write_resolved_targets
    saved: SavedModules | None = field(repr=False, default=None)  # modules_to_save, trainable_token_indices


def load_peft_adapter(
    folder: str | Path,
    base: BaseShapes,
    dtype: torch.dtype = torch.float32,
    *,
    max_rank: int = DEFAULT_MAX_RANK,
    max_weights_bytes: int | None = None,
) -> LoRAAdapter:
    """Parse and validate a PEFT LoRA folder against `base`; raise AdapterValidationError.

    `max_weights_bytes` caps the safetensors file (see `limits.max_adapter_bytes`).
    """
    folder = Path(folder)
    config_path, weights_path = find_adapter_files(folder)
    raw = read_adapter_config(config_path)
    spec = parse_lora_config(raw, base, max_rank, resolved=_read_resolved(folder))
    if max_weights_bytes is not None and (size := os.path.getsize(weights_path)) > max_weights_bytes:
        raise AdapterTooLargeError(
            f"{WEIGHTS_NAME} is {size} bytes, over the {max_weights_bytes} byte limit for this base model"
        )
    header = read_header(weights_path, max_header_bytes(base))
    saved_names = pair_saved(list(header), spec.saved, base)
    names = _pair_tensors({n: i for n, i in header.items() if n not in saved_names}, base, spec)
    for key, roles in names.items():
        for role, name in roles.items():
            _check_declared(name, header[name], _expected_shape(role, key, spec, base))
    for name, (_, shape) in saved_names.items():
        _check_declared(name, header[name], shape)
    tensors = _read_safetensors(weights_path)
    normalized: dict[str, torch.Tensor] = {}
    saved: dict[str, torch.Tensor] = {}
    for name, (norm, shape) in saved_names.items():
        _check_tensor(name, tensors[name], shape)
        normalized[norm], saved[norm] = tensors[name], _cast(name, tensors[name], dtype)
    weights: dict[tuple[int, str], LoRAWeight] = {}
    for key, roles in sorted(names.items()):
        loaded = {}
        for role, name in roles.items():
            t = tensors[name]
            _check_tensor(name, t, _expected_shape(role, key, spec, base))
            normalized[f"base_model.model.{module_key(*key)}.{_ROLE_SUFFIX[role]}"] = t
            loaded[role] = _cast(name, t, dtype)
        weights[key] = LoRAWeight(a=loaded["A"], b=loaded["B"], scale=spec.targets[key].scale,
                                  bias=loaded.get("bias"), magnitude=loaded.get("magnitude"))
    present = {m for _, m in weights}
    extra = build_saved(spec.saved, saved)
    return LoRAAdapter(
        digest=adapter_digest(raw, normalized),
        rank=max(w.rank for w in weights.values()),
        target_modules=tuple(m for m in LORA_MODULES if m in present),
        alpha=spec.alpha,
        use_rslora=spec.use_rslora,
        size_bytes=sum(t.nbytes for w in weights.values() for t in w.tensors())
        + (0 if extra is None else sum(t.nbytes for t in extra.tensors())),
        weights=weights,
        resolved_targets=targets_to_json(spec),
        saved=extra,
    )


def _expected_shape(role: str, key: tuple[int, str], spec: LoraSpec, base: BaseShapes) -> list[int]:
    rank = spec.targets[key].rank
    in_f, out_f = base.module_dims(key[1])
    return {"A": [rank, in_f], "B": [out_f, rank]}.get(role, [out_f])


def write_resolved_targets(folder: Path, adapter: LoRAAdapter) -> None:
    """Store what the adapter's config resolved to next to it (fsync'd), for later loads."""
    path = Path(folder) / TARGETS_NAME
    with open(path, "w") as f:
        json.dump({"format": 1, "targets": adapter.resolved_targets}, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def _read_resolved(folder: Path) -> list[Any] | None:
    path = folder / TARGETS_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes()[: MAX_CONFIG_BYTES + 1])
    except ValueError as e:
        raise AdapterValidationError(f"{TARGETS_NAME} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != 1:
        raise AdapterValidationError(f"{TARGETS_NAME} is not a format-1 target list")
    return data.get("targets")


def find_adapter_files(folder: Path) -> tuple[Path, Path]:
    """(config, safetensors) paths of a PEFT folder; refuses pickle-only folders."""
    if not folder.is_dir():
        raise AdapterValidationError(f"adapter folder {folder} does not exist")
    config, weights = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config.is_file():
        raise AdapterValidationError(f"{CONFIG_NAME} is missing")
    if weights.is_file():
        return config, weights
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterValidationError(f"{pickles[0]} is a pickled checkpoint; only safetensors is accepted")
    raise AdapterValidationError(f"{WEIGHTS_NAME} is missing")


def read_adapter_config(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterTooLargeError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise AdapterValidationError(f"{CONFIG_NAME} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterValidationError(f"{CONFIG_NAME} must hold a JSON object")
    return raw


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path, device="cpu")
    except Exception as e:  # safetensors raises its own error types, and OSError
        raise AdapterValidationError(f"{WEIGHTS_NAME} is not a valid safetensors file: {e}") from None


def _pair_tensors(
    tensors: dict[str, TensorInfo], base: BaseShapes, spec: LoraSpec
) -> dict[tuple[int, str], dict[str, str]]:
    """Map every tensor to its (layer, module) and role; refuse extras, gaps and duplicates."""
    found: dict[tuple[int, str, str], str] = {}
    for name in tensors:
        layer, module, role = _parse_name(name)
        if layer >= base.num_layers:
            raise AdapterValidationError(
                f"layer {layer} does not exist in the base model ({base.num_layers} layers)"
            )
        if (layer, module) not in spec.targets:
            raise AdapterValidationError(
                f"unexpected tensor {name}: {module_key(layer, module)} is not targeted by {CONFIG_NAME}"
            )
        if role == "magnitude" and not spec.use_dora:
            raise AdapterValidationError(f"{name} is a DoRA magnitude vector but {CONFIG_NAME} has use_dora=false")
        if role == "bias" and not spec.lora_bias:
            raise AdapterValidationError(f"{name} is a lora_B bias but {CONFIG_NAME} has lora_bias=false")
        key = (layer, module, role)
        if key in found:
            raise AdapterValidationError(f"tensors {found[key]} and {name} hold the same weight")
        found[key] = name
    roles = ["A", "B"] + ["magnitude"] * spec.use_dora + ["bias"] * spec.lora_bias
    out: dict[tuple[int, str], dict[str, str]] = {}
    for layer, module in spec.targets:
        for role in roles:
            if (layer, module, role) not in found:
                what = {"magnitude": "lora_magnitude_vector (use_dora=true)",
                        "bias": "the lora_B bias (lora_bias=true)"}.get(role, f"lora_{role}")
                raise AdapterValidationError(f"missing {what} for {module_key(layer, module)}")
        out[(layer, module)] = {role: found[(layer, module, role)] for role in roles}
    return out


def _parse_name(name: str) -> tuple[int, str, str]:
    """(layer, module, role) of a tensor name, or AdapterValidationError."""
    m = _TENSOR_RE.fullmatch(name)
    if m is None or MODULE_PARENT.get(m.group("module")) != m.group("parent"):
        raise AdapterValidationError(_explain_unexpected(name))
    if m.group("ab") is None:
        role = "magnitude"
    elif m.group("kind") == "bias":
        if m.group("ab") == "A":
            raise AdapterValidationError(f"unexpected tensor {name} (PEFT never saves a bias on lora_A)")
        role = "bias"
    else:
        role = m.group("ab")
    return int(m.group("layer")), m.group("module"), role


def normalized_tensor_name(name: str) -> str:
    """The PEFT file name of a tensor (`base_model.model.<module>.lora_A.weight`), as digested."""
    if (saved := saved_tensor_name(name)) is not None:
        return saved
    layer, module, role = _parse_name(name)
    return f"base_model.model.{module_key(layer, module)}.{_ROLE_SUFFIX[role]}"


def _explain_unexpected(name: str) -> str:
    if "lora_embedding" in name or re.search(r"(embed_tokens|lm_head)\.lora_", name):
        return f"unexpected tensor {name} (LoRA on embeddings/lm_head is not supported)"
    if "modules_to_save" in name:
        return f"unexpected tensor {name} (only embed_tokens, lm_head and the norms can be saved modules)"
    return f"unexpected tensor {name}"


def _check_declared(name: str, info: TensorInfo, expected: list[int]) -> None:
    if info.dtype not in FLOAT_DTYPES:
        raise AdapterValidationError(
            f"tensor {name} has dtype {info.dtype}; LoRA weights must be floating point"
        )
    if list(info.shape) != expected:
        raise AdapterValidationError(f"tensor {name} has shape {list(info.shape)}, expected {expected}")


def _check_tensor(name: str, t: torch.Tensor, expected: list[int]) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise AdapterValidationError(f"tensor {name} has dtype {t.dtype}; LoRA weights must be floating point")
    if list(t.shape) != expected:
        raise AdapterValidationError(f"tensor {name} has shape {list(t.shape)}, expected {expected}")
    if not bool(torch.isfinite(t).all()):
        raise AdapterValidationError(f"tensor {name} contains NaN or infinite values")


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = t.to(dtype).contiguous()
    # A finite fp32 weight can still overflow fp16's range.
    if not bool(torch.isfinite(out).all()):
        raise AdapterValidationError(f"tensor {name} overflows {dtype} (values beyond its range)")
    return out
