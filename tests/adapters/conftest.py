"""Fixtures for adapter tests: a tiny random Llama on disk and real PEFT adapters for it."""
from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import BaseShapes
from loraplex.adapters.synth import make_random_peft_adapter

torch.set_num_threads(1)

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def base(base_dir: Path) -> BaseShapes:
    return BaseShapes.from_model_dir(base_dir)


@pytest.fixture(scope="session")
def make_adapter(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_adapter(**synth kwargs) -> a fresh PEFT folder written by real PEFT."""

    def make(**kwargs: Any) -> Path:
        out = tmp_path_factory.mktemp("lora")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_random_peft_adapter(base_dir, out, **kwargs)

    return make


@pytest.fixture(scope="session")
def lora_dir(make_adapter: Callable[..., Path]) -> Path:
    """Rank 8 on all seven projections. Shared: tests that change files must copy it."""
    return make_adapter(rank=8, alpha=16, seed=1)


@pytest.fixture
def lora_copy(lora_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "lora-copy"
    shutil.copytree(lora_dir, dst)
    return dst


class AdapterFiles:
    """Read and rewrite the two files of a PEFT folder (tests make malformed adapters)."""

    @staticmethod
    def read_config(folder: Path) -> dict[str, Any]:
        return json.loads((folder / CONFIG).read_text())

    @staticmethod
    def write_config(folder: Path, **changes: Any) -> None:
        config = AdapterFiles.read_config(folder)
        config.update(changes)
        (folder / CONFIG).write_text(json.dumps(config))

    @staticmethod
    def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
        return load_file(folder / WEIGHTS)

    @staticmethod
    def write_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / WEIGHTS, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def files() -> type[AdapterFiles]:
    return AdapterFiles
