"""AsyncEngine: the step loop on its own thread, one async stream per request.

pytest-asyncio is not installed: each test drives its own loop with asyncio.run.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.client import AdapterResidency, EngineClient, EngineStats, LaneDepth
from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from loraplex.engine.request import Lane, SamplingParams

TIMEOUT = 120  # seconds: generous on a busy 2-core machine, but a hang fails instead of blocking


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=16, num_blocks=kw.pop("num_blocks", 256)),
                                  scheduler=SchedulerConfig(**kw)))


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture
def aengine(tiny_llama_dir):
    ae = AsyncEngine(_engine(tiny_llama_dir))
    yield ae
    ae.shutdown()
    assert not ae._thread.is_alive()


async def _collect(ae: AsyncEngine, prompt, sp, **kw) -> list:
    return [o async for o in ae.generate(prompt, sp, **kw)]


async def _wait_idle(ae: AsyncEngine) -> tuple[int, int, int]:
    """Poll on the engine thread until no request is left; (requests, free blocks, total)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        state = await ae.call(lambda e: (len(e.scheduler.requests), e.kv.pool.num_free_blocks,
                                         e.kv.pool.num_blocks))
        if state[0] == 0 or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.01)


def test_concurrent_streams_receive_ordered_deltas(aengine):
    prompts = [[5, 6, 7], "Hello there, how are", list(range(300, 340)), [9] * 20]
    max_tokens = [12, 7, 20, 1]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(
            _collect(aengine, p, _greedy(n), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, max_tokens)))), TIMEOUT)

    streams = asyncio.run(main())
    ref = aengine.engine  # the engine thread is idle now; compare with a plain run
    for i, (outs, p, n) in enumerate(zip(streams, prompts, max_tokens)):
        assert all(o.request_id == f"r{i}" for o in outs)
        assert [o.num_output_tokens for o in outs] == list(range(1, n + 1)), "deltas in order, none lost"
        assert all(len(o.new_token_ids) == 1 for o in outs)
        assert [o.finished for o in outs] == [False] * (n - 1) + [True]
        assert outs[-1].finish_reason == "length"
        ids = [t for o in outs for t in o.new_token_ids]
        assert "".join(o.new_text for o in outs) == ref.tokenizer.decode(ids)
    # Same tokens as the synchronous engine on its own (greedy, so batching cannot matter).
    expected = _engine(aengine.engine.model_dir).generate(prompts, [_greedy(n) for n in max_tokens])
    assert [[t for o in s for t in o.new_token_ids] for s in streams] == [e.new_token_ids for e in expected]


def test_many_overlapping_streams_from_one_loop(aengine):
    async def one(i):
        await asyncio.sleep(0.002 * i)  # staggered arrivals join a running batch
        outs = await _collect(aengine, [100 + i, 200 + i], _greedy(5 + i % 4))
        return len(outs), outs[-1].finished

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(12))), TIMEOUT)

    assert asyncio.run(main()) == [(5 + i % 4, True) for i in range(12)]


@pytest.mark.parametrize("how", ["break", "aclose"])
def test_closing_the_stream_early_aborts_the_request(aengine, how):
    max_tokens = 1500

    async def main():
        got = 0
        if how == "break":
            async for _ in aengine.generate([5, 6, 7], _greedy(max_tokens)):
                got += 1
                if got == 3:
                    break  # the generator is finalized (and aborts) once unreferenced
        else:
            stream = aengine.generate([5, 6, 7], _greedy(max_tokens))
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.aclose()
        state = await _wait_idle(aengine)
        gen_tokens = await aengine.call(lambda e: e.num_generation_tokens)
        return got, state, gen_tokens

    got, (n_requests, free, total), gen_tokens = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert got == 3
    assert n_requests == 0, "the abandoned request is still in the scheduler"
    assert free == total, "the aborted request's KV blocks were not freed"
    assert gen_tokens < max_tokens, "the request ran to completion instead of being aborted"
    assert not aengine._streams and not len(aengine.engine.outputs)


def test_invalid_request_fails_alone(aengine):
    async def main():
        for bad in ([-1, 5], [10 ** 9]):
            with pytest.raises(InvalidRequestError):
                await _collect(aengine, bad, _greedy(3))
        with pytest.raises(PromptTooLongError):
            await _collect(aengine, [5] * 2040, _greedy(20))
        # The loop survives: the next request works, also beside a concurrent bad one.
        return await asyncio.gather(_collect(aengine, [5, 6], _greedy(4)),
                                    _collect(aengine, [7, 8], _greedy(30_000)),
                                    return_exceptions=True)

    good, bad = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert len(good) == 4 and good[-1].finished
    assert isinstance(bad, PromptTooLongError)
    assert aengine.is_running


