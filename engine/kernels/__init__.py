"""GPU kernels (Triton) for the engine's hot paths, each beside its torch reference.

- `kv_write`: the step's new keys/values into their KV cache slots.
- `paged_attention`: one ragged batch (decodes and prefill chunks together), causal over
  each sequence's own KV blocks through its block table, GQA, online softmax.
- `lora_kernels`: LoRA shrink `x·A` and expand `(x·A)·B` over the batch's adapter
  segments, every projection of a group in one launch, heterogeneous ranks.

`select.select_backend` decides between these and the torch path (engine/attention.py,
engine/lora.py): Triton on CUDA, torch elsewhere, unless `EngineConfig.kernels` forces
one. Importing this package does not import Triton; the kernel modules do, and Triton's
interpreter (`TRITON_INTERPRET=1`, set before they are imported) runs them on CPU
tensors, which is how the tests prove them on machines without a GPU.
"""
from .select import attention_ops, select_backend, triton_available

__all__ = ["attention_ops", "select_backend", "triton_available"]
