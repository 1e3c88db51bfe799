"""Llama-family decoder (Llama, Mistral, Qwen2) running on the paged KV cache.

Every projection runs over the whole ragged batch at once ([T, hidden]); only attention
looks at sequence boundaries. q/k/v and gate/up are fused into one matmul each, with LoRA
deltas added into their slices.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import ModelArch, rope_inv_freq
from ..kernels.backend import AttentionMetadata
from ..kernels.torch.attention import paged_attention, write_kv
from ..kernels.torch.layer_ops import TorchLayerOps, rms_norm
from ..kernels.torch.linear import PackedLinear, pack_linears
from ..lora.backend import LoRAHook
from ..lora.saved_modules import HeadRows, SavedBatch


class LlamaLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        self.index = index
        self.arch = arch
        h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.q_size, self.kv_size = q, kv
        self.qkv_proj = nn.Linear(h, q + 2 * kv, bias=arch.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=arch.o_proj_bias)
        self.gate_up_proj = nn.Linear(h, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        # KV write, attention and layer ops: the torch path until the runner sets its
        # kernel backend's (set_attention_ops, set_layer_ops).
        self.write_kv, self.attn_impl = write_kv, paged_attention
        self.ops = TorchLayerOps

    def norm_with(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of `x` with an adapter's own weight (a saved norm), by the layer ops the
        base norms use (on CPU the fused C norm: torch's chain of seven ops per segment and
        layer would add ~20% to a step of saved-norm adapters)."""
        return self.ops.add_rms_norm(x, None, weight, self.arch.rms_norm_eps)[1]

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, lora: LoRAHook | None,
                saved: SavedBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output): the next layer adds the two as part
        of its first norm, so the residual add is fused into it. `saved`: the step's rows
        of adapters with saved modules (their own norms)."""
        a, L, ops = self.arch, self.index, self.ops
        T = x.shape[0]
        x, h = ops.add_rms_norm(x, delta, self.input_layernorm, a.rms_norm_eps)
        if saved is not None:
            saved.norm(L, 0, x, h, self.norm_with)
        qkv = self.qkv_proj(h)
        if lora is not None:
            lora.apply(L, "qkv", h, qkv)
        q, k = ops.rope(qkv, cos, sin, a.num_heads, a.num_kv_heads, a.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, a.num_kv_heads, a.head_dim)
        self.write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        o = self.attn_impl(q, kv[0], kv[1], meta, a.head_dim ** -0.5).reshape(T, self.q_size)
        attn = self.o_proj(o)
        if lora is not None:
            lora.apply(L, "o", o, attn)
        x, h = ops.add_rms_norm(x, attn, self.post_attention_layernorm, a.rms_norm_eps)
        if saved is not None:
            saved.norm(L, 1, x, h, self.norm_with)
        gu = self.gate_up_proj(h)
        if lora is not None:
            lora.apply(L, "gate_up", h, gu)
        m = ops.silu_mul(gu)
        down = self.down_proj(m)
        if lora is not None:
            lora.apply(L, "down", m, down)
        return x, down


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        # The checkpoint sets every weight: no random draw (normal_ on the meta device,
        # where the runner builds the model, imports torch._dynamo: a second per start).
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(arch.vocab_size, arch.hidden_size), freeze=False)
        self.layers = nn.ModuleList(LlamaLayer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # Not a buffer: it must stay fp32 when the model is cast to bf16, as in transformers.
        self.inv_freq: torch.Tensor | None = None
        self.packed_head: nn.Module | None = None
        self.final_ops = TorchLayerOps

    def pack_weights(self, make=PackedLinear) -> None:
        """Pre-pack every projection and the LM head: make(weight, bias) is PackedLinear
        (oneDNN, engine/kernels/torch/linear.py), AmxLinear (C with AMX, kernels/cpu/amx.py),
        Dpbf16Linear (C with AVX512-BF16, kernels/cpu/dpbf16.py) or Bf16Linear (C, AVX2,
        kernels/cpu/gemm.py)."""
        pack_linears(self.layers, make)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_head = make(w, None)

    def set_attention_ops(self, write_kv_fn, attention_fn) -> None:
        """Use these (a `kernels.KernelBackend`'s) for KV writes and attention."""
        for layer in self.layers:
            layer.write_kv, layer.attn_impl = write_kv_fn, attention_fn

    def set_layer_ops(self, ops) -> None:
        """Use `ops` (TorchLayerOps' methods) for every layer's norms, RoPE and SiLU-mul."""
        self.final_ops = ops
        for layer in self.layers:
            layer.ops = ops

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq is None or self.inv_freq.device != positions.device:
            self.inv_freq = rope_inv_freq(self.arch).to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(self.arch, "rope_attention_factor", 1.0)
        return (emb.cos() * scale).to(dtype)[:, None, :], (emb.sin() * scale).to(dtype)[:, None, :]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: LoRAHook | None = None,
                saved: SavedBatch | None = None) -> torch.Tensor:
        """`saved`: the step's rows of adapters with saved modules (saved_modules.py)."""
        x = self.embed_tokens(input_ids)
        if saved is not None:
            saved.embed(input_ids, x)
        cos, sin = self.rope(positions, x.dtype)
        x, delta = self.run_layers(x, cos, sin, meta, kv_caches, lora, saved)
        return x + delta if delta is not None else x

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: LoRAHook | None = None,
                   saved: SavedBatch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual stream, last layer's MLP output) after every layer, from the token
        embeddings `x` (updated in place by the first layer's norm) and the RoPE tables."""
        delta = None
        for layer, kv in zip(self.layers, kv_caches):
            x, delta = layer(x, delta, cos, sin, kv, meta, lora, saved)
        return x, delta

    def compute_logits(self, hidden: torch.Tensor, heads: HeadRows | None = None, widen: bool = True
                       ) -> torch.Tensor:
        """fp32 logits of `hidden`'s rows (widen=False: as the LM head made them, in the
        model's dtype); `heads`: those rows of adapters with their own final norm or
        lm_head (rows), which compute theirs with them."""
        h = rms_norm(hidden, self.norm, self.arch.rms_norm_eps)
        if heads is not None:
            return heads.logits(hidden, h, self._head, partial(rms_norm, eps=self.arch.rms_norm_eps))
        logits = self._head(h)
        return logits.float() if widen else logits

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(h)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w)

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict, fusing q/k/v and gate/up."""
        state = {k.removeprefix("model."): v for k, v in state.items()}
        self.embed_tokens.weight.copy_(state.pop("embed_tokens.weight"))
        self.norm.copy_(state.pop("norm.weight"))
        head = state.pop("lm_head.weight", None)
        if self.lm_head is not None:
            if head is None:
                raise KeyError("lm_head.weight missing from an untied model")
            self.lm_head.weight.copy_(head)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            take = lambda name: state.pop(p + name)  # noqa: E731
            layer.qkv_proj.weight.copy_(torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias.copy_(torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"]))
            layer.o_proj.weight.copy_(take("self_attn.o_proj.weight"))
            if layer.o_proj.bias is not None:
                layer.o_proj.bias.copy_(take("self_attn.o_proj.bias"))
            layer.gate_up_proj.weight.copy_(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]))
            layer.down_proj.weight.copy_(take("mlp.down_proj.weight"))
            layer.input_layernorm.copy_(take("input_layernorm.weight"))
            layer.post_attention_layernorm.copy_(take("post_attention_layernorm.weight"))
        leftover = [k for k in state if "rotary_emb" not in k]
        if leftover:
            raise KeyError(f"unexpected weights in checkpoint: {leftover[:5]}")
