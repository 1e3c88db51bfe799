"""`serve --adapter NAME=PATH` at every start: new adapters become public, known ones get
the new version and keep the access an admin gave them."""
from __future__ import annotations

from loraplex.adapters.blobs import LocalBlobStore
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.platform.cli.demo import register_cli_adapters
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.adapter_registry import list_adapters, open_store, set_adapter_access


def test_a_restart_keeps_an_admins_decision(db, tmp_path, tiny_llama_dir, tiny_adapters):
    settings = Settings(data_dir=tmp_path, engine=EngineConfig(model=ModelConfig(model=str(tiny_llama_dir))),
                        adapters=(("helper", str(tiny_adapters["ad1"])),))
    store = open_store(settings)
    [first] = register_cli_adapters(settings, db, store)
    assert first.public
    set_adapter_access(db, "helper", public=False)  # what an admin does in the UI
    [again] = register_cli_adapters(settings, db, store)  # the next `serve` start
    assert not again.public and again.digest == first.digest
    moved = Settings(data_dir=tmp_path, engine=settings.engine, adapters=(("helper", str(tiny_adapters["ad2"])),))
    [updated] = register_cli_adapters(moved, db, store)  # a new version from the command line
    assert not updated.public and updated.digest != first.digest
    assert [a.public for a in list_adapters(db)] == [False]


def test_replicas_sharing_a_store_find_the_versions_published_there(db, tmp_path, tiny_llama_dir, tiny_adapters):
    """With a shared adapter store, an adapter from one replica's command line is published
    there, where the other replicas fetch it by the digest the registry names."""
    settings = Settings(data_dir=tmp_path / "replica", engine=EngineConfig(model=ModelConfig(model=str(tiny_llama_dir))),
                        adapters=(("helper", str(tiny_adapters["ad1"])),))
    shared = LocalBlobStore(tmp_path / "shared")
    [info] = register_cli_adapters(settings, db, open_store(settings), shared)
    assert shared.exists(info.digest)


def test_serve_takes_the_shared_adapter_store_from_its_command_line(tmp_path, tiny_llama_dir):
    import subprocess
    import sys

    from loraplex.platform.cli.main import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", "--adapter-store", str(tmp_path / "shared")])
    assert settings_from_args(args).adapter_store == str(tmp_path / "shared")
    proc = subprocess.run([sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "serve",
                           "--model", str(tiny_llama_dir), "--data-dir", str(tmp_path), "--no-demo",
                           "--adapter-store", "ftp://example.invalid/x"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "unsupported adapter store URL 'ftp://example.invalid/x'" in proc.stderr


def test_serve_bounds_the_cache_of_versions_fetched_from_the_shared_store(db, tmp_path, tiny_llama_dir):
    from loraplex.adapters.blobs import CachedBlobStore
    from loraplex.platform.cli.main import build_parser, settings_from_args
    from loraplex.platform.db import migrate
    from loraplex.platform.settings import DEFAULT_ADAPTER_CACHE_BYTES
    from loraplex.platform.tenancy.adapter_registry import shared_blob_store

    def settings(*argv: str) -> Settings:
        return settings_from_args(build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *argv]))

    assert settings().adapter_cache_max_bytes == DEFAULT_ADAPTER_CACHE_BYTES
    assert settings("--adapter-cache-size", "none").adapter_cache_max_bytes is None
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    migrate(shared)
    blobs = shared_blob_store(settings("--adapter-store", shared, "--adapter-cache-size", "3GiB"), db)
    try:
        assert isinstance(blobs, CachedBlobStore)
        assert blobs.cache.max_bytes == 3 * 2**30 and blobs.cache_dir == tmp_path / "blob-cache"
    finally:
        blobs.engine.dispose()


def test_vllms_lora_modules_spelling_beside_adapter(tmp_path, tiny_llama_dir):
    import json

    import pytest

    from loraplex.platform.cli.main import build_parser, settings_from_args

    def settings(*argv: str) -> Settings:
        return settings_from_args(build_parser().parse_args(
            ["serve", "--data-dir", str(tmp_path), "--model", str(tiny_llama_dir), *argv]))

    doc = json.dumps({"name": "sql", "path": "/p/sql", "base_model_name": tiny_llama_dir.name})
    s = settings("--adapter", "a=/p/a", "--lora-modules", "b=/p/b", doc, "--lora-modules", "c=/p/c")
    assert s.adapters == (("a", "/p/a"), ("b", "/p/b"), ("sql", "/p/sql"), ("c", "/p/c"))
    named = json.dumps({"name": "x", "path": "/p/x", "base_model_name": "served"})
    assert settings("--served-model-name", "served", "--lora-modules", named).adapters == (("x", "/p/x"),)
    with pytest.raises(ValueError, match="base_model_name 'other' is not the model served here"):
        settings("--lora-modules", json.dumps({"name": "x", "path": "/p", "base_model_name": "other"}))
    with pytest.raises(ValueError, match="'a' is given twice"):
        settings("--adapter", "a=/p/a", "--lora-modules", "a=/p/b")
    for bad in ("noequals", '{"name": "x"}', '{"name": "x", "path": "/p", "extra": 1}', "{not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--lora-modules", bad])


def test_inference_objectives_from_the_command_line(tmp_path):
    import pytest

    from loraplex.platform.cli.main import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--inference-objective", "premium=100",
                                      "--inference-objective", "reports=batch"])
    assert settings_from_args(args).inference_objectives == (("premium", "100"), ("reports", "batch"))
    for bad in ("premium", "premium=urgent", "=batch"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--inference-objective", bad])
