"""The LoRA manager over a worker's blob store: versions by digest, fetched on first use."""
from __future__ import annotations

import pytest

from loraplex.adapters.errors import AdapterNotFoundError
from loraplex.engine.errors import UnknownAdapterError
from loraplex.engine.request import AdapterRef


def test_prefetch_fetches_by_digest_and_drop_forgets(blob_engine):
    engine, digests = blob_engine
    lora = engine.lora
    d1 = digests["ad1"]
    assert lora.prefetch(d1).result(timeout=60) is None
    assert d1 in lora.tiers()["cpu"]
    assert lora.prefetch(d1).done()  # resident: answered at once
    assert lora.drop(d1) and d1 not in lora.tiers()["cpu"]
    assert not lora.drop(d1)


def test_a_missing_digest_fails_and_is_tried_again(blob_engine):
    lora = blob_engine[0].lora
    ghost = "sha256:" + "1" * 64
    for _ in range(2):  # a failure nobody holds is not remembered
        with pytest.raises(AdapterNotFoundError):
            lora.prefetch(ghost).result(timeout=60)


def test_a_held_version_is_not_dropped(blob_engine):
    engine, digests = blob_engine
    lora, d2 = engine.lora, digests["ad2"]
    lora.prefetch(d2).result(timeout=60)
    lora.retain(AdapterRef("ad2", d2))
    assert not lora.drop(d2) and d2 in lora.tiers()["cpu"]
    lora.release(d2)
    assert lora.drop(d2)


def test_names_do_not_resolve_on_a_worker(blob_engine):
    with pytest.raises(UnknownAdapterError):
        blob_engine[0].lora.ref("ad1")


def test_a_caller_that_stops_waiting_leaves_the_load_to_the_others(blob_engine):
    """A client that leaves while its version's load is queued cancels its own wait only:
    the load still happens, and the next request for that version gets it."""
    engine, digests = blob_engine
    lora = engine.lora
    for d in digests.values():
        lora.drop(d)
    lora.prefetch(digests["ad1"])  # the loader thread is busy with this one...
    waiting = lora.prefetch(digests["ad2"])  # ...while this one is queued behind it
    waiting.cancel()
    assert lora.prefetch(digests["ad2"]).result(timeout=60) is None
    assert digests["ad2"] in lora.tiers()["cpu"]


def test_a_mixture_is_built_from_its_components_versions(blob_engine):
    """A worker resolves no names: the mixture's ref (from the wire) carries its
    components' digests, fetched from the store; its own digest is in no store."""
    from loraplex.engine.mixtures import mixture_ref

    engine, digests = blob_engine
    lora = engine.lora
    mix = mixture_ref([(AdapterRef("ad1", digests["ad1"]), 0.5), (AdapterRef("ad2", digests["ad2"]), 2.0)])
    with pytest.raises(AdapterNotFoundError):  # by its digest alone it cannot be had
        lora.prefetch(mix.digest).result(timeout=60)
    assert lora.prefetch(mix).result(timeout=60) is None
    assert mix.digest in lora.tiers()["cpu"]
    assert lora.residency()[mix.digest].tier == "cpu"
    lora.drop(mix.digest)
