from __future__ import annotations

import torch

from tests.platform.fixtures import db, empty_db_url, pg_schema_url, tiny_adapters  # noqa: F401 - fixtures

# The machine's cores are shared: one torch thread per test process.
torch.set_num_threads(1)