def test_duplicate_request_id_does_not_steal_a_stream(aengine):
    async def main():
        first = aengine.generate([5, 6, 7], _greedy(30), request_id="same")
        head = await first.__anext__()
        with pytest.raises(InvalidRequestError):
            await _collect(aengine, [8, 9], _greedy(3), request_id="same")
        rest = [o async for o in first]
        return [head] + rest

    outs = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert len(outs) == 30 and outs[-1].finished and outs[-1].finish_reason == "length"


def test_call_runs_on_the_engine_thread(aengine):
    async def main():
        stats = await aengine.call(lambda e: e.stats())
        thread = await aengine.call(lambda e: threading.current_thread())
        with pytest.raises(ZeroDivisionError):
            await aengine.call(lambda e: 1 / 0)  # raised to the caller, the loop lives on
        again = await aengine.call(lambda e: e.stats())
        return stats, thread, again

    stats, thread, again = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert stats.running == 0 and stats.num_blocks == 256
    assert thread is aengine._thread
    assert again.time >= stats.time
    assert aengine.is_running


def test_shutdown_fails_pending_streams_and_new_calls(tiny_llama_dir):
    ae = AsyncEngine(_engine(tiny_llama_dir, max_num_seqs=1))

    async def main():
        running = ae.generate([5, 6, 7], _greedy(1500))
        first = await running.__anext__()
        queued = ae.generate([8, 9], _greedy(1500))  # waits behind the first (max_num_seqs=1)
        queued_task = asyncio.ensure_future(_collect_until_error(queued))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(ae.shutdown)
        assert not ae.is_running
        with pytest.raises(EngineDeadError):
            async for _ in running:
                pass
        with pytest.raises(EngineDeadError):
            await _collect(ae, [5], _greedy(2))
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: e.stats())
        return first, await queued_task

    first, queued_error = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert not first.finished
    assert isinstance(queued_error, EngineDeadError)
    assert not ae._thread.is_alive()


async def _collect_until_error(stream):
    try:
        async for _ in stream:
            pass
    except BaseException as exc:
        return exc
    return None


def test_call_submitted_as_the_loop_stops_does_not_hang(tiny_llama_dir):
    """A command queued while a step runs and shutdown follows must fail, not hang."""
    engine = _engine(tiny_llama_dir)
    ae = AsyncEngine(engine)
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def slow_step():
        in_step.set()
        release.wait(TIMEOUT)
        return real_step()

    engine.step = slow_step

    async def main():
        stream = asyncio.ensure_future(_collect_until_error(ae.generate([5, 6], _greedy(50))))
        assert await asyncio.to_thread(in_step.wait, TIMEOUT)
        call = asyncio.ensure_future(ae.call(lambda e: "ran"))
        await asyncio.sleep(0.01)  # the call is queued behind the running step
        ae._stop = True  # what shutdown() does first; the loop exits after this step
        release.set()
        await asyncio.to_thread(ae._thread.join, TIMEOUT)
        result = await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), 10)
        return result[0], await stream

    call_result, stream_error = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert call_result == "ran" or isinstance(call_result, EngineDeadError), call_result
    assert isinstance(stream_error, EngineDeadError)


def test_call_from_a_loop_that_closed_does_not_kill_the_engine(tiny_llama_dir):
    """The caller's event loop may be gone when the engine thread answers a call."""
    engine = _engine(tiny_llama_dir)
    ae = AsyncEngine(engine)
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def slow_step():
        in_step.set()
        release.wait(TIMEOUT)
        return real_step()

    engine.step = slow_step
    ran = threading.Event()

    async def caller():
        asyncio.ensure_future(_collect_until_error(ae.generate([5, 6], _greedy(3))))
        assert await asyncio.to_thread(in_step.wait, TIMEOUT)
        asyncio.ensure_future(ae.call(lambda e: ran.set()))
        await asyncio.sleep(0.01)
        # asyncio.run returns here: pending tasks are cancelled and the loop is closed.

    try:
        asyncio.run(caller())
        engine.step = real_step
        release.set()
        assert ran.wait(TIMEOUT)
        time.sleep(0.05)  # the answer to the closed loop has been attempted by now
        assert ae.is_running, "answering a closed loop killed the engine"

        async def again():
            return await asyncio.wait_for(ae.call(lambda e: len(e.scheduler.requests)), TIMEOUT)

        assert asyncio.run(again()) in (0, 1)
    finally:
        release.set()
        ae.shutdown()


