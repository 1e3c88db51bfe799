"""The engine's kernels, one backend object per device (backend.KernelBackend): attention
with its own metadata builder, the KV write, fused layer steps, the linear layers and
the LoRA backend. `select.select_backend` picks the backend's name once at start ("auto":
Triton on CUDA, the C kernels on a CPU where they build, else torch, unless
`EngineConfig.kernels` forces one); `backend.create_backend` makes it.

- `torch/`: the torch reference (paged attention and KV write, `TorchLayerOps`, the
  oneDNN-packed linears) and the "torch" backend, with the torch LoRA backend; also
  what runs where neither of the others can.
- `cpu/`: C sources, each beside the Python launcher that builds (cpu/build.py) and
  calls it, and the "cpu" backend.
- `triton/`: Triton kernels (KV write, paged attention over a ragged batch, LoRA shrink
  and expand over adapter segments) and the "triton" backend.

Importing this package does not import Triton; the kernel modules do, and Triton's
interpreter (`TRITON_INTERPRET=1`, set before they are imported) runs them on CPU
tensors, which is how the tests prove them on machines without a GPU.
"""
from .backend import REGISTRY, KernelBackend, create_backend
from .select import select_backend, triton_available
from .torch.linear import builds_state_per_shape

__all__ = ["REGISTRY", "KernelBackend", "builds_state_per_shape", "create_backend", "select_backend",
           "triton_available"]
