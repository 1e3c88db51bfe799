"""First-start conveniences for `loraplex serve`: the demo tenant and the demo adapters."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from loraplex.adapters import AdapterError, AdapterStore
from loraplex.engine.config import DEFAULT_MODEL

from .adapter_registry import AdapterInfo, add_adapter, list_adapters
from .db import Database
from .errors import NotFoundError, PlatformError
from .settings import Settings
from .tenants import create_key, create_tenant, get_tenant

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


def find_demo_adapters() -> Path | None:
    """The folder of demo adapters, one PEFT adapter per sub-folder, or None.

    Looked up in $LORAPLEX_DEMO_ADAPTERS, then `demo_adapters/` beside the loraplex
    packages (the repo root in a checkout, site-packages/loraplex when installed).
    HOOK: the trained SmolLM2 demo adapters go in that folder; nothing else changes.
    """
    env = os.environ.get(DEMO_ADAPTERS_ENV)
    candidates = [Path(env).expanduser()] if env else []
    candidates.append(Path(__file__).resolve().parent.parent / "demo_adapters")
    for path in candidates:
        if path.is_dir() and any((p / "adapter_config.json").is_file() for p in path.iterdir() if p.is_dir()):
            return path
    return None


def register_demo_adapters(settings: Settings, db: Database, store: AdapterStore) -> list[str]:
    """Register every demo adapter as public (the demo ones are made for the default model)."""
    folder = find_demo_adapters()
    if folder is None or settings.engine.model.model != DEFAULT_MODEL:
        return []
    known = {a.name: a for a in list_adapters(db)}
    added = []
    for sub in sorted(p for p in folder.iterdir() if (p / "adapter_config.json").is_file()):
        if sub.name in known:
            continue
        try:
            add_adapter(db, store, sub.name, sub, public=True, reserved=(settings.model_name,))
            added.append(sub.name)
        except (AdapterError, PlatformError) as exc:
            log.warning("demo adapter %s skipped: %s", sub.name, getattr(exc, "reason", exc))
    return added


def register_cli_adapters(settings: Settings, db: Database, store: AdapterStore) -> list[AdapterInfo]:
    """`serve --adapter NAME=PATH`: register (or update to a new version) as public."""
    known = {a.name for a in list_adapters(db)}
    return [add_adapter(db, store, name, path, public=True, replace=name in known, reserved=(settings.model_name,))
            for name, path in settings.adapters]
