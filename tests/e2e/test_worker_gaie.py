"""A worker reached directly, with no loraplex tenant on its requests: GAIE's
`x-gateway-inference-fairness-id` is the fairness key (tenant-fair order between ids) and
`x-gateway-inference-objective` may lower a request's lane. A real worker process with
one running sequence, so requests queue and the scheduler's order shows."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.e2e.test_worker import AUTH, ENGINE_ARGS, WORKER_MAX_LEN, Worker, gen_body

ONE_SEQ = [a for a in ENGINE_ARGS]
ONE_SEQ[ONE_SEQ.index("--max-num-seqs") + 1] = "1"


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_llama_dir) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("worker_gaie"), "--model", str(tiny_llama_dir), *ONE_SEQ)
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()


def _body(rid: str, max_tokens: int) -> dict:
    body = gen_body(rid, [5, 6, 7, 8], max_tokens)
    body["tenant"] = ""  # no loraplex tenant: not sent through a gateway
    return body


class Streams:
    """Requests in threads; `started` lists them in the order their first output came."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.started: list[str] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, rid: str, max_tokens: int, **headers: str) -> None:
        def run() -> None:
            with httpx.Client(base_url=self.url, timeout=120) as http:
                with http.stream("POST", "/internal/v1/generate", json=_body(rid, max_tokens),
                                 headers={**AUTH, **headers}) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line and orjson.loads(line).get("new_token_ids"):
                            with self.lock:
                                if rid not in self.started:
                                    self.started.append(rid)

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(120)


def _waiting(worker: Worker) -> dict[str, int]:
    return worker.http.get("/internal/v1/stats", headers=AUTH).json()["waiting"]


def _wait_for(cond, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_fairness_ids_take_turns_and_an_objective_lowers_the_lane(worker):
    fid = "x-gateway-inference-fairness-id"
    s = Streams(worker.url)
    # a1 holds the one seat until the queue is set up, however fast the machine: it runs
    # to the context's end unless aborted, and is aborted once the others wait.
    s.send("a1", WORKER_MAX_LEN - 4, **{fid: "team-a"})
    _wait_for(lambda: "a1" in s.started)
    for rid in ("a2", "a3"):
        s.send(rid, 4, **{fid: "team-a"})
    _wait_for(lambda: sum(_waiting(worker).values()) == 2)
    s.send("b1", 4, **{fid: "team-b"})
    s.send("low", 4, **{fid: "team-c", "x-gateway-inference-objective": "batch"})
    _wait_for(lambda: sum(_waiting(worker).values()) == 4)
    assert _waiting(worker).get("batch") == 1  # the body said interactive; the objective lowered it
    assert worker.http.post("/internal/v1/abort", json={"request_id": "a1"}, headers=AUTH).status_code == 204
    s.join()
    # team-a was served a1 while b1 waited: b1 goes before a2 and a3 (one queue by arrival
    # would have served a2 and a3 first), and the lowered request goes last.
    assert s.started[0] == "a1" and s.started.index("b1") < s.started.index("a2"), s.started
    assert s.started[-1] == "low", s.started
