"""PEFT's saved modules beside LoRA: `modules_to_save` and `trainable_token_indices`.

Both are resolved as the PEFT that wrote the adapter resolves them (`_set_trainable`,
`set_additional_trainable_modules`):

- `modules_to_save`: PEFT saves a full copy of every module whose name ends with an
  entry: as a dotted suffix from peft 0.22 ("norm" is `model.norm` alone), as a plain
  string suffix before ("norm" is every RMSNorm); the config's `peft_version` says which
  PEFT wrote it, and one without the field predates 0.22. loraplex serves copies of the
  embedding, the lm_head and the RMSNorm weights; the copy replaces the base module for
  that adapter's rows only.
- `trainable_token_indices`: a list (rows of the input embedding) or {module: list}; PEFT's
  `TrainableTokensLayer` replaces those rows of the module's weight. On a base with tied
  embeddings the lm_head shares the embedding's rows, unless the config gives the lm_head
  rows of its own (other indices), which PEFT then keeps apart.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import AdapterValidationError
from .shapes import LORA_MODULES, BaseShapes, base_module_names

EMBED, HEAD, FINAL_NORM = "model.embed_tokens", "lm_head", "model.norm"
LAYER_NORMS: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
_TOKENS_SUFFIX = "token_adapter.trainable_tokens_delta"
# A saved module's tensor: `base_model.model.<module>.weight` as PEFT saves it, or with
# the wrapper's `modules_to_save.<adapter>` (a live PeftModel's state_dict); trainable
# token rows likewise, with or without the adapter name.
_SAVED_RE = re.compile(
    r"(?:base_model\.model\.)?(?P<module>model\.embed_tokens|lm_head|model\.norm"
    r"|model\.layers\.\d+\.(?:input_layernorm|post_attention_layernorm))"
    r"(?:(?:\.modules_to_save\.[^.]+)?\.weight|\.(?P<tokens>token_adapter\.trainable_tokens_delta)(?:\.[^.]+)?)"
)


@dataclass(frozen=True)
class SavedSpec:
    """What the config says the adapter saves beside LoRA, by HF module name."""

    full: tuple[str, ...] = ()  # modules saved whole (modules_to_save), in model order
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)  # module -> its trainable token ids
    head_shares_embed_rows: bool = False  # tied base: the lm_head uses the embedding's token rows

    def expected(self, base: BaseShapes) -> dict[str, list[int]]:
        """Normalized tensor name -> shape, for every tensor the file must hold."""
        out = {f"base_model.model.{m}.weight": _full_shape(m, base) for m in self.full}
        out.update({f"base_model.model.{m}.{_TOKENS_SUFFIX}": [len(ids), base.hidden_size]
                    for m, ids in self.tokens.items()})
        return out


@dataclass(frozen=True, eq=False)
class TokenRows:
    """Replacement rows of an embedding-shaped weight: row `ids[i]` becomes `rows[i]`."""

    ids: torch.Tensor  # int64 [n], ascending
    rows: torch.Tensor  # [n, hidden]


@dataclass(frozen=True, eq=False)
class SavedModules:
    """An adapter's saved modules, in the served dtype; None: the base module's."""

    embed: torch.Tensor | None = None  # [vocab, hidden], a saved embedding
    embed_rows: TokenRows | None = None  # trainable tokens of the embedding
    head: torch.Tensor | None = None  # [vocab, hidden], a saved lm_head
    head_rows: TokenRows | None = None  # trainable tokens of the lm_head (its own, or the tied embedding's)
    final_norm: torch.Tensor | None = None  # [hidden]
    norms: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (layer, LAYER_NORMS name) -> [hidden]

    def tensors(self) -> list[torch.Tensor]:
        # A tied lm_head's rows are the embedding's own: counted once.
        shared = self.head_rows is self.embed_rows
        tables = (self.embed_rows, None if shared else self.head_rows)
        rows = [t for r in tables if r is not None for t in (r.ids, r.rows)]
        singles = [t for t in (self.embed, self.head, self.final_norm) if t is not None]
        return singles + rows + list(self.norms.values())


def parse_saved_spec(raw: dict[str, Any], base: BaseShapes, lora_targets: set[str]) -> SavedSpec:
    """The config's modules_to_save and trainable_token_indices; refuses what cannot be served.
    `lora_targets`: the HF names of the modules LoRA targets."""
    names = base_module_names(base.num_layers)
    full = _modules_to_save(raw.get("modules_to_save"), names, lora_targets, _dotted_suffixes(raw))
    tokens = _trainable_tokens(raw.get("trainable_token_indices"), names, base)
    for module in tokens:
        if module in full:
            raise AdapterValidationError(f"{module} is in both modules_to_save and trainable_token_indices "
                                         "(PEFT refuses this too)")
    if (EMBED in full or HEAD in full) and not base.vocab_size:
        raise AdapterValidationError("a saved embed_tokens or lm_head needs the base model's vocab_size")
    ensure = raw.get("ensure_weight_tying", False)
    if not isinstance(ensure, (bool, type(None))):
        raise AdapterValidationError(f"ensure_weight_tying must be true or false, not {ensure!r}")
    tied = base.tie_word_embeddings
    if tied and ensure and (EMBED in full or HEAD in full):
        raise AdapterValidationError("ensure_weight_tying=true with a saved embed_tokens or lm_head on a base model "
                                     "with tied embeddings is not supported")
    shares = False
    if tied and EMBED in tokens:
        mismatch = HEAD in tokens and tokens[HEAD] != tokens[EMBED]
        if mismatch and ensure:
            raise AdapterValidationError("ensure_weight_tying=true needs the same trainable_token_indices for "
                                         "embed_tokens and lm_head (PEFT refuses this too)")
        if not mismatch:  # PEFT ties the lm_head to the embedding's rows and saves them once
            tokens.pop(HEAD, None)
            shares = True
            if HEAD in full:
                raise AdapterValidationError("trainable_token_indices on the embedding with a saved lm_head on a "
                                             "base model with tied embeddings is not supported")
    return SavedSpec(full=full, tokens=tokens, head_shares_embed_rows=shares)


def _dotted_suffixes(raw: dict[str, Any]) -> bool:
    """Whether the PEFT that wrote this config matches modules_to_save entries as dotted
    suffixes (0.22 on) rather than plain ones."""
    version = raw.get("peft_version")
    if version is None or not raw.get("modules_to_save"):
        return False
    m = re.match(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if m is None:
        raise AdapterValidationError(f"peft_version {version!r} is not a version number; it decides which modules "
                                     "modules_to_save names")
    return (int(m.group(1)), int(m.group(2))) >= (0, 22)


def _modules_to_save(value: Any, names: list[str], lora_targets: set[str], dotted: bool) -> tuple[str, ...]:
    if not value:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterValidationError("modules_to_save must be a list of module names")
    found: set[str] = set()
    for entry in value:
        hits = [n for n in names if n == entry or n.endswith(("." if dotted else "") + entry)]
        if not hits:
            raise AdapterValidationError(f"modules_to_save entry {entry!r} matches no module of the base model")
        for hit in hits:
            leaf = hit.rsplit(".", 1)[-1]
            if hit in lora_targets:
                raise AdapterValidationError(f"modules_to_save entry {entry!r} names {hit}, which is also a LoRA "
                                             "target; that is not supported")
            if hit not in (EMBED, HEAD, FINAL_NORM) and leaf not in LAYER_NORMS:
                what = "a projection" if leaf in LORA_MODULES else "a module"
                raise AdapterValidationError(
                    f"modules_to_save entry {entry!r} names {hit} ({what}); only embed_tokens, lm_head and the "
                    "norms (input_layernorm, post_attention_layernorm, norm) can be saved")
        found.update(hits)
    return tuple(n for n in names if n in found)


def _trainable_tokens(value: Any, names: list[str], base: BaseShapes) -> dict[str, tuple[int, ...]]:
    if value is None:
        return {}
    if isinstance(value, list):
        per_module = {EMBED: value}  # PEFT: the input embedding
    elif isinstance(value, dict):
        per_module = {}
        for key, ids in value.items():
            hits = [n for n in names if n.endswith(key)] if isinstance(key, str) else []
            if len(hits) != 1 or hits[0] not in (EMBED, HEAD):
                raise AdapterValidationError(f"trainable_token_indices names {key!r}; only embed_tokens and "
                                             "lm_head are supported")
            per_module[hits[0]] = ids
    else:
        raise AdapterValidationError("trainable_token_indices must be a list of token ids or a {module: list} object")
    if not base.vocab_size:
        raise AdapterValidationError("trainable_token_indices needs the base model's vocab_size")
    out: dict[str, tuple[int, ...]] = {}
    for module, ids in per_module.items():
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise AdapterValidationError(f"trainable_token_indices for {module} must be a list of token ids")
        for i in ids:
            if not 0 <= i < base.vocab_size:
                raise AdapterValidationError(f"trainable token id {i} is outside the vocabulary "
                                             f"(0..{base.vocab_size - 1})")
        if len(set(ids)) != len(ids):
            raise AdapterValidationError(f"trainable_token_indices for {module} lists a token id twice")
        out[module] = tuple(ids)
    return out


def _full_shape(module: str, base: BaseShapes) -> list[int]:
    return [base.vocab_size, base.hidden_size] if module in (EMBED, HEAD) else [base.hidden_size]


def saved_tensor_name(name: str) -> str | None:
    """The normalized name of a saved module's tensor, None when `name` is not one."""
    m = _SAVED_RE.fullmatch(name)
    if m is None:
        return None
    return f"base_model.model.{m.group('module')}." + (_TOKENS_SUFFIX if m.group("tokens") else "weight")


