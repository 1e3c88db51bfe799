"""Where request bodies are parsed: a few threads beside the event loop, and for a big
body a process of its own first.

Tokenizing and chat templates run on `ParsePool`'s threads, so the event loop, and
`/health`, never wait for them. Parsing JSON, and the checks over the parsed value, hold
the interpreter lock whichever thread runs them (orjson does not release it): a body of
a few MiB held it 40-100 ms, which the event loop and, in `serve`, the engine thread's
Python waited out, so a tenant streaming beside the sender of such bodies saw its
slowest first tokens come 1.7-1.9x later. A body of at least `screen_bytes` is therefore
first parsed and checked in a child process (`screen`: every refusal that needs no
tokenizer, e.g. protocol.screen_request), and only a body that passes is parsed here. A
refused body costs this process a pipe write; a valid big one is parsed twice, as often
as its sender's body budget (request_limits.BodyBudget) lets it send one.

The child is started on the first big body (spawned: this process holds threads),
runs at a lower CPU priority, and is one process shared by every tenant, whose bodies
it takes in turn. If it fails (killed, out of memory), the body is parsed here as if
it had not been screened and a new child is started for the next one: screening can
refuse a body, never fail a request.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from loraplex.engine.errors import InvalidRequestError
from loraplex.platform.errors import PlatformError

log = logging.getLogger(__name__)

T = TypeVar("T")
PARSE_THREADS = 2
# Bodies from this size are screened in the child: orjson parses ~100 MiB/s of dense
# JSON here, so a body this size holds the lock ~2-5 ms, the pipe to the child ~0.1 ms.
SCREEN_BYTES = 256 * 1024
SCREEN_NICE = 19
# What the screen refuses with: the domain errors the API maps to 4xx.
SCREENED_ERRORS = (PlatformError, InvalidRequestError)


def _lower_priority() -> None:
    try:
        os.nice(SCREEN_NICE)
    except OSError:  # not allowed here: the child still takes the parsing off this process
        pass


def _screened(fn: Callable[..., Any], raw: bytes, *args: Any) -> tuple | None:
    """In the child: fn's domain error as (class, args, attributes), or None. Rebuilt
    without calling __init__, whose signature differs from the exception's args."""
    try:
        fn(raw, *args)
    except SCREENED_ERRORS as exc:
        return type(exc), exc.args, vars(exc)
    return None


def _rebuild(found: tuple) -> Exception:
    cls, args, attrs = found
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc


class ParsePool:
    """A few threads for parsing, tokenizing and chat templates, and the screening child."""

    def __init__(self, threads: int = PARSE_THREADS, screen_bytes: int = SCREEN_BYTES) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-parse")
        self.screen_bytes = screen_bytes
        self.screened: Counter[str] = Counter()  # bodies sent to the child, by outcome
        self._child: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, raw: bytes, fn: Callable[..., T], *args: Any,
                    screen_with: Callable[..., Any] | None = None) -> T:
        """`fn(raw, *args)` on a thread, a big body screened first with
        `screen_with(raw, *args)` (default: `fn` itself) in the child."""
        await self.screen(raw, screen_with or fn, *args)
        return await self.run(fn, raw, *args)

    async def screen(self, raw: bytes, fn: Callable[..., Any], *args: Any) -> None:
        """Raise the domain error `fn(raw, *args)` raises, found in the child, when `raw`
        is at least `screen_bytes` long; return otherwise (a small body, a body fn
        accepts, or a child that failed: the caller's own parse then decides). `fn`: a
        module-level function (the child imports it by name)."""
        if len(raw) < self.screen_bytes:
            return
        try:
            found = await asyncio.wrap_future(self._screener().submit(_screened, fn, raw, *args))
        except Exception as exc:  # noqa: BLE001 - the child's failure must not fail the request
            log.warning("screening a %d-byte body in the child process failed (%s: %s); parsing it here",
                        len(raw), type(exc).__name__, exc)
            self.screened["failed"] += 1
            self._stop_child()
            return
        self.screened["passed" if found is None else "refused"] += 1
        if found is not None:
            raise _rebuild(found)

    def _screener(self) -> Executor:
        if self._child is None:
            self._child = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=_lower_priority)
        return self._child

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        child, self._child = self._child, None
        if child is not None:
            child.shutdown(wait=True, cancel_futures=True)
