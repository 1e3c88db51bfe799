"""One gateway process of the two-replica test: uvicorn on a free port over a tiny model,
with the real quotas and metering on a shared database. Prints `PORT <n>` when serving.

    python -m tests.e2e.replica_server --database-url URL --model-dir DIR --data-dir DIR [--delay S]
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds before each streamed output")
    args = ap.parse_args()

    import torch
    import uvicorn
    from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig
    from loraplex.platform.app import create_app
    from loraplex.platform.assembly.engine_factory import build_engine
    from loraplex.platform.settings import QuotaConfig, Settings, UsageConfig

    from tests.e2e.usage_support import ChaosEngine

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig(model=ModelConfig(model=args.model_dir, dtype="float32", max_model_len=256),
                          cache=CacheConfig(num_blocks=128, block_size=16), num_threads=1)
    settings = Settings(engine=config, data_dir=args.data_dir, database_url=args.database_url,
                        quotas=QuotaConfig(cache_ttl=0.05), usage=UsageConfig(flush_seconds=0.02))
    engine = ChaosEngine(build_engine(settings))
    engine.delay = args.delay
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings, engine), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.inner.shutdown()


if __name__ == "__main__":
    main()
