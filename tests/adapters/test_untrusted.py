"""Adapters from strangers: zip bombs, extra members, oversized or forged weights, and
catastrophic regular expressions are refused with a typed error and leave nothing behind."""
from __future__ import annotations

import json
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.adapters import LORA_MODULES, AdapterStore, AdapterValidationError, BaseShapes, load_peft_adapter
from loraplex.adapters.errors import AdapterArchiveError, AdapterPatternTimeoutError, AdapterTooLargeError
from loraplex.adapters.limits import max_adapter_bytes, max_header_bytes
from loraplex.adapters.peft import TARGETS_NAME

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
CATASTROPHIC = r"(.|\w)+(?<=x)"  # overlapping alternatives: 2**len(name) paths before failing


@pytest.fixture
def store(tmp_path: Path, base: BaseShapes) -> AdapterStore:
    return AdapterStore(tmp_path / "store", base, max_rank=8)


def leftovers(store: AdapterStore) -> list[str]:
    return sorted(p.name for p in (store.root / "tmp").iterdir())


def zeros_deflate(n_mib: int) -> bytes:
    """Raw deflate of `n_mib` MiB of zeros, built from one compressed MiB repeated: after a
    full flush the compressor starts afresh, so every MiB compresses to the same bytes."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return block * n_mib + c.flush()


def write_raw_zip(path: Path, members: list[tuple[str, bytes, int, int]]) -> Path:
    """A zip of pre-deflated members (name, deflate data, declared size, crc), written by
    hand so that a GB-sized member never exists uncompressed, not even while writing."""
    local, central = bytearray(), bytearray()
    for name, data, size, crc in members:
        offset, raw = len(local), name.encode()
        local += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, len(data), size, len(raw), 0)
        local += raw + data
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc, len(data), size, len(raw), 0, 0, 0, 0, 0,
            offset,
        )
        central += raw
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end))
    return path


def deflated(data: bytes) -> tuple[bytes, int, int]:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(), len(data), zlib.crc32(data)


# ---- zip bombs and archive shapes -----------------------------------------------------------


def test_zip_bomb_declaring_its_size_is_refused_before_inflating(
    store: AdapterStore, tmp_path: Path, lora_dir: Path
) -> None:
    bomb = zeros_deflate(3900)  # 3.9 GiB of zeros
    assert len(bomb) < 8 << 20
    path = write_raw_zip(tmp_path / "bomb.zip", [
        (CONFIG, *deflated((lora_dir / CONFIG).read_bytes())),
        (WEIGHTS, bomb, 3900 << 20, 0),
    ])
    with pytest.raises(AdapterTooLargeError, match=f"is {3900 << 20} bytes, over the {store.max_file_bytes} byte"):
        store.add("a", path)
    assert leftovers(store) == [] and store.list() == []


def test_zip_bomb_lying_about_its_size_stops_at_the_declared_size(
    store: AdapterStore, tmp_path: Path, lora_dir: Path
) -> None:
    weights = (lora_dir / WEIGHTS).read_bytes()
    path = write_raw_zip(tmp_path / "liar.zip", [
        (CONFIG, *deflated((lora_dir / CONFIG).read_bytes())),
        (WEIGHTS, zeros_deflate(3900), len(weights), zlib.crc32(weights)),
    ])
    # The inflater stops at the declared size, where the checksum exposes the lie.
    with pytest.raises(AdapterArchiveError, match="not a valid zip archive"):
        store.add("a", path)
    assert leftovers(store) == []


def test_extra_members_are_never_extracted(store: AdapterStore, tmp_path: Path, lora_dir: Path) -> None:
    expected = load_peft_adapter(lora_dir, store.base).digest
    path = write_raw_zip(tmp_path / "extras.zip", [
        ("my-lora/README.md", *deflated(b"# a model card")),
        ("my-lora/" + CONFIG, *deflated((lora_dir / CONFIG).read_bytes())),
        ("my-lora/" + WEIGHTS, *deflated((lora_dir / WEIGHTS).read_bytes())),
        ("my-lora/adapter_model.bin", *deflated(b"a pickle, never opened")),
        ("my-lora/junk.bin", zeros_deflate(3900), 3900 << 20, 0),  # a bomb nobody inflates
    ])
    record = store.add("a", path)
    assert record.digest == expected
    assert sorted(p.name for p in store.path_of(record.digest).iterdir()) == [CONFIG, WEIGHTS, TARGETS_NAME]
    assert leftovers(store) == []


def test_zip_with_two_adapters_is_refused(store: AdapterStore, tmp_path: Path, lora_dir: Path) -> None:
    members = {f"{d}/{n}": (lora_dir / n).read_bytes() for d in ("one", "two") for n in (CONFIG, WEIGHTS)}
    with zipfile.ZipFile(tmp_path / "two.zip", "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    with pytest.raises(AdapterArchiveError, match=r"more than one adapter \(one, two\)"):
        store.add("a", tmp_path / "two.zip")


# ---- the size bound ---------------------------------------------------------------------------


def test_bound_is_exactly_a_full_rank_adapter(base: BaseShapes, lora_dir: Path) -> None:
    """lora_dir is rank 8 on every projection in float32: its tensors, with one vector per
    projection (a DoRA magnitude or a lora_B bias), a saved embedding and lm_head and every
    norm, fill the bound exactly."""
    vectors = sum(base.module_dims(m)[1] for m in LORA_MODULES) * base.num_layers * 4
    saved = (2 * base.vocab_size + 2 * base.num_layers + 1) * base.hidden_size * 4
    tensor_bytes = load_peft_adapter(lora_dir, base).size_bytes + vectors + saved
    assert max_adapter_bytes(base, 8) == 8 + max_header_bytes(base) + tensor_bytes
    assert max_adapter_bytes(base, 8, torch.bfloat16) == 8 + max_header_bytes(base) + tensor_bytes // 2
    assert (lora_dir / WEIGHTS).stat().st_size <= max_adapter_bytes(base, 8)


@pytest.mark.parametrize("as_zip", [False, True])
def test_weights_over_the_bound_are_refused_unread(
    store: AdapterStore, tmp_path: Path, lora_copy: Path, files: Any, as_zip: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors["padding"] = torch.zeros(store.max_file_bytes // 4 + 1)
    files.write_tensors(lora_copy, tensors)
    source = lora_copy
    if as_zip:
        source = tmp_path / "big.zip"
        with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as zf:
            for n in (CONFIG, WEIGHTS):
                zf.write(lora_copy / n, n)
    refuse_tensor_loads(monkeypatch)
    with pytest.raises(AdapterTooLargeError, match=f"over the {store.max_file_bytes} byte limit"):
        store.add("a", source)
    assert leftovers(store) == []


# ---- forged safetensors headers ---------------------------------------------------------------


def refuse_tensor_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any tensor is loaded: refusals must come from the header alone."""
    import loraplex.adapters.peft as peft

    def loaded(path: Path) -> None:
        raise AssertionError(f"tensors of {path} were loaded before the header was checked")

    monkeypatch.setattr(peft, "_read_safetensors", loaded)


