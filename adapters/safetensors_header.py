"""Read and check a safetensors file's JSON header without loading any tensor.

The header is `u64 little-endian length` + that many bytes of JSON mapping each tensor name
to its dtype, shape and byte range. Reading only it lets names, shapes and dtypes be checked
against what the base model allows before a single weight is read into memory.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import AdapterTooLargeError, AdapterValidationError

WEIGHTS_NAME = "adapter_model.safetensors"
# safetensors dtype codes of the floating types LoRA weights may use, with their sizes.
FLOAT_DTYPES: dict[str, int] = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_ITEMSIZE: dict[str, int] = {
    **FLOAT_DTYPES, "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
    "I32": 4, "U32": 4, "I64": 8, "U64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # a safetensors dtype code: "F32", "BF16", ...
    shape: tuple[int, ...]


def read_header(path: Path, max_header_bytes: int) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape; refuses headers over `max_header_bytes` or inconsistent
    with the file (overlapping or out-of-file byte ranges, sizes that disagree with shapes)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _invalid("it is shorter than its 8-byte header length")
        n = int.from_bytes(prefix, "little")
        if n > max_header_bytes:
            raise AdapterTooLargeError(
                f"{WEIGHTS_NAME} declares a {n} byte header; an adapter for this base model needs at most "
                f"{max_header_bytes}"
            )
        if n > size - 8:
            raise _invalid(f"its {n} byte header runs past the end of the file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _invalid(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _invalid("its header is not a JSON object")
    header.pop("__metadata__", None)
    tensors = {name: _entry(name, e) for name, e in header.items()}
    _check_ranges(header, size - 8 - n)
    return tensors


def _entry(name: str, e: object) -> TensorInfo:
    if not isinstance(e, dict):
        raise _invalid(f"header entry {name!r} is not an object")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise _invalid(f"tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _invalid(f"tensor {name} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise _invalid(f"tensor {name} has malformed data_offsets {offsets!r}")
    if offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]:
        raise _invalid(f"tensor {name}'s byte range does not match its shape {shape} and dtype {dtype}")
    return TensorInfo(dtype=dtype, shape=tuple(shape))


def _check_ranges(header: dict[str, dict], data_bytes: int) -> None:
    # safetensors requires the ranges to tile the data section exactly, in some order.
    end = 0
    for begin, stop in sorted(tuple(e["data_offsets"]) for e in header.values()):
        if begin != end:
            raise _invalid("its tensors' byte ranges overlap or leave gaps")
        end = stop
    if end != data_bytes:
        raise _invalid(f"its tensors hold {end} bytes but the file has {data_bytes} bytes of data")


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _invalid(why: str) -> AdapterValidationError:
    return AdapterValidationError(f"{WEIGHTS_NAME} is not a valid safetensors file: {why}")
