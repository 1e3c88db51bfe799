"""Backend selection: Triton on CUDA, torch elsewhere, a setting forces either."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.attention import paged_attention, write_kv
from loraplex.engine.kernels.select import attention_ops, select_backend


@pytest.mark.parametrize("library", ["cpu_decode", "cpu_prefill", "cpu_fused", "cpu_lora"])
def test_auto_on_cpu_is_the_c_kernel_where_it_builds(monkeypatch, library):
    # The "cpu" backend calls each of these without another check: any one missing means torch.
    import importlib

    module = importlib.import_module(f"loraplex.engine.kernels.{library}")
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
    from loraplex.engine.kernels import cpu_decode

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


def test_attention_ops():
    from loraplex.engine.kernels.cpu_decode import cpu_paged_attention

    assert attention_ops("torch") == (write_kv, paged_attention)
    from loraplex.engine.kernels.cpu_fused import cpu_write_kv

    assert attention_ops("cpu") == (cpu_write_kv, cpu_paged_attention)
    pytest.importorskip("triton")
    from loraplex.engine.kernels.kv_write import triton_write_kv
    from loraplex.engine.kernels.paged_attention import triton_paged_attention

    assert attention_ops("triton") == (triton_write_kv, triton_paged_attention)