def test_the_in_process_engine_is_an_engine_client(aengine):
    """The stats a client sees are plain frozen data, for the gateway and for a remote worker alike."""
    assert isinstance(aengine, EngineClient)
    s = aengine.stats()
    assert isinstance(s, EngineStats) and s.running == 0 and s.waiting == 0 and s.num_blocks == 256
    assert s.block_size == 16 and s.device == "cpu" and s.max_loras == 0
    assert s.lanes == {lane: LaneDepth(0, 0) for lane in Lane}
    assert s.adapters == AdapterResidency() and aengine.adapter_residency() == AdapterResidency()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.running = 1  # type: ignore[misc]
    assert aengine.resolve_adapter("anything") is None  # no LoRA manager: the engine refuses adapters itself
    assert aengine.max_model_len == aengine.engine.max_model_len


def test_adapters_through_the_client(tiny_llama_dir, tmp_path):
    """add (and replace) -> resolve -> run -> residency -> remove, through the client only."""
    from loraplex.adapters import AdapterError, AdapterStore, BaseShapes
    from loraplex.adapters.synth import make_random_peft_adapter
    from loraplex.engine.config import LoRAConfig
    from loraplex.engine.errors import UnknownAdapterError
    from loraplex.engine.lora import LoRAManager

    first = make_random_peft_adapter(tiny_llama_dir, tmp_path / "a", rank=4, seed=1, init_scale=0.3)
    second = make_random_peft_adapter(tiny_llama_dir, tmp_path / "b", rank=4, seed=2, init_scale=0.3)
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                       cache=CacheConfig(block_size=16, num_blocks=64), lora=LoRAConfig(max_loras=2))
    ae = AsyncEngine(LLMEngine(cfg, LoRAManager(store, cfg.lora)))
    try:
        ref = ae.add_adapter("x", first)
        assert ae.resolve_adapter("x") == ref
        with pytest.raises(AdapterError, match="already exists"):
            ae.add_adapter("x", second)  # replacing takes replace=True
        newer = ae.add_adapter("x", second, replace=True)
        assert newer.digest != ref.digest and ae.resolve_adapter("x") == newer

        async def run():
            async for out in ae.generate([5, 6, 7], _greedy(2), adapter=newer):
                last = out
            return last

        assert asyncio.run(asyncio.wait_for(run(), TIMEOUT)).finished
        assert ae.stats().max_loras == 2
        assert ae.adapter_residency().where().get(newer.digest) in ("device", "cpu")
        ae.remove_adapter("x")
        with pytest.raises(UnknownAdapterError):
            ae.resolve_adapter("x")
    finally:
        ae.shutdown()


def test_a_reader_that_stops_reading_has_its_request_aborted(tiny_llama_dir):
    """The queue between the engine and a reader that stopped is bounded: past the backlog
    the request is aborted in the engine; what was queued is still read, then the error."""
    from loraplex.engine.errors import StreamStalledError

    ae = AsyncEngine(_engine(tiny_llama_dir), max_stream_backlog=4)

    async def main() -> tuple[list, BaseException | None, tuple]:
        stream = ae.generate([5, 6, 7], _greedy(200))
        got = [await anext(stream)]  # then the reader stops reading
        idle = await _wait_idle(ae)  # only an abort ends the request before its 200 tokens
        error = None
        try:
            async for out in stream:
                got.append(out)
        except StreamStalledError as exc:
            error = exc
        return got, error, idle

    try:
        got, error, (left, free, total) = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        ae.shutdown()
    assert isinstance(error, StreamStalledError)
    assert left == 0 and free == total
    assert not any(o.finished for o in got)
    assert sum(len(o.new_token_ids) for o in got) < 200


