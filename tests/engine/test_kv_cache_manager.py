"""The KV-cache manager's page accounting: what a request is admitted with, what it may evict, and what is
counted and kept for it once it has gone."""

from __future__ import annotations

import torch

from acache.affix.prompt import AffixPrompt
from acache.engine import EngineConfig, LLMEngine
from acache.engine.page_pool import page_bytes
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.helpers import run_engine

PAGE = 4


def engine(model, pages: int, **config) -> LLMEngine:
    """An engine whose pool holds exactly ``pages`` pages of four tokens."""
    memory = pages * page_bytes(model.config, PAGE, model.dtype)
    return LLMEngine(model, EngineConfig(page_size=PAGE, kv_cache_memory=memory, **config))


def params(gen_length: int, ratio: float = 0.3) -> SamplingParams:
    return SamplingParams(gen_length=gen_length, block_length=4, threshold=0.5, selector="attention",
                          anchor_ratio=ratio)


def test_a_request_that_fits_the_pool_only_without_sharing_runs_without_sharing(llada_model):
    """Shared, the affix's pages and its anchors' private pages round up separately, past a pool its canvas
    alone fits: it is computed with its request, as with no reuse, not refused."""
    prompt, p = layouts(affix_len=20)["prefix"], params(8)
    roomy = engine(llada_model, 64)
    roomy.add_request(prompt, p)
    [req] = roomy.scheduler.waiting
    alone = roomy.pool.pages_for(req.length)
    shared = 5 + roomy.pool.pages_for(req.private_tokens([0]))
    assert shared > alone  # the case: sharing needs more pages than the whole canvas
    tight = engine(llada_model, alone)
    [out] = run_engine(llada_model, [prompt], [p], engine=tight)
    plain = run_engine(llada_model, [prompt], [SamplingParams(gen_length=8, block_length=4, threshold=0.5)])
    assert out.error is None and out.token_ids == plain[0].token_ids and len(tight.affixes) == 0


def test_an_affix_twice_in_one_prompt_takes_its_pages_once(llada_model):
    g = torch.Generator().manual_seed(3)
    aff, q1, q2 = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 4, 6))
    twice = AffixPrompt.from_spans(aff + q1 + aff + q2, None, [(0, 20), (24, 44)])
    once = AffixPrompt.from_spans(aff + q2, None, [(0, 20)])
    probe = engine(llada_model, 64)
    probe.add_request(twice, params(8, 0.2))
    [req] = probe.scheduler.waiting
    need = 5 + probe.pool.pages_for(req.private_tokens([0, 1]))
    assert probe.kv.pages_needed_alone(req) == need
    tight = engine(llada_model, need)
    outs = run_engine(llada_model, [twice, once], [params(8, 0.2), params(4, 0.5)], [0, 3], engine=tight)
    alone = [run_engine(llada_model, [p], [q], engine=engine(llada_model, 64))[0]
             for p, q in ((twice, params(8, 0.2)), (once, params(4, 0.5)))]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert tight.pool.peak_pages_used <= need and len(tight.affixes) == 1


def test_a_waiting_request_evicts_no_affix_when_evicting_cannot_admit_it(llada_model):
    story, other = layouts(affix_len=20, seed=0)["prefix"], layouts(affix_len=20, seed=1)["prefix"]
    e = engine(llada_model, 20)
    run_engine(llada_model, [other], [params(4)], engine=e)  # leaves its affix cached, held by no one
    e.add_request(story, params(24, 0.2))
    e.step()
    e.add_request(story, params(32))  # needs more pages than the free ones and the idle affix's together
    waiting = e.scheduler.waiting[0]
    need = e.pool.pages_for(waiting.private_tokens([0]))
    assert e.pool.num_free + e.affixes.reclaimable_pages() < need
    e.step()
    assert e.num_waiting == 1 and e.affixes.stats.evictions == 0 and len(e.affixes) == 2
    outs = []
    while e.has_unfinished():
        outs += [o for o in e.step() if o.finished]
    assert e.affixes.stats.evictions == 1  # once the first request left, evicting it made room, and it was
    alone = run_engine(llada_model, [story, story], [params(24, 0.2), params(32)], engine=engine(llada_model, 64))
    assert sorted(o.token_ids for o in outs) == sorted(o.token_ids for o in alone)


