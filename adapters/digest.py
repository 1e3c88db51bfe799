"""Content digest of a LoRA adapter: what it computes, not where or when it was written.

The digest keys prefix-cache entries and the blob store, so two adapters share a digest only
if they hold the same weights under the same LoRA-relevant config. It ignores file mtimes,
JSON key order and fields that do not change the forward pass (paths, peft_version, dropout).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

DIGEST_PREFIX = "sha256:"
_DOMAIN = b"loraplex-lora-digest-v1\0"

# Config fields that change what the adapter computes, with PEFT's defaults, so that an
# omitted field and its explicit default hash the same.
LORA_CONFIG_FIELDS: dict[str, Any] = {
    "peft_type": None,
    "r": 8,
    "lora_alpha": 8,
    "use_rslora": False,
    "target_modules": None,
    "exclude_modules": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
# Fields that change what the adapter computes only when set (saved modules): hashed only
# then, so adapters without them keep the digest they always had.
OPTIONAL_FIELDS: tuple[str, ...] = ("modules_to_save", "trainable_token_indices", "ensure_weight_tying")
# PEFT stores these as sets (saved in arbitrary order), so their order carries no meaning.
_SET_FIELDS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")


def adapter_digest(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical LoRA config and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(_DOMAIN)
    _update_framed(h, canonical_config_json(config).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)], separators=(",", ":"))
        _update_framed(h, header.encode())
        # Viewing as bytes works for every dtype, bf16 included (numpy has no bf16).
        _update_framed(h, t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return DIGEST_PREFIX + h.hexdigest()


def canonical_config_json(config: dict[str, Any]) -> str:
    canon: dict[str, Any] = {}
    for name, default in LORA_CONFIG_FIELDS.items():
        value = config.get(name)
        if value is None:
            value = default
        if name in _SET_FIELDS and isinstance(value, list):
            value = sorted(value, key=lambda v: json.dumps(v))
        if name in ("rank_pattern", "alpha_pattern") and isinstance(value, dict):
            # Pattern order decides which pattern wins (first match), so it is kept: a pair
            # list survives sort_keys below, where a dict would not.
            value = [[k, _number(v) if name == "alpha_pattern" else v] for k, v in value.items()]
        canon[name] = value
    canon["lora_alpha"] = _number(canon["lora_alpha"])
    for name in OPTIONAL_FIELDS:
        if config.get(name):
            # modules_to_save is a set to PEFT; token ids keep their order (row i is id i's).
            value = config[name]
            if name == "modules_to_save" and isinstance(value, list):
                value = sorted(value, key=json.dumps)
            canon[name] = value
    return json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest_hex(digest: str) -> str:
    """The hex part of a digest; raises ValueError when it is not one of ours."""
    hex_part = digest.removeprefix(DIGEST_PREFIX)
    if not digest.startswith(DIGEST_PREFIX) or len(hex_part) != 64 or not _is_hex(hex_part):
        raise ValueError(f"not a loraplex adapter digest: {digest!r}")
    return hex_part


def _number(v: Any) -> Any:
    # alpha 16 and 16.0 scale the same.
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


def _update_framed(h: Any, data: bytes) -> None:
    # Length framing keeps (name="ab", bytes="c") apart from (name="a", bytes="bc").
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