def forge(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the header of folder's safetensors with `edit`, keeping its data section."""
    path = folder / WEIGHTS
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n :])


A0Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _shape(h: dict[str, Any]) -> None:
    h[A0Q]["shape"] = [16, 32]  # same byte count as [8, 64]


def _dtype(h: dict[str, Any]) -> None:
    h[A0Q]["dtype"] = "I32"  # same item size as F32


def _name(h: dict[str, Any]) -> None:
    h["base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"] = h.pop(A0Q)


def _range(h: dict[str, Any]) -> None:
    h[A0Q]["data_offsets"] = [0, 4]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_shape, f"tensor {A0Q} has shape [16, 32], expected [8, 64]"),
        (_dtype, f"tensor {A0Q} has dtype I32; LoRA weights must be floating point"),
        (_name, "unexpected tensor base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"),
        (_range, "byte range does not match its shape"),
    ],
)
def test_forged_header_is_refused_before_any_tensor_loads(
    lora_copy: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch,
    edit: Callable[[dict[str, Any]], None], message: str,
) -> None:
    forge(lora_copy, edit)
    refuse_tensor_loads(monkeypatch)
    with pytest.raises(AdapterValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_peft_adapter(lora_copy, base)


@pytest.mark.parametrize("length", [1 << 62, max_header_bytes(BaseShapes(2, 64, 128, 64, 32)) + 1])
def test_huge_header_length_is_refused_unread(
    lora_copy: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    path = lora_copy / WEIGHTS
    path.write_bytes(length.to_bytes(8, "little") + path.read_bytes()[8:])
    refuse_tensor_loads(monkeypatch)
    with pytest.raises(AdapterTooLargeError, match=f"declares a {length} byte header"):
        load_peft_adapter(lora_copy, base)


def test_header_running_past_the_file_is_refused(lora_copy: Path, base: BaseShapes) -> None:
    path = lora_copy / WEIGHTS
    path.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(AdapterValidationError, match="runs past the end of the file"):
        load_peft_adapter(lora_copy, base)


# ---- regular expressions --------------------------------------------------------------------


def test_catastrophic_target_regex_is_refused_naming_it(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, target_modules=CATASTROPHIC)
    with pytest.raises(AdapterPatternTimeoutError) as info:
        load_peft_adapter(lora_copy, base)
    assert info.value.pattern == CATASTROPHIC and info.value.field == "target_modules"
    assert f"target_modules pattern {CATASTROPHIC!r} took more than" in info.value.reason


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_catastrophic_pattern_keys_are_refused(lora_copy: Path, base: BaseShapes, files: Any, field: str) -> None:
    files.write_config(lora_copy, **{field: {CATASTROPHIC: 4}})
    with pytest.raises(AdapterPatternTimeoutError, match=field):
        load_peft_adapter(lora_copy, base)


def test_resolved_targets_are_stored_and_loads_never_match_again(
    store: AdapterStore, make_adapter: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    lora = make_adapter(rank=4, alpha=8, target_modules=r".*\.(k_proj|up_proj)",
                        lora_config={"rank_pattern": {"up_proj": 2}})
    record = store.add("regex", lora)
    stored = json.loads((store.path_of(record.digest) / TARGETS_NAME).read_text())
    assert stored["targets"] == [[i, m, 2 if m == "up_proj" else 4, 8.0] for i in (0, 1) for m in ("k_proj", "up_proj")]
    fresh = store.load("regex")

    import loraplex.adapters.peft_config as peft_config

    class NoMatching:
        def __init__(self, *args: object) -> None:
            raise AssertionError("a stored adapter ran its config's patterns again")

    monkeypatch.setattr(peft_config, "PatternMatcher", NoMatching)
    again = store.load("regex")
    assert again.digest == fresh.digest == record.digest
    for key, w in fresh.weights.items():
        assert torch.equal(again.weights[key].a, w.a) and again.weights[key].scale == w.scale
    with pytest.raises(AssertionError, match="ran its config's patterns"):
        load_peft_adapter(lora, store.base)  # a folder that was never validated still resolves


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"(a{10000}){10000}", "repeats too much"),  # compiling alone would take minutes
        ("(" * 300 + "q_proj" + ")*" * 300, "not a valid regular expression"),  # nests past the stack
        ("q_proj|" * 200, "characters long; at most 1024"),
    ],
)
def test_patterns_too_costly_to_compile_are_refused(
    lora_copy: Path, base: BaseShapes, files: Any, pattern: str, message: str
) -> None:
    files.write_config(lora_copy, target_modules=pattern)
    with pytest.raises(AdapterValidationError, match=re.escape(message)) as info:
        load_peft_adapter(lora_copy, base)
    assert "target_modules pattern" in info.value.reason
