"""The adapter store: validate first, publish atomically, keep old versions loadable."""
from __future__ import annotations

import os
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.adapters import (
    AdapterError,
    AdapterNotFoundError,
    AdapterStore,
    AdapterValidationError,
    BaseShapes,
    InvalidAdapterNameError,
    load_peft_adapter,
)


@pytest.fixture(scope="module")
def lora_v2(make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=2)


@pytest.fixture
def store(tmp_path: Path, base: BaseShapes) -> AdapterStore:
    return AdapterStore(tmp_path / "store", base)


def snapshot(store: AdapterStore) -> dict[str, Any]:
    """Everything a reader could see, plus leftovers a failed add must not leave."""
    root = store.root
    index = root / "index.json"
    return {
        "list": store.list(),
        "index": index.read_bytes() if index.exists() else None,
        "blobs": sorted(p.name for p in (root / "blobs").iterdir()),
        "tmp": sorted(p.name for p in (root / "tmp").iterdir()),
        "root": sorted(p.name for p in root.iterdir()),
    }


def make_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def adapter_members(folder: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + n: (folder / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}


# ---- adding and reading -------------------------------------------------------------------


def test_add_get_list_load(store: AdapterStore, lora_dir: Path, base: BaseShapes) -> None:
    record = store.add("support-bot", lora_dir)
    direct = load_peft_adapter(lora_dir, base)
    assert record.name == "support-bot" and record.digest == direct.digest
    assert (record.rank, record.alpha, record.target_modules) == (8, 16.0, direct.target_modules)
    on_disk = [lora_dir / "adapter_config.json", lora_dir / "adapter_model.safetensors"]
    assert record.size_bytes == sum(p.stat().st_size for p in on_disk)
    assert store.get("support-bot") == record and store.list() == [record]
    loaded = store.load("support-bot")
    assert loaded.digest == record.digest
    assert torch.equal(loaded.weights[(1, "gate_proj")].a, direct.weights[(1, "gate_proj")].a)
    blob = store.path_of(record.digest)
    # Only the two canonical files are kept (not PEFT's README.md), with the resolved targets.
    assert sorted(p.name for p in blob.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "loraplex_targets.json"]


def test_another_store_on_the_same_root_sees_the_adapter(
    store: AdapterStore, lora_dir: Path, base: BaseShapes
) -> None:
    record = store.add("a", lora_dir)
    assert AdapterStore(store.root, base).get("a") == record


def test_unknown_names_and_digests(store: AdapterStore) -> None:
    with pytest.raises(AdapterNotFoundError):
        store.get("nope")
    with pytest.raises(AdapterNotFoundError):
        store.load("nope")
    with pytest.raises(AdapterNotFoundError):
        store.load("sha256:" + "0" * 64)
    with pytest.raises(AdapterNotFoundError):
        store.path_of("sha256:not-hex")


@pytest.mark.parametrize("name", ["", ".", "..", "-lead", ".hidden", "a/b", "a b", "x" * 65, "sha256:ab", "naïve"])
def test_invalid_names(store: AdapterStore, lora_dir: Path, name: str) -> None:
    with pytest.raises(InvalidAdapterNameError):
        store.add(name, lora_dir)
    assert store.list() == []


@pytest.mark.parametrize("name", ["a", "A.b_c-1", "x" * 64, "9lives"])
def test_valid_names(store: AdapterStore, lora_dir: Path, name: str) -> None:
    assert store.add(name, lora_dir).name == name


def test_existing_name_needs_replace(store: AdapterStore, lora_dir: Path, lora_v2: Path) -> None:
    store.add("a", lora_dir)
    with pytest.raises(AdapterError, match="already exists"):
        store.add("a", lora_v2)
    assert store.get("a").rank == 8


def test_invalid_adapter_changes_nothing(store: AdapterStore, lora_dir: Path, lora_copy: Path, files: Any) -> None:
    store.add("good", lora_dir)
    before = snapshot(store)
    files.write_config(lora_copy, use_dora=True)
    with pytest.raises(AdapterValidationError, match="missing lora_magnitude_vector"):
        store.add("bad", lora_copy)
    assert snapshot(store) == before


# ---- versions -------------------------------------------------------------------------------


def test_replace_keeps_the_old_version_loadable(store: AdapterStore, lora_dir: Path, lora_v2: Path) -> None:
    v1 = store.add("a", lora_dir)
    v2 = store.add("a", lora_v2, replace=True)
    assert v2.digest != v1.digest and store.get("a") == v2
    assert [r.digest for r in store.versions("a")] == [v2.digest, v1.digest]
    assert store.load("a").digest == v2.digest
    old = store.load(v1.digest)  # a request admitted before the replace still gets v1
    assert old.digest == v1.digest and old.rank == 8


def test_replace_with_identical_content_is_a_no_op(store: AdapterStore, lora_dir: Path) -> None:
    v1 = store.add("a", lora_dir)
    assert store.add("a", lora_dir, replace=True) == v1
    assert store.versions("a") == [v1]


def test_history_is_bounded(
    tmp_path: Path, base: BaseShapes, lora_dir: Path, lora_v2: Path, make_adapter: Callable[..., Path]
) -> None:
    store = AdapterStore(tmp_path / "s", base, keep_versions=1)
    v1 = store.add("a", lora_dir)
    v2 = store.add("a", lora_v2, replace=True)
    v3 = store.add("a", make_adapter(rank=2, target_modules=["o_proj"]), replace=True)
    assert [r.digest for r in store.versions("a")] == [v3.digest, v2.digest]
    # v1 fell out of history and nothing else uses it: its blob is gone.
    with pytest.raises(AdapterNotFoundError):
        store.path_of(v1.digest)
    # Re-adding v1's content republishes it.
    assert store.add("a", lora_dir, replace=True).digest == v1.digest
    assert store.load(v1.digest).rank == 8


def test_remove(store: AdapterStore, lora_dir: Path, lora_v2: Path) -> None:
    a = store.add("a", lora_dir)
    b = store.add("b", lora_dir)  # same content, shared blob
    store.add("a", lora_v2, replace=True)
    store.remove("a")
    with pytest.raises(AdapterNotFoundError):
        store.get("a")
    assert store.load(b.digest).digest == a.digest  # still used by "b"
    store.remove("b")
    assert store.list() == [] and list((store.root / "blobs").iterdir()) == []
    with pytest.raises(AdapterNotFoundError):
        store.remove("b")


def test_corrupted_blob_is_detected(store: AdapterStore, lora_dir: Path, files: Any) -> None:
    record = store.add("a", lora_dir)
    blob = store.path_of(record.digest)
    tensors = files.read_tensors(blob)
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    tensors[name][0, 0] += 1.0
    files.write_tensors(blob, tensors)
    with pytest.raises(AdapterError, match="corrupted"):
        store.load("a")


# ---- atomic publish ---------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["rename", "replace"])
def test_failure_mid_add_leaves_no_trace(
    store: AdapterStore, lora_dir: Path, lora_v2: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    v1 = store.add("a", lora_dir)
    before = snapshot(store)
    calls = []

    def crash(*args: Any) -> None:
        calls.append(args)
        raise OSError("simulated crash")

    monkeypatch.setattr(os, failing, crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.add("a", lora_v2, replace=True)
    with pytest.raises(OSError, match="simulated crash"):
        store.add("b", lora_v2)
    monkeypatch.undo()
    assert calls, f"os.{failing} was never reached"
    assert snapshot(store) == before
    assert store.get("a") == v1 and store.load("a").digest == v1.digest
    # And the store still works afterwards.
    assert store.add("b", lora_v2).rank == 4


def test_gc_removes_orphaned_blobs(store: AdapterStore, lora_dir: Path) -> None:
    record = store.add("a", lora_dir)
    # What a crash between publishing a blob and swapping the index leaves behind.
    orphan = store.root / "blobs" / ("f" * 64)
    orphan.mkdir()
    (orphan / "adapter_config.json").write_text("{}")
    store.gc()
    assert not orphan.exists()
    assert store.path_of(record.digest).is_dir()


def test_corrupted_index_is_an_error_not_an_empty_store(store: AdapterStore, lora_dir: Path) -> None:
    store.add("a", lora_dir)
    (store.root / "index.json").write_text('{"format": 1, "adap')
    with pytest.raises(AdapterError, match="corrupted"):
        store.list()


# ---- zip uploads ------------------------------------------------------------------------------


def test_zip_flat_and_in_a_top_folder(store: AdapterStore, tmp_path: Path, lora_dir: Path) -> None:
    flat = make_zip(tmp_path / "flat.zip", adapter_members(lora_dir))
    nested = make_zip(tmp_path / "nested.zip", {**adapter_members(lora_dir, "my-lora/"), "__MACOSX/._x": b""})
    expected = store.add("folder", lora_dir).digest
    assert store.add("flat", flat).digest == expected
    assert store.add("nested", nested).digest == expected


@pytest.mark.parametrize(
    ("member", "message"),
    [
        ("../evil.txt", "escapes the archive"),
        ("sub/../../evil.txt", "escapes the archive"),
        ("..\\evil.txt", "escapes the archive"),
        ("/etc/evil.txt", "absolute path"),
        ("C:/evil.txt", "absolute path"),
    ],
)
def test_zip_slip_is_refused(
    store: AdapterStore, tmp_path: Path, lora_dir: Path, member: str, message: str
) -> None:
    before = snapshot(store)
    bad = make_zip(tmp_path / "bad.zip", {**adapter_members(lora_dir), member: b"pwned"})
    with pytest.raises(AdapterValidationError, match=message):
        store.add("a", bad)
    assert snapshot(store) == before
    assert not (tmp_path / "evil.txt").exists() and not (store.root / "evil.txt").exists()


def test_zip_symlink_is_refused(store: AdapterStore, tmp_path: Path, lora_dir: Path) -> None:
    path = make_zip(tmp_path / "link.zip", adapter_members(lora_dir))
    with zipfile.ZipFile(path, "a") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(AdapterValidationError, match="symbolic link"):
        store.add("a", path)


def test_zip_member_over_the_size_cap(tmp_path: Path, base: BaseShapes, lora_dir: Path) -> None:
    store = AdapterStore(tmp_path / "s", base, max_file_bytes=64 * 1024)
    weights = (lora_dir / "adapter_model.safetensors").stat().st_size
    assert weights > 64 * 1024
    path = make_zip(tmp_path / "big.zip", adapter_members(lora_dir))
    with pytest.raises(AdapterValidationError, match="over the 65536 byte limit"):
        store.add("a", path)
    assert snapshot(store)["tmp"] == []


def test_zip_with_only_a_pickle(store: AdapterStore, tmp_path: Path, lora_dir: Path) -> None:
    members = {"adapter_config.json": (lora_dir / "adapter_config.json").read_bytes(), "adapter_model.bin": b"x"}
    with pytest.raises(AdapterValidationError, match="adapter_model.bin is a pickled checkpoint"):
        store.add("a", make_zip(tmp_path / "p.zip", members))


def test_source_that_is_neither_folder_nor_zip(store: AdapterStore, tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(AdapterValidationError, match="neither a PEFT adapter folder nor a .zip"):
        store.add("a", tmp_path / "x.txt")
    with pytest.raises(AdapterValidationError, match="does not exist"):
        store.add("a", tmp_path / "missing")
