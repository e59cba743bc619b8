"""A bounded share of the pool for shared affixes (``max_affix_tokens``), and the events a cache reports."""

from __future__ import annotations

import pytest

from acache.engine import EngineConfig, LLMEngine
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.helpers import run_engine

BASE = dict(gen_length=8, block_length=4, threshold=0.5)


def workload():
    """Four documents (20-token affixes at three positions), requests with their own anchor ratios and
    generation lengths, arriving at different steps."""
    prompts, params = [], []
    kinds = ["prefix", "infix", "suffix"]
    for i in range(12):
        prompts.append(layouts(seed=i % 4)[kinds[i % 3]])
        params.append(SamplingParams(gen_length=8 if i % 2 else 4, block_length=4, threshold=0.5,
                                     selector="attention", anchor_ratio=(0.1, 0.3, 0.5)[i % 3]))
    return prompts, params, [i // 2 for i in range(12)]


def engine(model, **config):
    return LLMEngine(model, EngineConfig(page_size=4, kv_cache_memory=1 << 24, max_num_seqs=3, **config))


def test_capped_affixes_keep_every_answer_and_stay_under_the_cap(llada_model):
    prompts, params, arrivals = workload()
    roomy = run_engine(llada_model, prompts, params, arrivals, engine=engine(llada_model))
    capped = engine(llada_model, max_affix_tokens=40)  # two 20-token affixes: 10 pages of 4
    seen = []
    capped.affixes.listeners.append(seen.append)
    high = []
    original = capped.affixes.storage.put

    def put(entry):
        handle = original(entry)
        high.append(capped.affixes.storage.used)
        return handle

    capped.affixes.storage.put = put
    outs = run_engine(llada_model, prompts, params, arrivals, engine=capped)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert max(high) <= 10 and capped.affixes.stats.evictions > 0
    stored = [e for e in seen if e.kind == "stored"]
    evicted = [e for e in seen if e.kind == "evicted"]
    assert len(stored) == capped.affixes.stats.misses and len(evicted) == capped.affixes.stats.evictions
    held = set()
    for e in seen:  # replayed in order, the events name exactly what the cache holds
        held = held | {e.key} if e.kind == "stored" else held - {e.key}
    assert held == set(capped.affixes.entries)
    assert all(e.num_tokens == 20 for e in seen)


def test_an_affix_longer_than_the_cap_is_computed_with_its_request(llada_model):
    prompt = layouts(affix_len=40)["prefix"]
    params = SamplingParams(**BASE, selector="attention", anchor_ratio=0.2)
    capped = engine(llada_model, max_affix_tokens=16)
    out = run_engine(llada_model, [prompt, prompt], [params, params], [0, 1], engine=capped)
    assert len(capped.affixes) == 0 and capped.affixes.stats.queries == 0
    plain = run_engine(llada_model, [prompt], [SamplingParams(**BASE)], engine=engine(llada_model))
    assert out[0].token_ids == out[1].token_ids == plain[0].token_ids


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_a_bad_cap_is_refused(llada_model, bad):
    with pytest.raises(ValueError, match="max_affix_tokens must be a positive integer"):
        engine(llada_model, max_affix_tokens=bad)


def test_two_affixes_that_fit_the_cap_only_apart_never_stall(llada_model):
    """An 8- and a 20-token affix under a 20-token cap: the first is shared, the second computed with its
    request (it could only fit by evicting what the same request holds), and nothing waits for ever."""
    prompt = layouts(affix_len=20)["two-affix"]  # an 8-token system affix, then the 20-token document
    params = SamplingParams(**BASE, selector="attention", anchor_ratio=0.2)
    capped = engine(llada_model, max_affix_tokens=20)
    outs = run_engine(llada_model, [prompt, prompt], [params, params], [0, 2], engine=capped)
    assert len(outs) == 2 and outs[0].token_ids == outs[1].token_ids
    assert [len(e.token_ids) for e in capped.affixes.entries.values()] == [8]


def test_a_capped_cache_evicts_nothing_it_cannot_use(llada_model):
    """Room the pinned affixes leave under the cap is short: the unpinned ones stay instead of being thrown out."""
    capped = engine(llada_model, max_affix_tokens=40)  # 10 pages of 4
    table = capped.affixes
    held, _ = table.acquire(list(range(1, 21)))  # 5 pages, held by a request
    free, _ = table.acquire(list(range(30, 46)))  # 4 pages, released below
    table.release(free)
    assert not table.evict_until(6) and len(table) == 2  # 5 pinned + 6 > 10: evicting would not help
    assert table.evict_until(5) and len(table) == 1 and table.storage.used == 5
    table.release(held)
