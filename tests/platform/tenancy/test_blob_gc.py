"""Collecting shared-store blobs no adapter names: a folder store and the database's own
`adapter_blobs` (SQLite and PostgreSQL), through the registry and `loraplex adapter gc`."""
from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.blobs import BlobStoreConfig, open_blob_store
from loraplex.platform.tenancy.adapter_registry import add_adapter, remove_adapter
from loraplex.platform.tenancy.blob_gc import collect_blobs
from tests.platform.fixtures import run_cli

T0 = 1_800_000_000.0
GRACE = 600.0


@pytest.fixture(params=["folder", "database"])
def shared(request, tmp_path: Path, db):
    """(the shared store's URL, the store) on the folder or in the platform's database."""
    url = str(tmp_path / "shared") if request.param == "folder" else db.url
    store = open_blob_store(BlobStoreConfig(url, cache_dir=tmp_path / "cache"),
                            engine=db.engine if url == db.url else None)
    return url, store


def test_removed_and_replaced_versions_go_after_the_grace(tmp_path, tiny_llama_dir, tiny_adapters, db, shared):
    _url, blobs = shared
    local = AdapterStore(tmp_path / "local", BaseShapes.from_model_dir(tiny_llama_dir))
    v1 = add_adapter(db, local, "kept", tiny_adapters["ad1"], public=True, blobs=blobs).digest
    v2 = add_adapter(db, local, "kept", tiny_adapters["ad2"], replace=True, blobs=blobs).digest
    gone = add_adapter(db, local, "gone", tiny_adapters["ad3"], public=True, blobs=blobs).digest
    remove_adapter(db, local, "gone")
    assert blobs.digests() == {v1, v2, gone}

    first = collect_blobs(db, blobs, GRACE, now=T0)  # seen unreferenced: marked, not deleted
    assert sorted(first.marked) == sorted([v1, gone]) and first.deleted == [] and first.referenced == 1
    assert blobs.digests() == {v1, v2, gone}
    assert collect_blobs(db, blobs, GRACE, now=T0 + GRACE - 1).waiting == 2  # a worker may still fetch them
    # Published again inside the grace: named again, so unmarked and kept.
    add_adapter(db, local, "back", tiny_adapters["ad1"], public=True, blobs=blobs)
    later = collect_blobs(db, blobs, GRACE, now=T0 + GRACE)
    assert later.deleted == [gone] and blobs.digests() == {v1, v2} and blobs.marks() == {}
    assert collect_blobs(db, blobs, GRACE, now=T0 + 10 * GRACE).deleted == []


def test_a_publish_that_reused_a_collected_blob_puts_it_back(tmp_path, tiny_llama_dir, tiny_adapters, db, shared):
    """The race a pass cannot see: the publish found the blob stored (so did not put it),
    a pass deleted it, then the row committed. The publish checks after its commit."""
    _url, blobs = shared
    local = AdapterStore(tmp_path / "local", BaseShapes.from_model_dir(tiny_llama_dir))
    digest = add_adapter(db, local, "a", tiny_adapters["ad1"], public=True, blobs=blobs).digest
    real_put = blobs.put

    def put_then_collected(d, files, connection=None):
        real_put(d, files, connection=connection)
        blobs.put = real_put  # the repair's own put is a plain one
        blobs.delete(d)  # what a collection pass could do between the put and the commit

    blobs.put = put_then_collected
    add_adapter(db, local, "a", tiny_adapters["ad1"], replace=True, blobs=blobs)
    assert blobs.exists(digest) and blobs.get(digest).is_dir()


def test_the_cli_collects_in_two_runs(tmp_path, tiny_llama_dir, tiny_adapters, db, shared, capsys):
    url, blobs = shared
    local = AdapterStore(tmp_path / "local", BaseShapes.from_model_dir(tiny_llama_dir))
    digest = add_adapter(db, local, "a", tiny_adapters["ad1"], public=True, blobs=blobs).digest
    remove_adapter(db, local, "a")
    argv = ("adapter", "gc", "--adapter-store", url, "--database-url", db.url, "--data-dir", str(tmp_path / "d"))
    code, out, _ = run_cli(capsys, *argv, "--grace", "0")
    assert code == 0 and "0 deleted, 1 newly unreferenced" in out and blobs.exists(digest)
    code, out, _ = run_cli(capsys, *argv, "--grace", "0")
    assert code == 0 and "1 deleted" in out and not blobs.exists(digest)
    code, _, err = run_cli(capsys, "adapter", "gc", "--database-url", f"sqlite:///{tmp_path / 'other.db'}",
                           "--data-dir", str(tmp_path / "d"))
    assert code == 1 and "no shared adapter store" in err
