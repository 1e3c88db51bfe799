"""The NDJSON writer: a client that reads slowly gets the steps it missed in one line."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.request import SamplingParams
from loraplex.platform.worker.config import WorkerConfig
from loraplex.platform.worker.state import WorkerState
from loraplex.platform.http import wait_disconnect
from loraplex.platform.worker.stream import NdjsonResponse, Relay
from loraplex.platform.fleet.wire import GenerateRequest


async def _started_relay(engine: AsyncEngine, tmp_path, rid: str, sampling: SamplingParams):
    """A worker's relay for one request, started, with its first outputs taken."""
    state = WorkerState(WorkerConfig("sqlite://", tmp_path), "tiny")
    state.attach(engine, None)
    relay = Relay(state, GenerateRequest(rid, [1, 2, 3, 4], sampling))
    state.begin()
    relay.start(engine)
    return state, relay, await relay.take()


def _response_to_a_paused_reader(state: WorkerState, relay: Relay, first) -> tuple[asyncio.Task, asyncio.Event,
                                                                                list[bytes]]:
    """The NDJSON response to a client that reads the first chunk, then nothing until
    `reading` is set; it never leaves. Returns (the response's task, reading, chunks)."""
    reading, chunks = asyncio.Event(), []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message["body"])
            if len(chunks) == 1:
                await reading.wait()

    stays: asyncio.Future = asyncio.get_running_loop().create_future()

    async def receive() -> dict:
        return await stays

    watcher = asyncio.ensure_future(wait_disconnect(receive))
    return asyncio.ensure_future(NdjsonResponse(state, relay, first, watcher, {})({}, receive, send)), reading, chunks


def test_outputs_a_slow_client_missed_are_coalesced(blob_engine, tmp_path):
    engine = AsyncEngine(blob_engine[0])
    sampling = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[dict], list[int]]:
        state, relay, first = await _started_relay(engine, tmp_path, "slow", sampling)
        task, reading, chunks = _response_to_a_paused_reader(state, relay, first)
        while not relay.done:  # the engine runs to the end meanwhile
            await asyncio.sleep(0.01)
        reading.set()
        await task
        assert state.in_flight == 0
        whole = [t async for out in engine.generate([1, 2, 3, 4], sampling) for t in out.new_token_ids]
        return [orjson.loads(line) for line in b"".join(chunks).splitlines()], whole

    try:
        lines, whole = asyncio.run(run())
    finally:
        engine.shutdown()
    outputs = [line for line in lines if line["type"] == "output"]
    # What the engine made before the first write (a step or, on a busy machine, a few),
    # then everything the client missed in one line.
    assert len(outputs) == 2 and lines[-1]["type"] == "stats"
    assert len(outputs[0]["new_token_ids"]) < 20 and outputs[1]["finished"]
    assert [t for o in outputs for t in o["new_token_ids"]] == whole


def test_a_client_that_stops_reading_has_its_request_aborted(blob_engine, tmp_path, monkeypatch):
    """The relay's buffer is bounded: past the backlog the request is aborted in the engine
    and the stream ends with a StreamStalledError line once the client reads again."""
    from loraplex.platform.worker import stream as stream_module

    monkeypatch.setattr(stream_module, "MAX_STREAM_BACKLOG", 4)
    engine = AsyncEngine(blob_engine[0])
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def run() -> list[dict]:
        state, relay, first = await _started_relay(engine, tmp_path, "stalled", sampling)
        task, reading, chunks = _response_to_a_paused_reader(state, relay, first)
        while not relay.done:  # only the backlog ends it before its 40 tokens
            await asyncio.sleep(0.01)
        reading.set()
        await task
        return [orjson.loads(line) for line in b"".join(chunks).splitlines()]

    try:
        lines = asyncio.run(run())
    finally:
        engine.shutdown()
    assert lines[-1]["type"] == "error" and lines[-1]["error"]["type"] == "StreamStalledError"
    outputs = [line for line in lines if line["type"] == "output"]
    assert not any(o["finished"] for o in outputs)
    assert sum(len(o["new_token_ids"]) for o in outputs) < 40


@pytest.mark.parametrize("rule", ["backlog", "stall"])
def test_a_client_that_falls_behind_pauses_its_request_and_gets_all_of_it(blob_engine, tmp_path, monkeypatch,
                                                                          rule):
    """Past the relay's pause backlog, or once its writer has been blocked with outputs
    waiting for `STALL_SECONDS`, the relay stops taking outputs and the request is paused
    (no steps); once the client reads again it resumes and the client gets the whole
    output, as if it had never fallen behind."""
    from loraplex.platform.worker import stream as stream_module

    if rule == "backlog":
        monkeypatch.setattr(stream_module, "PAUSE_BACKLOG", 4)
        engine = AsyncEngine(blob_engine[0], pause_backlog=4, stall_seconds=3600)
        sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    else:
        monkeypatch.setattr(stream_module, "STALL_SECONDS", 0.01)
        engine = AsyncEngine(blob_engine[0], pause_backlog=100_000, stall_seconds=0.01)
        sampling = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[dict], list[int], int, int]:
        state, relay, first = await _started_relay(engine, tmp_path, "behind", sampling)
        task, reading, chunks = _response_to_a_paused_reader(state, relay, first)
        req = engine.engine.scheduler.requests["behind"]
        while not req.paused:
            await asyncio.sleep(0.01)
        made = req.num_output_tokens
        other = [t async for out in engine.generate([9, 8, 7], sampling) for t in out.new_token_ids]
        still = req.num_output_tokens
        reading.set()
        await task
        whole = [t async for out in engine.generate([1, 2, 3, 4], sampling) for t in out.new_token_ids]
        assert len(other) == sampling.max_tokens
        return [orjson.loads(line) for line in b"".join(chunks).splitlines()], whole, made, still

    try:
        lines, whole, made, still = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.shutdown()
    assert made < sampling.max_tokens and still == made, "no steps while paused"
    outputs = [line for line in lines if line["type"] == "output"]
    assert lines[-1]["type"] == "stats" and outputs[-1]["finished"]
    assert [t for o in outputs for t in o["new_token_ids"]] == whole
