"""The affix store: collision guard, refcounts and LRU under a byte budget (persistence: test_persistence)."""

from __future__ import annotations

import pytest

from acache.affix.store import AffixStore


@pytest.fixture(scope="module")
def model(llada_dir):
    from acache.models.loader import load_model

    return load_model(llada_dir)


def test_hit_miss_and_verification(model):
    store = AffixStore(model)
    a, hit = store.acquire([1, 2, 3, 4])
    assert not hit and a.refcount == 1 and len(store) == 1
    b, hit = store.acquire((1, 2, 3, 4))
    assert hit and b is a and a.refcount == 2
    store.release(a)
    store.release(b)
    assert a.refcount == 0 and store.stats.hits == 1 and store.stats.misses == 1
    with pytest.raises(RuntimeError, match="released more often"):
        store.release(a)


def test_same_hash_different_ids_is_a_miss(model):
    store = AffixStore(model, key_fn=lambda ids: "same-hash")
    first, _ = store.acquire([5, 6, 7])
    second, hit = store.acquire([8, 9])
    assert not hit and second.transient and second.token_ids == (8, 9)
    assert store.entries["same-hash"] is first and first.token_ids == (5, 6, 7)
    assert store.stats.collisions == 1
    again, hit = store.acquire([5, 6, 7])
    assert hit and again is first


def test_budget_lru_and_referenced_entries_survive(model):
    one = AffixStore(model).compute([1] * 10).nbytes()
    store = AffixStore(model, max_bytes=3 * one)
    held, _ = store.acquire([1] * 10)
    for t in (2, 3):
        e, _ = store.acquire([t] * 10)
        store.release(e)
    assert store.nbytes == 3 * one
    store.acquire([2] * 10)  # touch 2 so that 3 is the least recently used free entry
    store.release(store.entries[store.key_fn([2] * 10)])
    e4, hit = store.acquire([4] * 10)
    assert not hit and not e4.transient
    assert [1] * 10 in store and [2] * 10 in store and [3] * 10 not in store and [4] * 10 in store
    assert store.nbytes <= 3 * one and store.stats.evictions == 1
    # everything else held: a new affix cannot fit, and is handed out uncached rather than evicting
    store.acquire([2] * 10)
    e5, _ = store.acquire([5] * 10)
    assert e5.transient and [5] * 10 not in store and held.refcount == 1 and [1] * 10 in store
    assert store.nbytes <= 3 * one
    store.release(e5)  # releasing a transient entry is harmless


def test_affix_longer_than_context_and_empty(model):
    store = AffixStore(model)
    with pytest.raises(ValueError, match="more than the model's context of 512"):
        store.compute([1] * 600, name="book")
    with pytest.raises(ValueError, match="empty"):
        store.compute([])


def test_a_budgeted_store_without_hidden_states_refuses_to_grow_them(llada_model):
    """BiCache adds the affix-alone hidden states to an entry; a budgeted store built without them does not count
    them, so it went past its budget (133,120 bytes in 81,920). It refuses by name; one that keeps them, or has no
    budget, gives them."""
    ids = list(range(3, 23))
    lean = AffixStore(llada_model, max_bytes=AffixStore(llada_model).storage.cost(20))
    entry, _ = lean.acquire(ids)
    with pytest.raises(ValueError, match="build it with keep_hidden=True"):
        lean.ensure_hidden(entry)
    assert entry.hidden is None and lean.nbytes <= lean.max_bytes
    for store in (AffixStore(llada_model), AffixStore(llada_model, max_bytes=1 << 30, keep_hidden=True)):
        got, _ = store.acquire(ids)
        assert store.ensure_hidden(got).hidden is not None and store.nbytes <= (store.max_bytes or store.nbytes)
    # an engine over such a store refuses the BiCache request when it is added, not inside a step, where it sat at
    # the head of the queue and every step raised on it, the requests behind it stuck
    from acache.affix.prompt import AffixPrompt
    from acache.engine import EngineConfig, LLMEngine
    from acache.sampling_params import SamplingParams

    engine = LLMEngine(llada_model, EngineConfig(kv_cache_memory=1 << 22), affix_source=lean)
    prompt = AffixPrompt.from_spans([*ids, 40, 41], None, [(0, 20)])
    with pytest.raises(ValueError, match="build it with keep_hidden=True"):
        engine.add_request(prompt, SamplingParams(gen_length=4, block_length=4, selector="bicache-matched"))
    rid = engine.add_request(prompt, SamplingParams(gen_length=4, block_length=4, selector="attention"))
    done = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid] and done[0].error is None
