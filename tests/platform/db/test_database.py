"""make_db_engine against a PostgreSQL server that never answers: a connection attempt
ends with an error after the connect timeout instead of waiting forever."""
from __future__ import annotations

import socket
import threading

from sqlalchemy.exc import OperationalError

from loraplex.platform.db.database import PG_CONNECT_TIMEOUT, make_db_engine


def test_a_server_that_accepts_but_never_answers_fails_the_connect_after_the_timeout():
    # The kernel completes the TCP handshake for the listen backlog, so the client's
    # connect succeeds and libpq then waits for a reply to its first packet that never
    # comes: only the connect timeout ends that wait.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        engine = make_db_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test", pre_ping=False)
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                engine.connect().close()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome.append(exc)

        attempt = threading.Thread(target=connect, daemon=True)
        attempt.start()
        # Without a connect timeout the attempt never ends; the bound only keeps the
        # test from hanging, and is far above PG_CONNECT_TIMEOUT.
        attempt.join(timeout=60 + PG_CONNECT_TIMEOUT)
        assert not attempt.is_alive(), "the connect attempt is still waiting on a silent server"
        engine.dispose()
    assert len(outcome) == 1 and isinstance(outcome[0], OperationalError), outcome
    assert "timeout" in str(outcome[0]).lower(), outcome[0]
