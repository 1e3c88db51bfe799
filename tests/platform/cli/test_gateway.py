"""`loraplex gateway`'s refusals, in process: no worker is reached and no server runs."""
from __future__ import annotations

import logging

import pytest

from tests.platform.fixtures import run_cli

WORKERS = "http://127.0.0.1:9"  # never asked: each start here is refused before that


@pytest.mark.parametrize(("argv", "env", "words"), [
    (["--workers", "ftp://127.0.0.1:9"], {}, "must start with http://"),
    (["--workers-dns", "no-port"], {}, "NAME:PORT"),
    (["--workers", WORKERS, "--max-in-flight", "0"], {}, "max_in_flight"),
    (["--workers", WORKERS], {"LORAPLEX_ADMIN_TOKEN": "short"}, "too short"),
])
def test_a_refused_start_leaves_logging_and_the_database_as_it_found_them(capsys, monkeypatch, tmp_path, argv, env,
                                                                          words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    db = tmp_path / "gateway.db"
    code, _, err = run_cli(capsys, "gateway", *argv, "--database-url", f"sqlite:///{db}",
                           "--data-dir", str(tmp_path / "data"))
    assert code == 1 and words in err and "Traceback" not in err
    assert (list(root.handlers), root.level) == before  # later in-process tests log where they did
    assert not db.exists()  # refused before migrating anything