def pair_saved(names: list[str], spec: SavedSpec, base: BaseShapes) -> dict[str, tuple[str, list[int]]]:
    """File tensor name -> (normalized name, expected shape) for the saved-module tensors
    among `names`; refuses extras, gaps and duplicates."""
    expected = spec.expected(base)
    found: dict[str, str] = {}
    for name in names:
        norm = saved_tensor_name(name)
        if norm is None:
            continue
        if norm not in expected:
            field_ = "trainable_token_indices" if norm.endswith(_TOKENS_SUFFIX) else "modules_to_save"
            raise AdapterValidationError(f"unexpected tensor {name}: {field_} in adapter_config.json does not name it")
        if norm in found:
            raise AdapterValidationError(f"tensors {found[norm]} and {name} hold the same weight")
        found[norm] = name
    for norm in expected:
        if norm not in found:
            raise AdapterValidationError(f"missing {norm} (named by modules_to_save or trainable_token_indices)")
    return {name: (norm, expected[norm]) for norm, name in found.items()}


def build_saved(spec: SavedSpec, tensors: dict[str, torch.Tensor]) -> SavedModules | None:
    """The adapter's saved modules from its normalized tensors (already checked and cast)."""
    if not spec.full and not spec.tokens:
        return None

    def full(module: str) -> torch.Tensor | None:
        return tensors.get(f"base_model.model.{module}.weight") if module in spec.full else None

    def rows(module: str) -> TokenRows | None:
        if module not in spec.tokens:
            return None
        ids = torch.tensor(spec.tokens[module], dtype=torch.int64)
        order = torch.argsort(ids)
        return TokenRows(ids[order].contiguous(), tensors[f"base_model.model.{module}.{_TOKENS_SUFFIX}"][order])

    embed_rows = rows(EMBED)
    norms = {(int(m.split(".")[2]), m.rsplit(".", 1)[1]): tensors[f"base_model.model.{m}.weight"]
             for m in spec.full if m.rsplit(".", 1)[-1] in LAYER_NORMS}
    return SavedModules(embed=full(EMBED), embed_rows=embed_rows, head=full(HEAD),
                        head_rows=embed_rows if spec.head_shares_embed_rows else rows(HEAD),
                        final_norm=full(FINAL_NORM), norms=norms)
