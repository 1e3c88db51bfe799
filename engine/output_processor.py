"""From the tokens a step appended to a request to its `RequestOutput`: incremental
detokenization that never shows half a character or any part of a stop string, the
prompt logprobs on the first output, the timings of the first token."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .output import RequestOutput
from .request import Request, RequestStatus
from .sampler import Logprobs
from .tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer


@dataclass
class _Stream:
    """Per-request output state: detokenizer and stop-string matcher."""

    detok: IncrementalDetokenizer
    stop: StopChecker


class OutputProcessor:
    """Contract: `add(req)` when a request is queued; after each step `output(req, first,
    logprobs, finished)` for every request the step appended tokens to (from index
    `first`); `expired(req)` for a request ended by its deadline; `drop(request_id)` for
    an aborted one. A stop string ends a request at the token completing it: `finish`
    (the engine's) is called for it, and tokens past that point are dropped, as plain
    decoding never made them (speculative decoding may have)."""

    def __init__(self, tokenizer: Tokenizer, finish: Callable[[str, RequestStatus], object]) -> None:
        self.tokenizer, self.finish = tokenizer, finish
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def add(self, req: Request) -> None:
        self._streams[req.request_id] = _Stream(IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
                                                StopChecker(req.sampling.stop))

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def output(self, req: Request, first: int, lps: list[Logprobs | None], finished: bool) -> RequestOutput:
        stream = self._streams[req.request_id]
        tokens, text, stopped = req.output_token_ids[first:], "", False
        for n, token in enumerate(tokens, 1):
            piece, stopped = stream.stop.feed(stream.detok.step([token]))
            text += piece
            if stopped:
                del req.output_token_ids[first + n:]
                tokens = tokens[:n]
                break
        if stopped and not finished:
            self.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = stream.stop.matched
            finished = True
        elif stopped:
            req.stop_reason = stream.stop.matched
            req.status = RequestStatus.FINISHED_STOPPED
        elif finished:
            # Text the detokenizer or stop matcher still held back is final now.
            tail, stopped = stream.stop.feed(stream.detok.flush())
            text += tail if stopped else tail + stream.stop.flush()
            if stopped:
                req.stop_reason = stream.stop.matched
        if finished:
            self._streams.pop(req.request_id, None)
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=tokens, new_text=text, finished=finished,
            finish_reason=req.status.value if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens, logprobs=[lp for lp in lps[:len(tokens)] if lp],
            stop_reason=req.stop_reason, num_processed_prompt_tokens=req.num_prompt_tokens,
            prompt_logprobs=_prompt_logprobs(req))
        if req.num_output_tokens == len(tokens) and req.scheduled_time is not None \
                and req.first_token_time is not None:
            out.queue_time = max(0.0, req.scheduled_time - req.arrival_time)
            out.prefill_time = max(0.0, req.first_token_time - req.scheduled_time)
        return out

    def expired(self, req: Request) -> RequestOutput:
        """The last output of a request its deadline ended, with the text still held back."""
        stream = self._streams.pop(req.request_id, None)
        tail = stream.stop.feed(stream.detok.flush())[0] + stream.stop.flush() if stream else ""
        return RequestOutput(req.request_id, [], tail, True, req.status.value, req.num_prompt_tokens,
                             max(req.num_cached_tokens, 0), req.num_output_tokens,
                             num_processed_prompt_tokens=min(req.num_computed_tokens, req.num_prompt_tokens)
                             if not req.num_output_tokens else req.num_prompt_tokens)

    @staticmethod
    def prefill(req: Request) -> RequestOutput:
        """A token-less output for a prefill chunk: what an abort mid-prefill still cost."""
        return RequestOutput(req.request_id, [], "", False, None, req.num_prompt_tokens, max(req.num_cached_tokens, 0),
                             0, num_processed_prompt_tokens=min(req.num_computed_tokens, req.num_prompt_tokens))


def _prompt_logprobs(req: Request) -> list[Logprobs | None] | None:
    if req.sampling.prompt_logprobs is None or req.num_output_tokens != 1:
        return None
    return [None] + [req.prompt_logprobs[p] for p in range(1, req.num_prompt_tokens)]
