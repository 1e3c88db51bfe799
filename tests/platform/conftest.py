from __future__ import annotations

import pytest
import torch

from tests.platform.fixtures import cli, db, empty_db_url, pg_schema_url, tiny_adapters  # noqa: F401 - fixtures


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The machine's cores are shared: one torch thread in these tests, restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
