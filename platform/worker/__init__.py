"""`loraplex worker`: the engine alone behind the internal API a gateway drives (platform/fleet/WIRE.md).

No tenancy here: the gateway authenticates tenants and sends token ids, a lane and an
adapter version (name + digest); the worker fetches that version from the shared adapter
store on first use and streams the outputs back as NDJSON.
"""
from __future__ import annotations

from loraplex.platform.worker.app import create_worker_app
from loraplex.platform.worker.config import WorkerConfig
from loraplex.platform.worker.server import run_worker
from loraplex.platform.worker.state import WorkerState

__all__ = ["WorkerConfig", "WorkerState", "create_worker_app", "run_worker"]
