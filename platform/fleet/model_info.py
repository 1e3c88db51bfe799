"""What the gateway knows of the model without loading it: a worker's `/internal/v1/model`.

The tokenizer files and `config.json` it carries are written to one local folder, from
which the gateway builds its tokenizer (chat template, detokenization of logprobs) and
validates uploaded adapters against the base model's shapes.
"""
from __future__ import annotations

import base64
import logging
import time
from pathlib import Path

import httpx

from loraplex.engine.client import ModelInfo

from loraplex.platform.fleet.config import FleetConfig
from loraplex.platform.fleet.errors import WorkerUnreachableError
from loraplex.platform.routing import discovery_for

log = logging.getLogger(__name__)
MODEL_PATH = "/internal/v1/model"


def write_model_dir(doc: dict, folder: Path) -> tuple[str, ModelInfo]:
    """Write the files of a `/internal/v1/model` answer into `folder`; the served model's
    name and its ModelInfo (`model_dir` is `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = doc.get("tokenizer_files") or {}
    for name, data in files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            raise WorkerUnreachableError(f"a worker sent a model file with a bad name {name!r}")
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(base64.b64decode(data))
        tmp.replace(folder / name)
    if not (folder / "config.json").is_file():
        raise WorkerUnreachableError("the worker's model description lacks config.json")
    info = ModelInfo(int(doc["max_model_len"]), int(doc["vocab_size"]),
                     tuple(int(t) for t in doc.get("eos_token_ids", ())), folder,
                     max_loras=int(doc.get("max_loras", 0)), max_lora_rank=int(doc.get("max_lora_rank", 64)))
    return str(doc["model"]), info


def fetch_model_info(config: FleetConfig, folder: Path) -> tuple[str, ModelInfo]:
    """Ask the workers, in turn, until one describes the model (within `startup_wait_s`)."""
    discovery = discovery_for(workers=config.workers, workers_dns=config.workers_dns)
    deadline = time.monotonic() + config.startup_wait_s
    last: Exception | None = None
    with httpx.Client(headers=config.headers(), timeout=httpx.Timeout(10.0, connect=config.connect_timeout_s)) as client:
        while True:
            try:
                urls = discovery.resolve()
            except Exception as exc:  # DiscoveryError: DNS not there yet
                urls, last = [], exc
            for url in urls:
                try:
                    resp = client.get(url + MODEL_PATH)
                    if resp.status_code == 200:
                        return write_model_dir(resp.json(), folder)
                    last = WorkerUnreachableError(f"{url} answered HTTP {resp.status_code}")
                    if resp.status_code == 401:
                        raise WorkerUnreachableError(f"{url} refused the internal token (HTTP 401): "
                                                     "set the same LORAPLEX_INTERNAL_TOKEN on gateway and workers")
                except httpx.HTTPError as exc:
                    last = exc
            if time.monotonic() >= deadline:
                raise WorkerUnreachableError(f"no worker described the model within {config.startup_wait_s:g} s: "
                                             f"{last}")
            log.info("waiting for a worker to describe the model (%s)", last)
            time.sleep(1.0)
