"""Kernel backend selection (Triton on CUDA, the C kernels on a CPU where they build, else
torch; a setting forces one) and the backend objects registered under those names."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.torch import attention
from loraplex.engine.kernels.torch.attention import RaggedAttentionMetadata, TorchAttentionMetadata
from loraplex.engine.kernels import REGISTRY, create_backend
from loraplex.engine.kernels.cpu.metadata import CpuAttentionMetadata
from loraplex.engine.kernels.select import select_backend
from loraplex.engine.lora.torch_backend import TorchLoRABackend
from loraplex.engine.models.llama import TorchLayerOps


@pytest.mark.parametrize("library", ["decode", "prefill", "fused", "lora"])
def test_auto_on_cpu_is_the_c_kernel_where_it_builds(monkeypatch, library):
    # The "cpu" backend calls each of these without another check: any one missing means torch.
    import importlib

    module = importlib.import_module(f"loraplex.engine.kernels.cpu.{library}")
    assert select_backend("torch", "cpu") == "torch"
    built = module.load_library() is not None
    assert select_backend("auto", "cpu") == ("cpu" if built else "torch")
    monkeypatch.setattr(module, "load_library", lambda: None)  # no compiler
    assert select_backend("auto", "cpu") == "torch"
    with pytest.raises(RuntimeError, match="could not be built"):
        select_backend("cpu", "cpu")
    with pytest.raises(RuntimeError, match="CPU device"):
        select_backend("cpu", "cuda")


def test_cpu_kernels_take_bf16_and_fp32_only():
    from loraplex.engine.kernels.cpu import decode as cpu_decode

    if cpu_decode.load_library() is None:
        pytest.skip("no C compiler")
    for dtype in (torch.bfloat16, torch.float32):
        assert select_backend("auto", "cpu", dtype) == "cpu"
    assert select_backend("auto", "cpu", torch.float16) == "torch"
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        select_backend("cpu", "cpu", torch.float16)


def test_auto_on_cuda(monkeypatch):
    pytest.importorskip("triton")
    assert select_backend("auto", torch.device("cuda", 0)) == "triton"
    monkeypatch.setattr("loraplex.engine.kernels.select.triton_available", lambda: False)
    assert select_backend("auto", "cuda") == "torch"


def test_forced_triton(monkeypatch):
    pytest.importorskip("triton")
    assert select_backend("triton", "cpu") == "triton"  # conftest switched the interpreter on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select_backend("triton", "cpu")
    monkeypatch.setattr("loraplex.engine.kernels.select.triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        select_backend("triton", "cuda")


def test_unknown_setting():
    with pytest.raises(ValueError, match="unknown kernels"):
        select_backend("cuda", "cpu")


SEQS = [(4, 1, [3]), (20, 1, [0, 5]), (0, 6, [1]), (16, 3, [2, 4])]  # two decodes, two prefill chunks


def test_each_backend_builds_only_its_own_metadata():
    cpu = torch.device("cpu")
    torch_backend = create_backend("torch", cpu, torch.float32)
    assert (torch_backend.write_kv, torch_backend.paged_attention) == (attention.write_kv, attention.paged_attention)
    assert torch_backend.layer_ops() is TorchLayerOps and torch_backend.lora_backend is TorchLoRABackend
    meta = torch_backend.build_metadata(SEQS, 16)
    assert type(meta) is TorchAttentionMetadata and meta.num_decodes == 2 and len(meta.prefills) == 2
    assert meta.slot_mapping.tolist() == [52, 84, 16, 17, 18, 19, 20, 21, 64, 65, 66]

    c = create_backend("cpu", cpu, torch.float32)
    from loraplex.engine.kernels.cpu.decode import cpu_paged_attention
    from loraplex.engine.kernels.cpu.fused import CLayerOps, cpu_write_kv
    from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend

    assert (c.write_kv, c.paged_attention, c.lora_backend) == (cpu_write_kv, cpu_paged_attention, CLoRABackend)
    assert isinstance(c.layer_ops(), CLayerOps)
    meta = c.build_metadata(SEQS, 16)
    assert type(meta) is CpuAttentionMetadata and meta.seq_lens.tolist() == [5, 21, 6, 19]
    assert meta.block_tables.tolist() == [[3, 0], [0, 5], [1, 0], [2, 4]]

    pytest.importorskip("triton")
    from loraplex.engine.kernels.triton.kv_write import triton_write_kv
    from loraplex.engine.kernels.triton.lora import StackedLoRAWeights
    from loraplex.engine.kernels.triton.paged_attention import triton_paged_attention

    t = create_backend("triton", cpu, torch.float32)
    assert (t.write_kv, t.paged_attention, t.lora_backend) == (triton_write_kv, triton_paged_attention,
                                                               StackedLoRAWeights)
    meta = t.build_metadata(SEQS, 16)
    assert type(meta) is RaggedAttentionMetadata and meta.query_start_loc.tolist() == [0, 1, 2, 8, 11]
    assert meta.num_decodes == 2 and meta.slot_mapping.tolist() == [52, 84, 16, 17, 18, 19, 20, 21, 64, 65, 66]


def test_registry_names_every_selectable_backend():
    assert set(REGISTRY) == {"torch", "cpu", "triton"}
    with pytest.raises(ValueError, match="unknown kernel backend"):
        create_backend("cuda", torch.device("cpu"), torch.float32)
