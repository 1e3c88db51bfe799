"""Several prompts in one completion request: one engine request per prompt, their
outputs merged into one stream as if one request had produced them all.

OpenAI numbers a request's choices prompt-major: prompt p's choice i is `p * n + i`. Each
prompt's own engine request numbers its choices 0..n-1, so the merge renumbers them. A
merged output carries the whole request's processed prompt tokens (what metering bills
for a request that ends before its first token) and is `finished` only when every
prompt's request is: what one engine request's outputs promise, kept. The token counts
per prompt (prompt and cached tokens) stay each output's own; `PromptTally` sums them.
Every prompt's request starts together (the fleet's router places each on its own), and
one that fails fails the whole request: the others are aborted.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from loraplex.engine.output import RequestOutput

Carry = Callable[[Awaitable[RequestOutput | None]], Awaitable[RequestOutput | None]]
_DONE = object()


class PromptTally:
    """Per prompt of a request, its prompt and cached tokens as its choice 0 first reported
    them (a later choice of the same prompt finds the prompt in the prefix cache: its own
    cached count would count the prompt twice)."""

    def __init__(self, prompt_lens: list[int], choices_per_prompt: int) -> None:
        self._lens = prompt_lens
        self._k = choices_per_prompt
        self._seen: dict[int, tuple[int, int]] = {}

    def add(self, out: RequestOutput) -> None:
        p, i = divmod(out.index, self._k)
        if i == 0 and p not in self._seen and (out.new_token_ids or out.finished or out.finish_reason):
            self._seen[p] = (out.num_prompt_tokens or self._lens[p], out.num_cached_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self._seen[p][0] if p in self._seen else n for p, n in enumerate(self._lens))

    @property
    def cached_tokens(self) -> int:
        return sum(c for _, c in self._seen.values())

    def billed_prompt_tokens(self, processed: int) -> int:
        """Prompt tokens to bill once the request ended: every prompt that produced output,
        and of the others what the engine processed (`processed` counts every prompt's)."""
        seen = sum(t for t, _ in self._seen.values())
        return min(max(seen, processed), sum(self._lens)) if len(self._seen) < len(self._lens) else seen


async def merge_prompt_streams(streams: list[AsyncIterator[RequestOutput]], choices_per_prompt: int,
                               request_id: str, carry: Carry | None = None) -> AsyncIterator[RequestOutput]:
    """The outputs of every prompt's stream, renumbered prompt-major, as they come.
    Closing the merged stream (or an error in one) closes every prompt's stream, which
    aborts its engine request."""
    # Bounded, so a reader that stops reading leaves the pumps waiting here, away from
    # their engine streams, which then pause their requests (async_engine.STALL_SECONDS).
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(streams))
    processed = [0] * len(streams)

    async def pump(p: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            while (out := await (carry(anext(stream, None)) if carry else anext(stream, None))) is not None:
                await queue.put((p, out))
            await queue.put((p, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((p, exc))

    pumps = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    running, unfinished = len(streams), len(streams)
    try:
        while running:
            p, item = await queue.get()
            if item is _DONE:
                running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            processed[p] = max(processed[p], item.num_processed_prompt_tokens)
            unfinished -= item.finished  # a stream's finished output is its last
            yield dataclasses.replace(
                item, request_id=request_id, index=p * choices_per_prompt + item.index,
                num_processed_prompt_tokens=sum(processed), finished=item.finished and unfinished == 0)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for s in streams:
            await s.aclose()  # aborts an engine request still running