def test_an_idle_affix_is_not_evicted_for_a_request_that_still_cannot_be_admitted(llada_model):
    """An idle affix's pages and the free ones together hold a new affix but not the request's own pages beside it:
    the idle affix stays (it was evicted, the new affix computed, and the request waited all the same)."""
    idle, story, plain = (layouts(affix_len=20, seed=s)["prefix"] for s in (6, 7, 8))
    e = engine(llada_model, 20)
    run_engine(llada_model, [idle], [params(4)], engine=e)  # its affix stays cached, held by no one
    kept = set(e.affixes.entries)
    e.add_request(plain.token_ids, SamplingParams(gen_length=20, block_length=4, threshold=0.5))  # 12 pages
    e.step()
    rid = e.add_request(story, params(8, 0.2))
    waiting = e.scheduler.waiting[0]
    free, new, own = e.pool.num_free, e.pool.pages_for(20), e.pool.pages_for(waiting.private_tokens([0]))
    assert free + e.affixes.reclaimable_pages() >= new and free + e.affixes.reclaimable_pages() < new + own
    e.step()
    assert e.num_waiting == 1 and set(e.affixes.entries) == kept and e.affixes.stats.evictions == 0
    outs = {}
    while e.has_unfinished():
        outs |= {o.request_id: o for o in e.step() if o.finished}
    alone = run_engine(llada_model, [story], [params(8, 0.2)], engine=engine(llada_model, 64))
    assert outs[rid].token_ids == alone[0].token_ids


def test_a_request_that_waited_counts_one_affix_query(llada_model):
    story = layouts(affix_len=20)["prefix"]
    e = engine(llada_model, 16)
    ps = [params(16), params(12, 0.2)]
    first, second = (e.add_request(story, p) for p in ps)
    e.step()
    assert e.num_waiting == 1  # the second waits for pages while the first runs
    outs = {}
    while e.has_unfinished():
        outs |= {o.request_id: o for o in e.step() if o.finished}
    summary = e.summary()
    assert (summary["affix_hits"], summary["affix_queries"]) == (1, 2)
    assert (outs[first].stats.affix_hits, outs[second].stats.affix_hits) == (0, 1)


def test_a_request_that_left_keeps_no_step_keys(llada_model):
    prompts = [layouts(affix_len=20, seed=s)["infix"] for s in (0, 1, 2)]
    e = engine(llada_model, 128, reuse_step_keys=True)
    outs = run_engine(llada_model, prompts[:2], [params(8), params(16, 0.2)], [0, 2], engine=e)
    assert len(outs) == 2 and e.runner.step_keys.entries == {} and e.runner.step_keys._stacks == {}
    rid = e.add_request(prompts[2], params(16))
    while not e.runner.step_keys.entries:
        e.step()
    assert e.abort(rid)
    assert e.runner.step_keys.entries == {} and e.runner.step_keys._stacks == {}


def test_a_request_that_cannot_be_admitted_computes_no_affix(llada_model):
    """The first try would find room for the affix but not for the request's own pages: it computes nothing (it
    used to compute and keep the affix, then wait); the try that admits it computes it: one lookup, a miss."""
    story, other = layouts(affix_len=20, seed=4)["prefix"], layouts(affix_len=20, seed=5)["prefix"]
    e = engine(llada_model, 20)
    e.add_request(other, params(24))
    e.step()  # holds 14 of the 20 pages: room for the second affix's 5, not for its request's own
    rid = e.add_request(story, params(8, 0.2))
    e.step()
    assert e.num_waiting == 1 and len(e.affixes) == 1
    outs = {}
    while e.has_unfinished():
        outs |= {o.request_id: o for o in e.step() if o.finished}
    assert (e.affixes.stats.hits, e.affixes.stats.misses) == (0, 2)
    assert outs[rid].stats.affix_hits == 0


def test_an_admission_never_evicts_a_cached_affix_of_its_own(llada_model):
    """Admitting [A][B] with B cached and idle and room for A only once C goes: acquiring A first evicted B (least
    recently used) and computed it again; the cached ones are held first, so only C goes."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, 200, (16,), generator=gen).tolist() for _ in range(3))
    question = [5, 6]

    def prompt(*affixes):
        ids, spans = [], []
        for affix in affixes:
            spans.append((len(ids), len(ids) + len(affix)))
            ids += affix
        return AffixPrompt.from_spans(ids + question, None, spans)

    eng = engine(llada_model, 10)
    first = SamplingParams(gen_length=4, block_length=4, selector="none")
    for p in (prompt(b), prompt(c)):  # B, then C: B is the least recently used
        run_engine(llada_model, [p], [first], engine=eng)
    computed = []
    compute = eng.affixes.compute
    eng.affixes.compute = lambda ids, name=None: computed.append(tuple(ids)) or compute(ids, name)
    out = run_engine(llada_model, [prompt(a, b)], [SamplingParams(gen_length=4, block_length=2, selector="none")],
                     engine=eng)[0]
    assert computed == [tuple(a)] and out.stats.affix_hits == 1
    assert eng.affixes.stats.evictions == 1 and eng.affixes.lookup(tuple(b)) is not None
    alone = run_engine(llada_model, [prompt(a, b)], [SamplingParams(gen_length=4, block_length=2, selector="none")],
                       kv_cache_memory=1 << 24)[0]
    assert out.token_ids == alone.token_ids
