"""First-start conveniences for `loraplex serve`: the demo tenant and the demo adapters."""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from loraplex.adapters import AdapterError, AdapterStore, BlobStore
from loraplex.engine.config import DEFAULT_MODEL

from loraplex.platform.tenancy.adapter_registry import AdapterInfo, add_adapter, list_adapters
from loraplex.platform.db.database import Database
from loraplex.platform.errors import NotFoundError, PlatformError
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.tenants import create_key, create_tenant, get_tenant

log = logging.getLogger(__name__)
DEMO_TENANT = "demo"
DEMO_ADAPTERS_ENV = "LORAPLEX_DEMO_ADAPTERS"


def ensure_demo_tenant(db: Database) -> str | None:
    """Create tenant `demo` with one key on first start; returns that key (shown once) or
    None when the tenant already exists."""
    try:
        with db.session() as s:
            get_tenant(s, DEMO_TENANT)
        return None
    except NotFoundError:
        pass
    create_tenant(db, DEMO_TENANT, "standard")
    return create_key(db, DEMO_TENANT, name="demo key (printed at first start)")


def find_demo_adapters(settings: Settings) -> dict[str, Path]:
    """HOOK: the demo adapters `serve` registers on start, name -> PEFT folder.

    $LORAPLEX_DEMO_ADAPTERS (a folder with one adapter per sub-folder) wins. Otherwise,
    for the default model only: `demo_adapters/` beside the loraplex packages if it
    exists, else `loraplex.adapters.demo.ensure_demo_adapters` (trains them once per
    machine, about a minute; needs peft), when that module is available.
    """
    env = os.environ.get(DEMO_ADAPTERS_ENV)
    if env:
        return _subfolders(Path(env).expanduser())
    if settings.engine.model.model != DEFAULT_MODEL:
        return {}
    shipped = _subfolders(Path(__file__).resolve().parents[2] / "demo_adapters")
    if shipped or importlib.util.find_spec("loraplex.adapters.demo") is None:
        return shipped
    from loraplex.adapters import demo
    from loraplex.engine.checkpoint import resolve_model_dir

    log.info("preparing the demo adapters (trained once per machine, about a minute)...")
    try:
        return dict(demo.ensure_demo_adapters(resolve_model_dir(DEFAULT_MODEL)))
    except ImportError as exc:  # peft/transformers training extras not installed
        log.warning("demo adapters skipped: %s (pip install 'loraplex[test]' to train them)", exc)
    except Exception as exc:  # noqa: BLE001 - a demo convenience must not stop the server
        log.warning("demo adapters skipped: %s", exc)
    return {}


def _subfolders(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "adapter_config.json").is_file()}


def register_demo_adapters(settings: Settings, db: Database, store: AdapterStore,
                           blobs: BlobStore | None = None) -> list[str]:
    """Register every demo adapter not yet registered, as public; with `blobs` (the shared
    adapter store), published there for the other replicas."""
    folders = find_demo_adapters(settings)
    known = {a.name for a in list_adapters(db)}
    added = []
    for name, path in folders.items():
        if name in known:
            continue
        try:
            add_adapter(db, store, name, path, public=True, reserved=(settings.model_name,), blobs=blobs)
            added.append(name)
        except (AdapterError, PlatformError) as exc:
            log.warning("demo adapter %s skipped: %s", name, getattr(exc, "reason", exc))
    return added


def register_cli_adapters(settings: Settings, db: Database, store: AdapterStore,
                          blobs: BlobStore | None = None) -> list[AdapterInfo]:
    """`serve --adapter NAME=PATH`: register as public, or update a known adapter to a new
    version keeping who may use it (a restart never undoes an admin's decision); with
    `blobs` (the shared adapter store), published there for the other replicas."""
    known = {a.name for a in list_adapters(db)}
    return [add_adapter(db, store, name, path, public=name not in known, replace=name in known,
                        reserved=(settings.model_name,), blobs=blobs)
            for name, path in settings.adapters]
