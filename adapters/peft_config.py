"""Parse and validate a PEFT `adapter_config.json` against the base model.

Target matching and per-module rank/alpha resolution mirror peft 0.21 exactly
(`check_target_module_exists`, `get_pattern_key` and `LoraLayer.update_layer`), so an adapter
computes here what it computes under `PeftModel.from_pretrained`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import AdapterValidationError
from .patterns import PATTERN_BUDGET_S, PatternMatcher
from .peft_saved import SavedSpec, parse_saved_spec
from .shapes import EMBEDDING_MODULES, LORA_MODULES, BaseShapes, base_module_names, module_key

# PEFT's default target_modules for llama, mistral and qwen2 when the config leaves them null.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"

# LoraConfig fields that switch on a LoRA variant with a different forward pass.
_VARIANT_FIELDS = (
    "velora_config",
    "alora_invocation_tokens",
    "use_qalora",
    "monteclora_config",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
)
# init_lora_weights values that rewrite the base weights at init: the saved adapter is only
# correct on top of that rewritten base, not on the base model loraplex serves.
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


@dataclass(frozen=True)
class ModuleSpec:
    rank: int
    alpha: float
    scale: float


@dataclass(frozen=True)
class LoraSpec:
    """What the config says the adapter holds, keyed by (layer index, module name)."""

    r: int
    alpha: float
    use_rslora: bool
    targets: dict[tuple[int, str], ModuleSpec]
    use_dora: bool = False  # every target carries a magnitude vector (DoRA)
    lora_bias: bool = False  # every target's lora_B carries a bias
    saved: SavedSpec = field(default_factory=SavedSpec)  # modules_to_save and trainable_token_indices


def parse_lora_config(
    raw: Any,
    base: BaseShapes,
    max_rank: int,
    *,
    resolved: Any = None,
    budget_s: float = PATTERN_BUDGET_S,
) -> LoraSpec:
    """The config's targets with their ranks and scales.

    `resolved` is a previous result's `targets_to_json`: the patterns are then not run
    again (they ran once, under `budget_s`, when the adapter was first validated).
    """
    if not isinstance(raw, dict):
        raise AdapterValidationError("adapter_config.json must hold a JSON object")
    _check_kind(raw)
    _refuse_unsupported(raw)
    r = _rank(raw.get("r", 8), "r", max_rank)
    alpha = _alpha(raw.get("lora_alpha", 8), "lora_alpha")
    use_rslora, use_dora, lora_bias = (_flag(raw, name) for name in ("use_rslora", "use_dora", "lora_bias"))
    if use_dora and lora_bias:
        raise AdapterValidationError("use_dora=true with lora_bias=true is not supported (PEFT refuses the "
                                     "combination too)")
    kinds = dict(use_rslora=use_rslora, use_dora=use_dora, lora_bias=lora_bias)
    if resolved is not None:
        stored = _targets_from_json(resolved, base, max_rank, use_rslora)
        return LoraSpec(r=r, alpha=alpha, targets=stored, saved=_saved(raw, base, stored), **kinds)
    matcher = PatternMatcher(budget_s)
    rank_pattern = _pattern_dict(raw, "rank_pattern", matcher)
    alpha_pattern = _pattern_dict(raw, "alpha_pattern", matcher)

    targets: dict[tuple[int, str], ModuleSpec] = {}
    for layer, module in _targeted_modules(raw, base, matcher):
        key = module_key(layer, module)
        mr = r
        if (rk := _pattern_key(rank_pattern, key, matcher, "rank_pattern")) is not None:
            mr = _rank(rank_pattern[rk], f"rank_pattern[{rk!r}] for {key}", max_rank)
        ma = alpha
        if (ak := _pattern_key(alpha_pattern, key, matcher, "alpha_pattern")) is not None:
            ma = _alpha(alpha_pattern[ak], f"alpha_pattern[{ak!r}] for {key}")
        targets[(layer, module)] = ModuleSpec(rank=mr, alpha=ma, scale=_scale(ma, mr, use_rslora))
    return LoraSpec(r=r, alpha=alpha, targets=targets, saved=_saved(raw, base, targets), **kinds)


def _saved(raw: dict[str, Any], base: BaseShapes, targets: dict[tuple[int, str], ModuleSpec]) -> SavedSpec:
    return parse_saved_spec(raw, base, {module_key(layer, module) for layer, module in targets})


def targets_to_json(spec: LoraSpec) -> list[list[Any]]:
    """The resolved targets as `[layer, module, rank, alpha]` rows, for `resolved=`."""
    return [[layer, module, m.rank, m.alpha] for (layer, module), m in sorted(spec.targets.items())]


def _targets_from_json(
    data: Any, base: BaseShapes, max_rank: int, use_rslora: bool
) -> dict[tuple[int, str], ModuleSpec]:
    if not isinstance(data, list) or not data:
        raise AdapterValidationError("the stored resolved target list is malformed")
    targets: dict[tuple[int, str], ModuleSpec] = {}
    for row in data:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], int) and row[1] in LORA_MODULES
                and 0 <= row[0] < base.num_layers):
            raise AdapterValidationError(f"the stored resolved target {row!r} is malformed")
        layer, module = row[0], row[1]
        rank = _rank(row[2], f"the stored rank of {module_key(layer, module)}", max_rank)
        alpha = _alpha(row[3], f"the stored alpha of {module_key(layer, module)}")
        targets[(layer, module)] = ModuleSpec(rank=rank, alpha=alpha, scale=_scale(alpha, rank, use_rslora))
    return targets


def _scale(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _check_kind(raw: dict[str, Any]) -> None:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise AdapterValidationError(f"peft_type is {peft_type!r}; only LORA adapters are supported")
    task_type = raw.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        raise AdapterValidationError(f"task_type {task_type!r} is not supported; only CAUSAL_LM adapters are")


def _flag(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise AdapterValidationError(f"{name} must be true or false, not {value!r}")
    return value


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    if raw.get("bias", "none") not in (None, "none"):
        raise AdapterValidationError(f"bias={raw['bias']!r} is not supported (it retrains base model biases)")
    for name in ("target_parameters", "layer_replication"):
        if raw.get(name):
            raise AdapterValidationError(f"{name} is not supported")
    for name in _VARIANT_FIELDS:
        if raw.get(name):
            raise AdapterValidationError(f"the LoRA variant {name} is not supported")
    # fan_in_fan_out is ignored on purpose: PEFT forces it off for nn.Linear targets.
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterValidationError(
            f"init_lora_weights={init!r} rewrites the base weights, so the adapter is wrong on the "
            "unmodified base model; convert it to plain LoRA first (PEFT save_pretrained with "
            "path_initial_model_for_weight_conversion)"
        )


def _rank(value: Any, what: str, max_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AdapterValidationError(f"{what} must be an integer rank, not {value!r}")
    if value < 1:
        raise AdapterValidationError(f"rank {value} ({what}) is invalid; a rank must be at least 1")
    if value > max_rank:
        raise AdapterValidationError(f"rank {value} ({what}) exceeds the maximum supported rank {max_rank}")
    return value


def _alpha(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterValidationError(f"{what} must be a finite number, not {value!r}")
    if value <= 0:
        raise AdapterValidationError(f"{what} is {value}; lora_alpha must be positive")
    return float(value)


def _pattern_dict(raw: dict[str, Any], name: str, matcher: PatternMatcher) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterValidationError(f"{name} must be a JSON object mapping patterns to values")
    for key in value:
        matcher.check(key, name)
    return value


def _pattern_key(patterns: dict[str, Any], key: str, matcher: PatternMatcher, field: str) -> str | None:
    # peft.utils.other.get_pattern_key: the first pattern (in file order) that matches a
    # dotted suffix of the module name wins.
    for pattern in patterns:
        if matcher.match(rf"(.*\.)?({pattern})$", key, field, shown=pattern):
            return pattern
    return None


def _targeted_modules(raw: dict[str, Any], base: BaseShapes, matcher: PatternMatcher) -> list[tuple[int, str]]:
    """(layer, module) pairs the config targets; refuses configs that target anything else."""
    target = raw.get("target_modules")
    if target is None:
        target = list(DEFAULT_TARGET_MODULES)
    elif isinstance(target, str) and target.lower() == ALL_LINEAR:
        # PEFT expands all-linear to every nn.Linear except the output head.
        target = [module_key(i, m) for i in range(base.num_layers) for m in LORA_MODULES]
    elif isinstance(target, str):
        matcher.check(target, "target_modules")
        if raw.get("layers_to_transform") is not None or raw.get("layers_pattern") is not None:
            raise AdapterValidationError("layers_to_transform cannot be used when target_modules is a regex string")
    elif not isinstance(target, list) or not all(isinstance(t, str) for t in target):
        raise AdapterValidationError("target_modules must be a list of module names, a regex string or 'all-linear'")
    else:
        _check_list_entries(target, base)
    layers = _layers_to_transform(raw, base)
    _layers_pattern(raw, matcher)
    exclude = _exclude_modules(raw, matcher)
    found: list[tuple[int, str]] = []
    for key in base_module_names(base.num_layers):
        if _is_excluded(exclude, key, matcher) or not _is_targeted(
            target, layers, raw.get("layers_pattern"), key, matcher
        ):
            continue
        found.append(_supported_module(key, target))
    if not found:
        raise AdapterValidationError(f"target_modules {target!r} matches no module of the base model")
    return found


def _check_list_entries(target: list[str], base: BaseShapes) -> None:
    names = base_module_names(base.num_layers)
    for entry in target:
        if any(n == entry or n.endswith(f".{entry}") for n in names):
            continue
        m = re.match(r"(?:^|.*\.)layers\.(\d+)\.", entry)
        if m and int(m.group(1)) >= base.num_layers:
            raise AdapterValidationError(
                f"layer {m.group(1)} does not exist in the base model ({base.num_layers} layers)"
            )
        raise AdapterValidationError(f"target module {entry!r} does not exist in the base model")


def _supported_module(key: str, target: Any) -> tuple[int, str]:
    leaf = key.rsplit(".", 1)[-1]
    if leaf in EMBEDDING_MODULES:
        raise AdapterValidationError(
            f"target module {leaf!r} is not supported (LoRA on embeddings/lm_head is not supported)"
        )
    m = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)", key)
    if m is None or m.group(2) not in LORA_MODULES:
        raise AdapterValidationError(
            f"target module {leaf!r} (matched by target_modules {target!r}) is not supported; "
            f"LoRA is supported on {', '.join(LORA_MODULES)}"
        )
    return int(m.group(1)), m.group(2)


def _layers_to_transform(raw: dict[str, Any], base: BaseShapes) -> list[int] | None:
    value = raw.get("layers_to_transform")
    if value is None or value == []:
        return None
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise AdapterValidationError("layers_to_transform must be a layer index or a list of them")
    for layer in layers:
        if not 0 <= layer < base.num_layers:
            raise AdapterValidationError(f"layer {layer} does not exist in the base model ({base.num_layers} layers)")
    return layers


def _layers_pattern(raw: dict[str, Any], matcher: PatternMatcher) -> None:
    value = raw.get("layers_pattern")
    patterns = [value] if isinstance(value, str) else value
    if patterns is not None and not isinstance(patterns, list):
        raise AdapterValidationError("layers_pattern must be a string or a list of strings")
    for pattern in patterns or []:
        matcher.check(pattern, "layers_pattern")


def _exclude_modules(raw: dict[str, Any], matcher: PatternMatcher) -> str | list[str] | None:
    value = raw.get("exclude_modules")
    if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        if isinstance(value, str):
            matcher.check(value, "exclude_modules")
        return value
    raise AdapterValidationError("exclude_modules must be a list of module names or a regex string")


def _is_excluded(exclude: str | list[str] | None, key: str, matcher: PatternMatcher) -> bool:
    if not exclude:
        return False
    if isinstance(exclude, str):
        return matcher.fullmatch(exclude, key, "exclude_modules")
    return key in exclude or any(key.endswith(f".{e}") for e in exclude)


def _is_targeted(
    target: str | list[str], layers: list[int] | None, layers_pattern: Any, key: str, matcher: PatternMatcher
) -> bool:
    # peft.tuners.tuners_utils.check_target_module_exists, minus the parts refused above.
    if isinstance(target, str):
        return matcher.fullmatch(target, key, "target_modules")
    if key in target:
        return True  # an exact name bypasses layers_to_transform, as in PEFT
    if not any(key.endswith(f".{t}") for t in target):
        return False
    if layers is None:
        return True
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        patterns = [layers_pattern] if isinstance(layers_pattern, str) else list(layers_pattern)
        m = None
        for pattern in patterns:
            m = matcher.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key, "layers_pattern", shown=pattern)
            if m is not None:
                break
    return m is not None and int(m.group("idx")) in layers
