"""Which device the engine runs on: `--device auto|cpu|cuda|cuda:N` resolved against what
torch sees. Apart from the config dataclasses, so the scheduler (which imports the
config) never imports torch."""
from __future__ import annotations

import re

from ..errors import EngineError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class DeviceUnavailableError(EngineError, ValueError):
    """`--device` names a device this machine does not have, or is not a device at all."""


def resolve_device(spec: str) -> str:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> the torch device the engine runs on: auto is
    the first CUDA device when torch sees one, else the CPU."""
    import torch

    spec = spec.strip().lower()
    if not _DEVICE_RE.match(spec):
        raise DeviceUnavailableError(f"unknown device {spec!r}: use {DEVICE_CHOICES}")
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return spec
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA GPU"
        raise DeviceUnavailableError(f"device {spec!r} asked for, but {why}: install the CUDA torch wheel "
                                     f"(see the README, On a GPU) or use --device cpu")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailableError(f"device {spec!r} asked for, but torch sees {count} CUDA GPU(s) "
                                     f"(cuda:0..cuda:{count - 1})")
    return spec
