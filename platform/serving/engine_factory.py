"""The one place the engine is built from settings."""
from __future__ import annotations

import logging

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import LLMEngine
from loraplex.engine.lora import LoRAManager

from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


def build_lora_manager(settings: Settings) -> LoRAManager:
    """A LoRAManager over the adapter store.

    The engine resolves `generate(adapter=name)` through it; the platform's database only
    decides who may use which name.
    """
    from loraplex.platform.tenancy.adapter_registry import open_store

    return LoRAManager(open_store(settings), settings.engine.lora)


def build_engine(settings: Settings) -> AsyncEngine:
    engine = LLMEngine(settings.engine, lora_manager=build_lora_manager(settings))
    engine.report_prefill = True  # metering bills the prompt tokens of a request aborted mid-prefill
    log.info("engine warmed up for every batch width in %.1f s", engine.warm_up())
    return AsyncEngine(engine)
