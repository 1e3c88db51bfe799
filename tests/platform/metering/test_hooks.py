"""The metering hooks without a server: the billing rules for a request's tokens, the
checkpoint cadence, the 503 of a metering backlog, and the shutdown drain."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from loraplex.engine.output import RequestOutput
from loraplex.engine.request import Lane
from loraplex.platform.assembly.usage_hooks import UsageHooks
from loraplex.platform.errors import MeteringUnavailableError
from loraplex.platform.metering.hooks import MeteringHooks, billed_tokens, checkpoint_of, event_of
from loraplex.platform.serving.auth import Principal
from loraplex.platform.serving.hooks import RequestContext
from loraplex.platform.settings import Settings, UsageConfig
from loraplex.platform.tenancy.tenants import create_tenant


def ctx_of(t, name: str, max_tokens: int = 20, prompt: int = 10) -> RequestContext:
    p = Principal(t.id, name, 7, "abcdefabcdef", Lane.STANDARD, frozenset([Lane.STANDARD]), frozenset())
    return RequestContext(f"cmpl-{uuid.uuid4().hex}", p, "m", None, Lane.STANDARD, prompt, max_tokens)


def done(ctx: RequestContext, out: int, reason: str = "length") -> RequestContext:
    ctx.num_output_tokens, ctx.finish_reason = out, reason
    ctx.first_token_at = ctx.finished_at = time.time()
    return ctx


@pytest.fixture
def metering_factory(db, tmp_path):
    """The metering part of the hooks the app composes (its settlements go to the quota store)."""

    def make(**usage) -> MeteringHooks:
        config = UsageConfig(flush_seconds=0.01, **usage)
        return UsageHooks(Settings(database_url=db.url, data_dir=tmp_path, usage=config)).metering

    return make


def test_billing_rules():
    t = type("T", (), {"id": 1})
    ctx = ctx_of(t, "acme")
    assert billed_tokens(done(ctx, 0, "abort")) == (0, 0, 0)  # left before the engine ran it: nothing
    ctx.num_processed_prompt_tokens = 8
    assert billed_tokens(done(ctx, 0, "abort")) == (8, 0, 0)  # left mid-prefill: the chunks that ran
    ctx.num_cached_tokens = 4
    assert billed_tokens(done(ctx, 3, "abort")) == (10, 4, 3)  # left mid-stream: what was generated
    ev = event_of(done(ctx, 3, "abort"))
    assert ev.status == "aborted" and ev.total_tokens == 13 and ev.key_id == 7 and ev.lane == 1


def test_events_and_checkpoints_keep_the_correlation_id():
    # A crash checkpoint is what gets billed after a kill -9: it must join the logs too.
    ctx = ctx_of(type("T", (), {"id": 1}), "acme")
    ctx.correlation_id = "client-req-7"
    out = RequestOutput(ctx.request_id, [5], "x", False, num_processed_prompt_tokens=10)
    assert checkpoint_of(ctx, out, time.time()).correlation_id == "client-req-7"
    assert event_of(done(ctx, 1)).correlation_id == "client-req-7"


def test_checkpoints_every_16_tokens_and_1_second_whichever_is_later(db, metering_factory):
    h = metering_factory()
    t = create_tenant(db, "acme")
    e = event_of(done(ctx_of(t, "acme"), 0))
    rid, due = e.request_id, h.ledger.due
    assert due(rid, 0, 100.0), "the first output always checkpoints"
    assert h.journal.wait_durable(h.ledger.checkpoint(e, None, 100.0))
    assert not due(rid, 15, 200.0) and not due(rid, 500, 100.9)
    assert due(rid, 16, 101.0) and due(rid, 500, 101.0)
    h.ledger.forget(rid)
    assert h.journal.pinned() == 0


def test_a_backlog_of_unwritten_events_means_503(db, metering_factory):
    t = create_tenant(db, "acme")
    h = metering_factory()

    async def main():
        await h.start()
        h.check_admitting()
        for _ in range(3):  # a backlog of unwritten events over the limit
            h.writer.submit(event_of(done(ctx_of(t, "acme"), 1)))
        h.writer.max_buffer = 1
        h.writer._stop = False
        with pytest.raises(MeteringUnavailableError, match="behind"):
            h.check_admitting()
        h.writer.max_buffer = 100_000
        await h.close()

    asyncio.run(main())


def test_the_shutdown_drain_is_the_writers_close_timeout(metering_factory):
    """`--usage-drain-timeout`: how long closing keeps writing the journal to the database."""
    h = metering_factory(drain_seconds=240.0)
    assert h.writer.close_timeout == 240.0
    asyncio.run(h.close())
    with pytest.raises(ValueError, match="drain_seconds"):
        UsageConfig(drain_seconds=-1)