def test_a_reader_that_falls_behind_pauses_its_request_until_it_catches_up(tiny_llama_dir):
    """Past `pause_backlog` unread outputs the request takes no steps (others go on); read
    again, it resumes and its output is what it would have been unpaused."""
    want = _engine(tiny_llama_dir).generate([[5, 6, 7]], _greedy(60))[0].new_token_ids
    ae = AsyncEngine(_engine(tiny_llama_dir), pause_backlog=8, stall_seconds=3600)

    async def main() -> tuple[list[int], int, int, list]:
        slow = ae.generate([5, 6, 7], _greedy(60), request_id="slow")
        got = [await anext(slow)]  # then the reader stops reading
        req = ae.engine.scheduler.requests["slow"]
        while not req.paused:
            await asyncio.sleep(0.01)
        made = req.num_output_tokens
        others = [o async for o in ae.generate([9, 10, 11], _greedy(30))]  # the engine steps on
        still = req.num_output_tokens
        assert ae.engine.stats().paused == 1  # what loraplex:num_requests_paused reports
        got += [o async for o in slow]  # reading again resumes it
        assert ae.engine.stats().paused == 0
        return [t for o in got for t in o.new_token_ids], made, still, others

    try:
        tokens, made, still, others = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        ae.shutdown()
    assert 8 <= made < 60 and still == made, "no steps while paused"
    assert sum(len(o.new_token_ids) for o in others) == 30 and others[-1].finished
    assert tokens == want


def test_a_reader_away_with_its_last_output_pauses_its_request_however_short_its_backlog(tiny_llama_dir):
    """A reader that took an output and has not come back for `stall_seconds` (blocked
    sending it to a client that stopped reading) has its request paused long before its
    backlog could pause it; it resumes once the reader has taken everything queued."""
    want = _engine(tiny_llama_dir).generate([[5, 6, 7]], _greedy(1500))[0].new_token_ids
    ae = AsyncEngine(_engine(tiny_llama_dir), pause_backlog=100_000, stall_seconds=0.05)
    paused: list[bool] = []
    pause = ae.engine.pause_request
    ae.engine.pause_request = lambda rid, p: (paused.append(p), pause(rid, p))

    async def main() -> tuple[list[int], int, int]:
        slow = ae.generate([5, 6, 7], _greedy(1500), request_id="slow")
        got = [await anext(slow)]  # then the reader is away with it
        req = ae.engine.scheduler.requests["slow"]
        while not req.paused:
            await asyncio.sleep(0.01)
        made = req.num_output_tokens
        assert [t async for o in ae.generate([9, 10, 11], _greedy(30)) for t in o.new_token_ids]
        still = req.num_output_tokens
        got += [o async for o in slow]
        return [t for o in got for t in o.new_token_ids], made, still

    try:
        tokens, made, still = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        ae.shutdown()
    assert made < 1500 and still == made, "paused before its end, no steps while paused"
    assert paused == [True, False]
    assert tokens == want


def test_readers_waiting_for_output_are_not_paused_when_the_event_loop_stalls(tiny_llama_dir):
    """Only a reader away with an output counts as stalled: a loop blocked for longer than
    `stall_seconds` while every reader waits for its next output pauses nobody."""
    ae = AsyncEngine(_engine(tiny_llama_dir), pause_backlog=100_000, stall_seconds=0.05)
    paused: list[bool] = []
    pause = ae.engine.pause_request
    ae.engine.pause_request = lambda rid, p: (paused.append(p), pause(rid, p))

    async def main() -> int:
        async def read() -> int:
            return sum([len(o.new_token_ids) async for o in ae.generate([5, 6, 7], _greedy(400))])

        reader = asyncio.ensure_future(read())
        while not reader.done():
            time.sleep(0.2)  # the loop is stuck while the reader waits in the engine's queue
            await asyncio.sleep(0.01)
        return await reader

    try:
        made = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        ae.shutdown()
    assert made == 400 and paused == []


def test_an_engine_built_by_a_function_is_built_and_stepped_on_the_engine_thread(tiny_llama_dir):
    """Only the engine thread ever runs the model: a second thread's OpenMP team would
    make every parallel region of a step wait for sleeping workers (async_engine.py)."""
    built_on, stepped_on = [], set()

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        engine = _engine(tiny_llama_dir)
        step = engine.step
        engine.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
        return engine

    ae = AsyncEngine(build)

    async def main() -> list:
        return [o async for o in ae.generate([5, 6, 7], _greedy(4))]

    try:
        outs = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    finally:
        ae.shutdown()
    assert sum(len(o.new_token_ids) for o in outs) == 4
    assert built_on != [threading.get_ident()] and stepped_on == set(built_on)


def test_a_build_that_fails_fails_the_constructor():
    def build() -> LLMEngine:
        raise FileNotFoundError("no model in /nowhere")

    with pytest.raises(FileNotFoundError, match="no model in /nowhere"):
        AsyncEngine(build)
