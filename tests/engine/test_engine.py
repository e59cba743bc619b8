"""The engine against the reference path, token for token; pages, admission, abort, contained faults."""

from __future__ import annotations

import logging

import pytest
import torch

from acache.affix.store import AffixStore
from acache.engine import EngineConfig, LLMEngine, Status
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.helpers import fail_proposals_of, run_engine

BASE = dict(gen_length=16, block_length=8, threshold=0.5)


def run_all(engine, requests):
    """``requests`` as ``(prompt, params, generator)``, all arriving together."""
    prompts, params, gens = zip(*requests, strict=True)
    return run_engine(engine.model, list(prompts), list(params), engine=engine, generators=gens)


def mixed_requests(n, params, seed=0):
    kinds = ["prefix", "infix", "suffix", "two-affix"]
    pool = [layouts(seed=seed)[k] for k in kinds] + [layouts(seed=seed + 1)[k] for k in kinds]
    return [(pool[i % len(pool)], params, None) for i in range(n)]


@pytest.mark.parametrize("selector", ["attention", "none", "all", "random"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_engine_matches_single_request_path(family_model, selector, batch):
    """Sixteen requests of every layout, at three shapes of two blocks each, three ratios and two thresholds,
    arriving over the first steps: each as the reference path decodes it alone."""
    shapes = [dict(gen_length=16, block_length=8), dict(gen_length=8, block_length=4),
              dict(gen_length=32, block_length=16)]
    params = [SamplingParams(**shapes[i % 3], threshold=(0.5, 0.7)[i % 2], selector=selector,
                             anchor_ratio=(0.3, 0.5, 0.1)[i % 3], ignore_eos=True) for i in range(16)]
    requests = [(prompt, p, None) for (prompt, _, _), p in zip(mixed_requests(16, params[0]), params, strict=True)]
    engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24, max_num_seqs=batch))
    outs = run_engine(family_model, [r[0] for r in requests], params, arrivals=[i // 3 for i in range(16)],
                      engine=engine)
    store = AffixStore(family_model)
    for (prompt, sp, _), out in zip(requests, outs, strict=True):
        ref = reference_generate(family_model, prompt, sp, store)
        assert out.token_ids == ref.token_ids
        assert out.anchors == ref.anchors
        assert (out.nfe, out.refreshes) == (ref.nfe, ref.refreshes)
        assert out.affix_tokens == sum(a.length for a in prompt.affixes)  # what it shared, read before freeing
    summary = engine.summary()
    assert summary["requests_finished"] == 16 and summary["kv_pages_in_use"] == engine.affixes.pages_in_use
    assert summary["affix_hits"] >= 16 and summary["affix_queries"] == 20
    m = engine.metrics  # two blocks a request: one time to first block, one gap between blocks, one whole
    assert (m.first_block_times.count, m.inter_block_times.count, m.request_times.count) == (16, 16, 16)
    assert m.request_times.total_s >= m.first_block_times.total_s > 0


def test_engine_without_reuse_is_the_dual_cache(family_model):
    params = SamplingParams(**BASE)
    requests = mixed_requests(6, params)
    outs = run_all(LLMEngine(family_model, EngineConfig(page_size=8, kv_cache_memory=1 << 24)), requests)
    for (prompt, _, _), out in zip(requests, outs, strict=True):
        assert out.token_ids == reference_generate(family_model, prompt, params).token_ids


def test_sampling_with_per_request_generators(llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    params = SamplingParams(**BASE, temperature=1.0, selector="attention")
    prompts = [layouts()["prefix"], layouts()["suffix"]]
    engine = LLMEngine(model, EngineConfig(page_size=4, kv_cache_memory=1 << 22))
    outs = run_all(engine, [(p, params, torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)])
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        ref = reference_generate(model, p, params, generator=torch.Generator().manual_seed(i))
        assert out.token_ids == ref.token_ids


def test_memory_grows_by_private_tokens_not_by_the_affix(llada_dir):
    """N requests sharing one affix: one copy of its pages, plus per request only its anchors and own tokens."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    page = 4
    prompt = layouts(affix_len=40, question_len=6)["prefix"]  # 40-token affix, 6 own tokens, 16 generated
    params = SamplingParams(**BASE, selector="attention", anchor_ratio=0.2)
    shared_pages = -(-40 // page)
    private_pages = -(-(8 + 6 + 16) // page)  # ceil(0.2 * 40) anchors + question + generation region
    for n in (1, 3, 6):
        engine = LLMEngine(model, EngineConfig(page_size=page, kv_cache_memory=1 << 24, max_num_seqs=n))
        run_all(engine, [(prompt, params, None)] * n)
        assert engine.pool.peak_pages_used == shared_pages + n * private_pages
    no_reuse = LLMEngine(model, EngineConfig(page_size=page, kv_cache_memory=1 << 24, max_num_seqs=6))
    run_all(no_reuse, [(prompt, SamplingParams(**BASE), None)] * 6)
    assert no_reuse.pool.peak_pages_used == 6 * -(-(40 + 6 + 16) // page)


def test_too_few_pages_still_completes_every_request(family_model):
    params = SamplingParams(**BASE, selector="attention", anchor_ratio=0.3)
    requests = mixed_requests(10, params)
    roomy = run_all(LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24)), requests)
    page_bytes = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 20)).pool.page_bytes
    tight = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=40 * page_bytes))
    assert tight.pool.num_pages == 40
    outs = run_all(tight, requests)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.pool.peak_pages_used <= 40 and tight.affixes.stats.evictions > 0


def test_request_larger_than_the_pool_is_refused(llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    one_page = LLMEngine(model, EngineConfig(page_size=4, kv_cache_memory=1 << 20)).pool.page_bytes
    engine = LLMEngine(model, EngineConfig(page_size=4, kv_cache_memory=one_page))
    with pytest.raises(ValueError, match="more than the whole pool"):
        engine.add_request(layouts()["prefix"], SamplingParams(**BASE))
    assert not engine.has_unfinished()


def test_abort_frees_pages_and_shared_pages_are_never_written(llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    engine = LLMEngine(model, EngineConfig(page_size=4, kv_cache_memory=1 << 22, max_num_seqs=1))
    params = SamplingParams(**BASE, selector="attention")
    a = engine.add_request(layouts()["prefix"], params)
    b = engine.add_request(layouts()["suffix"], params)
    engine.step()
    engine.step()
    shared = next(iter(engine.affixes.entries.values()))
    before = [k[shared.slots].clone() for k in engine.pool.keys]
    engine.step()
    assert all(torch.equal(k[shared.slots], b0) for k, b0 in zip(engine.pool.keys, before, strict=True))
    assert engine.num_running == 1 and engine.num_waiting == 1
    assert engine.abort(b)  # waiting
    assert engine.abort(a)  # running
    assert not engine.abort("nope")
    assert not engine.has_unfinished()
    assert engine.pool.num_used == engine.affixes.pages_in_use  # only the (now unreferenced) affix remains
    assert all(e.refcount == 0 for e in engine.affixes.entries.values())
    assert engine.step() == [] and engine.summary()["requests_aborted"] == 2


def test_bad_requests(llada_dir):
    from acache.models.loader import load_model

    engine = LLMEngine(load_model(llada_dir), EngineConfig(kv_cache_memory=1 << 22))
    with pytest.raises(ValueError, match="needs a BiCache profile"):
        engine.add_request(layouts()["prefix"], SamplingParams(**BASE, selector="bicache-profiled"))
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        engine.add_request([1, 2], {"gen_length": 8})
    with pytest.raises(ValueError, match="too long"):
        engine.add_request([1] * 600, SamplingParams(**BASE))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 99999], SamplingParams(**BASE))
    engine.add_request([1, 2], SamplingParams(**BASE), request_id="x")
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request([1, 2], SamplingParams(**BASE), request_id="x")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine(load_model(llada_dir), EngineConfig(kv_cache_memory=10))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert [o.request_id for o in out] == ["x"] and out[0].status is Status.FINISHED


def test_an_id_the_engine_gives_never_clashes_with_one_a_caller_gave(llada_dir):
    """A caller named a request "req-0"; the next request without an id was refused as "already in the engine"."""
    from acache.models.loader import load_model

    engine = LLMEngine(load_model(llada_dir), EngineConfig(kv_cache_memory=1 << 22))
    taken = engine.add_request([3, 4], SamplingParams(**BASE), request_id="req-0")
    given = engine.add_request([5], SamplingParams(gen_length=8, block_length=8, threshold=0.5))
    assert given != taken and given.startswith("req-")
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert sorted(o.request_id for o in out if o.finished) == sorted([taken, given])


POISON = 300  # in the vocabulary, outside the random prompts' 0..255


def poisoned(model, monkeypatch, exc: Exception | None = None):
    """Makes every forward that embeds token POISON raise ``exc``, as a bad request's forward would."""
    exc = exc or ValueError("poisoned row")
    real = torch.nn.Embedding.forward

    def forward(self, input_ids):
        if (input_ids == POISON).any():
            raise exc
        return real(self, input_ids)

    monkeypatch.setattr(torch.nn.Embedding, "forward", forward)


@pytest.mark.parametrize("selector", [None, "attention", "bicache-matched"])
def test_a_fault_in_one_request_fails_it_alone(family_model, monkeypatch, selector):
    prompts = [layouts(seed=s)["infix"] for s in range(4)]
    bad = prompts[2]
    bad_ids = list(bad.token_ids)
    bad_ids[1] = POISON  # in the question, outside the affix: every refresh feeds it
    from acache.affix.prompt import AffixPrompt

    prompts[2] = AffixPrompt(tuple(bad_ids), bad.gen_at, bad.affixes)
    params = [SamplingParams(**BASE, selector=selector, anchor_ratio=0.3),
              SamplingParams(gen_length=8, block_length=4, selector=selector, anchor_ratio=0.6),
              SamplingParams(**BASE, selector=selector),
              SamplingParams(gen_length=24, block_length=8, threshold=0.7, selector=selector)]
    store = AffixStore(family_model)
    want = [reference_generate(family_model, p, sp, store).token_ids for p, sp in zip(prompts, params, strict=True)
            if p is not prompts[2]]
    poisoned(family_model, monkeypatch)
    engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24), affix_source=store)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    failed = outs[ids[2]]
    assert failed.status is Status.FAILED and "poisoned row" in failed.error and failed.token_ids == []
    assert [outs[i].token_ids for i in ids if i != ids[2]] == want
    assert all(outs[i].status is Status.FINISHED for i in ids if i != ids[2])
    assert engine.pool.num_used == engine.affixes.pages_in_use  # nothing private left behind
    assert all(e.refcount == 0 for e in engine.affixes.entries.values())
    assert all(e.refcount == 0 for e in store.entries.values())
    assert engine.summary()["requests_failed"] == 1 and engine.summary()["requests_finished"] == 3


@pytest.mark.parametrize("anchor_pass", ["one", "two"])
def test_a_selector_fault_fails_its_request_alone(llada_dir, monkeypatch, caplog, anchor_pass):
    """A selection that raises for one request, in a pass of its own or inside the refresh, fails that request
    alone; the other decodes as it would alone, and none of the pool's pages is lost."""
    from acache.affix.selectors.attention import AttentionAnchors
    from acache.engine import model_runner
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    real_scores, real_refresh = AttentionAnchors.scores, model_runner.refresh_selecting

    def scores(self, ctx):
        if (ctx.canvas.tokens == POISON).any():
            raise RuntimeError("selector broke on this request")
        return real_scores(self, ctx)

    def refresh(model, tokens, *args):
        if (tokens == POISON).any():
            raise RuntimeError("selector broke on this request")
        return real_refresh(model, tokens, *args)

    monkeypatch.setattr(AttentionAnchors, "scores", scores)
    monkeypatch.setattr(model_runner, "refresh_selecting", refresh)
    good = layouts(seed=1)["prefix"]
    from acache.affix.prompt import AffixPrompt

    bad = AffixPrompt(good.token_ids[:-1] + (POISON,), good.gen_at, good.affixes)
    params = SamplingParams(**BASE, selector="attention", anchor_pass=anchor_pass)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22))
    with caplog.at_level(logging.WARNING, logger="acache.engine.model_runner"):
        outs = run_all(engine, [(good, params, None), (bad, params, None)])
    assert "a forward of 2 requests failed (RuntimeError: selector broke on this request); running each alone" \
        in caplog.text  # said once a step, not swallowed
    assert outs[0].status is Status.FINISHED
    assert outs[0].token_ids == reference_generate(model, good, params).token_ids
    assert outs[1].status is Status.FAILED and outs[1].error == "RuntimeError: selector broke on this request"
    assert engine.pool.num_used == sum(len(e.pages) for e in engine.affixes.entries.values())


def test_an_engine_fault_is_raised(llada_dir, monkeypatch):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    poisoned(model, monkeypatch, MemoryError("out of memory"))
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22))
    engine.add_request([1, 2, POISON], SamplingParams(**BASE))
    engine.add_request([1, 2, 3], SamplingParams(**BASE))
    with pytest.raises(MemoryError):
        while engine.has_unfinished():
            engine.step()


def failing_affix_computation(monkeypatch, fault) -> None:
    """Computing an affix raises ``fault(call, token_ids)`` where that returns an exception (``call`` counts the
    computations from 1)."""
    from acache.affix import cache

    real, calls = cache.compute_affix, []

    def compute(model, token_ids, *args, **kwargs):
        calls.append(1)
        exc = fault(len(calls), tuple(token_ids))
        if exc is not None:
            raise exc
        return real(model, token_ids, *args, **kwargs)

    monkeypatch.setattr(cache, "compute_affix", compute)


@pytest.mark.parametrize("policy", ["attention", "bicache-matched"])
def test_a_fault_while_computing_an_affix_at_admission_leaks_nothing(llada_dir, monkeypatch, policy):
    """Computing the second affix raises: the first is released and no page stays taken, and an abort of
    the waiting request is safe."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22))
    failing_affix_computation(monkeypatch, lambda call, ids: MemoryError("out of memory while computing an affix")
                              if call == 2 else None)
    rid = engine.add_request(layouts()["two-affix"], SamplingParams(**BASE, selector=policy))
    with pytest.raises(MemoryError):
        engine.step()
    assert engine.pool.num_used == engine.affixes.pages_in_use  # only unreferenced cached affixes hold pages
    assert all(e.refcount == 0 for e in engine.affixes.entries.values())
    assert all(e.refcount == 0 for e in engine.kv.store.entries.values())
    assert engine.abort(rid) and not engine.has_unfinished()
    assert engine.pool.num_used == engine.affixes.pages_in_use


def test_an_affix_a_failed_admission_computed_counts_as_the_requests_miss(llada_dir, monkeypatch):
    """The second affix's computation fails once and the request is admitted at the next step: the first affix,
    which its own failed try computed, was counted a hit (two queries, one hit), and the failed try's lookups
    counted again (four queries)."""
    from acache.models.loader import load_model

    engine = LLMEngine(load_model(llada_dir), EngineConfig(kv_cache_memory=1 << 22))
    failing_affix_computation(monkeypatch, lambda call, ids: MemoryError("out of memory while computing an affix")
                              if call == 2 else None)
    engine.add_request(layouts()["two-affix"], SamplingParams(**BASE, selector="attention"))
    with pytest.raises(MemoryError):
        engine.step()
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    [out] = done
    assert out.status == Status.FINISHED and out.stats.affix_hits == 0
    summary = engine.summary()
    assert (summary["affix_queries"], summary["affix_hits"]) == (2, 0)


@pytest.mark.parametrize("where", ["affix", "anchors"])
def test_an_error_admitting_one_request_fails_it_alone(llada_dir, monkeypatch, where):
    """Computing one request's affix, or choosing its anchors at admission, raises an error of its own (not of the
    machine): every step raised it, the request stayed at the head of the queue and nothing else ever stepped
    again. Now that request fails alone, and the others, running before it and arriving after it with other
    parameters, decode as each does alone."""
    from acache.engine.request import Request
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    prompts = [layouts(seed=1)["prefix"].token_ids, layouts(seed=2)["infix"], layouts(seed=3)["suffix"]]
    params = [SamplingParams(gen_length=16, block_length=8, threshold=0.5),
              SamplingParams(**BASE, selector="attention" if where == "affix" else "random", anchor_ratio=0.3),
              SamplingParams(gen_length=8, block_length=8, steps=8, selector="cacheblend", anchor_ratio=0.5,
                             temperature=1.0, seed=5)]
    alone = [run_engine(model, [p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    bad = tuple(prompts[1].affix_ids(prompts[1].affixes[0]))
    if where == "affix":
        failing_affix_computation(monkeypatch, lambda call, ids: ValueError("a fault of this affix alone")
                                  if ids == bad else None)
    else:
        real = Request.admission_anchors

        def failing(self):
            if self.params.selector == "random":
                raise ValueError("a fault of this request alone")
            return real(self)

        monkeypatch.setattr(Request, "admission_anchors", failing)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    out = run_engine(model, prompts, params, arrivals=[0, 1, 3], engine=engine)
    assert out[1].status == Status.FAILED and "ValueError: a fault of this" in out[1].error
    assert out[1].token_ids == []
    assert [out[0].token_ids, out[2].token_ids] == [alone[0], alone[2]]
    assert engine.metrics.requests_failed == 1 and engine.metrics.requests_finished == 2
    assert not engine.has_unfinished() and engine.pool.num_used == engine.affixes.pages_in_use
    assert all(e.refcount == 0 for e in engine.affixes.entries.values())


def test_a_request_failed_alone_before_a_fault_of_the_machine_in_the_same_admission_is_delivered(llada_dir,
                                                                                                  monkeypatch):
    """One request's affix fails alone, the next one's runs out of memory in the same admission: the first is out of
    the engine already, so a caller that fails what the engine holds would miss it; its output is kept for
    take_undelivered, as a failed step's are."""
    from acache.models.loader import load_model

    engine = LLMEngine(load_model(llada_dir), EngineConfig(kv_cache_memory=1 << 24))
    prompts = [layouts(seed=1)["prefix"], layouts(seed=2)["infix"]]
    faults = {tuple(p.affix_ids(p.affixes[0])): fault for p, fault in
              zip(prompts, (ValueError("a fault of this affix alone"), MemoryError("out of memory")), strict=True)}
    failing_affix_computation(monkeypatch, lambda call, ids: faults.get(ids))
    first = engine.add_request(prompts[0], SamplingParams(**BASE, selector="attention"))
    second = engine.add_request(prompts[1], SamplingParams(**BASE, selector="cacheblend", anchor_ratio=0.5))
    with pytest.raises(MemoryError):
        engine.step()
    [out] = engine.take_undelivered()
    assert out.request_id == first and out.status is Status.FAILED and "a fault of this affix alone" in out.error
    assert engine.abort(second) and not engine.has_unfinished()
    assert engine.pool.num_used == engine.affixes.pages_in_use


def test_anchor_query_splits_selection_only_where_a_selector_reads_it(family_model, monkeypatch):
    """Requests arriving together share one selection batch per selector; ``anchor_query`` splits it only for
    the selectors that read it (ACache's), and each request still decodes as alone."""
    from acache.engine import model_runner

    asked = []
    real = model_runner.make_selector
    monkeypatch.setattr(model_runner, "make_selector", lambda name, query: asked.append((name, query)) or
                        real(name, query))
    prompts = list(layouts().values())
    params = [SamplingParams(**BASE, selector=s, anchor_query=q, anchor_ratio=r, anchor_pass="two")
              for s, q, r in (("cacheblend", "probe", 0.3), ("cacheblend", "full", 0.2),
                              ("attention", "probe", 0.3), ("attention", "shallow", 0.3))]
    engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24))
    outs = run_engine(family_model, prompts, params, engine=engine)
    assert sorted(asked) == [("attention", "probe"), ("attention", "shallow"), ("cacheblend", "probe")]
    store = AffixStore(family_model)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        ref = reference_generate(family_model, prompt, p, store)
        assert (out.token_ids, out.anchors) == (ref.token_ids, ref.anchors)


def test_a_selector_that_needs_no_forward_chooses_at_admission(family_model, monkeypatch):
    """``random``, ``first-k`` and ``all`` score from the layout alone: their requests take no selection step
    (the runner's selection, its canvas and its placed K/V, never sees them) and decode as on the reference
    path, anchors included; a ``probe_step`` request of theirs still runs its probe, and a selector that scores
    with a forward its pass. Mixed selectors, ratios, lengths, layouts and far-mask windows, arriving staggered."""
    from acache.engine.model_runner import ModelRunner

    selected, real = [], ModelRunner._select
    monkeypatch.setattr(ModelRunner, "_select", lambda self, reqs: selected.extend(r.request_id for r in reqs) or
                        real(self, reqs))
    kinds = layouts()
    cases = [(kinds["prefix"], dict(BASE, selector="random", anchor_ratio=0.3, seed=1)),
             (kinds["infix"], dict(gen_length=8, block_length=4, selector="first-k", anchor_ratio=0.5)),
             (kinds["suffix"], dict(BASE, selector="all")),
             (kinds["two-affix"], dict(gen_length=24, block_length=8, threshold=0.7, selector="random",
                                       anchor_ratio=0.2, far_mask_window=1)),
             (layouts(seed=1)["prefix"], dict(BASE, selector="random", anchor_ratio=0.3, probe_step=True)),
             (layouts(seed=1)["infix"], dict(BASE, selector="attention", anchor_ratio=0.3, anchor_pass="two"))]
    prompts, params = [c for c, _ in cases], [SamplingParams(**kw) for _, kw in cases]
    engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24))
    outs = run_engine(family_model, prompts, params, arrivals=[0, 1, 0, 2, 1, 3], engine=engine)
    assert sorted(selected) == sorted(out.request_id for out in outs[4:])  # the probe, the pass; no other
    store = AffixStore(family_model)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        ref = reference_generate(family_model, prompt, sp, store)
        assert (out.token_ids, out.anchors) == (ref.token_ids, ref.anchors), sp
    # all: every affix column an anchor but those recomputed anyway (a block shared with the request's own columns)
    assert outs[2].cached_tokens == 0 and len(outs[2].anchors) <= sum(a.length for a in prompts[2].affixes)
    infix = prompts[1].affixes[0]  # EPIC's first tokens, ceil(0.5 * n) of them, past any the question's block holds
    block = family_model.config.block_size
    first = infix.start if block is None else -(-infix.start // block) * block
    assert outs[1].anchors == list(range(first, first + -(-infix.length // 2)))


def test_cached_tokens_are_the_affix_tokens_no_refresh_recomputes(family_model):
    """cached_tokens (the server's ``prompt_tokens_details.cached_tokens``) counts the shared affix tokens that
    every refresh reads from the shared copy: not the anchors, nor the affix columns recomputed beside the
    request's own, which a model's layout decides (blocks of 4 on the block-diffusion model: the affix's first
    and last columns share a block with the question or the region; on the shifted Dream model the column before
    the region). An infix and an affix just before the region, at different selectors and ratios, staggered."""
    from acache.affix.prompt import AffixPrompt

    ids = list(range(1, 16))
    infix = AffixPrompt.from_spans(ids, None, [(3, 13)])  # columns 3-12, the question 13-14, the region from 15
    before = AffixPrompt.from_spans(ids[:13], None, [(3, 13)])  # columns 3-12, the region from 13
    family = family_model.config.family
    beside = {"llada": (set(), set()), "dream": (set(), {12}), "fast_dllm_v2": ({3, 12}, {3, 12})}[family]
    cases = [(infix, dict(selector="random", anchor_ratio=0.2, seed=3), beside[0]),
             (before, dict(selector="none"), beside[1]),
             (infix, dict(selector="attention", anchor_ratio=0.3, gen_length=8, block_length=4), beside[0]),
             (before, dict(selector="all"), beside[1])]
    bicache = [(infix, dict(selector="bicache-matched", anchor_ratio=0.2)),  # the layers below its split: cached
               (before, dict(selector="bicache-matched", anchor_ratio=1.0))]  # every layer recomputed: none
    prompts = [p for p, _, _ in cases] + [p for p, _ in bicache]
    params = [SamplingParams(**{**BASE, **kw}) for _, kw, _ in cases] + [SamplingParams(**{**BASE, **kw})
                                                                         for _, kw in bicache]
    outs = run_engine(family_model, prompts, params, arrivals=[0, 1, 1, 2, 0, 2])
    for (_, kw, extra), out in zip(cases, outs[:4], strict=True):
        assert out.affix_tokens == 10 and not set(out.anchors) & extra  # no anchor where it is recomputed anyway
        assert out.cached_tokens == 10 - len(out.anchors) - len(extra), (family, kw)
    assert outs[3].cached_tokens == 0 and outs[1].cached_tokens == 10 - len(beside[1])
    layers = family_model.config.num_layers
    assert (outs[4].bicache_depth < layers, outs[5].bicache_depth) == (True, layers)
    # BiCache reads the layers below its split from the copy, but for the columns direct reuse recomputes too
    assert (outs[4].affix_tokens, outs[4].cached_tokens, outs[5].cached_tokens) == (10, 10 - len(beside[0]), 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_memory=0), "kv_cache_memory must be a positive integer or None, got 0"),
    (dict(kv_cache_memory=1.5), "kv_cache_memory must be a positive integer"),
    (dict(max_model_len=True), "max_model_len must be a positive integer or None, got True"),
    (dict(max_model_len=-3), "max_model_len must be a positive integer"),
    (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
])
def test_engine_config_refuses_bad_values_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_resolves_the_limit_and_the_budget_once(llada_model):
    assert EngineConfig().model_len(512) == 512 and EngineConfig(max_model_len=40).model_len(512) == 40
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in 1..512 \(the model's context\)"):
        EngineConfig(max_model_len=600).model_len(512)
    cpu = torch.device("cpu")
    assert EngineConfig().kv_budget(cpu) == 1 << 30 and EngineConfig(kv_cache_memory=1 << 20).kv_budget(cpu) == 1 << 20
    engine = LLMEngine(llada_model, EngineConfig(kv_cache_memory=1 << 22, max_model_len=64))
    assert engine.max_model_len == 64 and engine.pool.num_pages * engine.pool.page_size > 0
    with pytest.raises(ValueError, match="exceed the context of 64"):
        engine.add_request(list(range(1, 60)), SamplingParams(gen_length=16, block_length=8))


def _commit_fails_for(monkeypatch, engine, victim: str, exc: BaseException, after: str) -> None:
    """``victim``'s commit raises ``exc`` at the step that finished ``after`` (applied before it in that step)."""
    from acache.engine.scheduler import Scheduler

    real = Scheduler._commit

    def commit(self, req, sample, probe=False):
        finished = next((r for r in (*self.running, *finished_reqs) if r.request_id == after), None)
        if req.request_id == victim and finished is not None and finished.status is Status.FINISHED:
            raise exc
        out = real(self, req, sample, probe)
        if req.request_id == after and req.status is Status.FINISHED:
            finished_reqs.append(req)
        return out

    finished_reqs: list = []
    monkeypatch.setattr(Scheduler, "_commit", commit)


def test_an_error_applying_one_requests_step_fails_it_alone(llada_model, monkeypatch):
    """An error of one request's own while the step's results are applied (not in the forward, which the runner
    contains) fails that request alone: the one finished earlier in the same step keeps its output, the one after
    it (arriving a step later) decodes on as it would alone, and no page is lost."""
    prompts = [layouts(seed=s)["prefix"] for s in range(3)]
    params = [SamplingParams(gen_length=8, block_length=8, threshold=0.5, selector="attention"),
              SamplingParams(**BASE, selector="attention", anchor_ratio=0.3),
              SamplingParams(gen_length=24, block_length=8, threshold=0.7, selector="attention")]
    store = AffixStore(llada_model)
    want = [reference_generate(llada_model, p, sp, store).token_ids for p, sp in zip(prompts, params, strict=True)]
    engine = LLMEngine(llada_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24), affix_source=store)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2], strict=True)]
    _commit_fails_for(monkeypatch, engine, ids[1], ValueError("bad commit"), after=ids[0])
    outs = {out.request_id: out for out in engine.step()}
    ids.append(engine.add_request(prompts[2], params[2]))  # the third arrives a step later
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs[ids[1]].status is Status.FAILED and "ValueError: bad commit" in outs[ids[1]].error
    assert [outs[i].token_ids for i in (ids[0], ids[2])] == [want[0], want[2]]
    assert engine.pool.num_used == engine.affixes.pages_in_use
    assert all(e.refcount == 0 for e in engine.affixes.entries.values())


def test_a_fault_of_the_machine_mid_update_keeps_the_outputs_already_made(llada_model, monkeypatch):
    """A fault of the machine ends the step; a request the step had already finished is out of the engine, so its
    output is kept for the caller (take_undelivered), which fails the ones still held."""
    prompts = [layouts(seed=s)["prefix"] for s in range(2)]
    params = [SamplingParams(gen_length=8, block_length=8, threshold=0.5), SamplingParams(**BASE)]
    engine = LLMEngine(llada_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    _commit_fails_for(monkeypatch, engine, ids[1], MemoryError("out of memory"), after=ids[0])
    with pytest.raises(MemoryError):
        while engine.has_unfinished():
            engine.step()
    kept = engine.take_undelivered()
    assert [(o.request_id, o.status) for o in kept] == [(ids[0], Status.FINISHED)] and kept[0].token_ids
    assert engine.request_ids() == [ids[1]] and engine.take_undelivered() == []


def test_ignore_eos_decodes_the_whole_region_through_the_models_stops(family_model):
    """``ignore_eos`` (vLLM's field, what throughput benchmarks set) decodes past the model's stop tokens, the
    request's own ``stop_token_ids`` still ending it; beside requests that stop, at other block lengths and
    selectors, arriving staggered, each as it decodes alone."""
    prompts = [layouts(seed=3)[k] for k in ("prefix", "infix", "suffix", "prefix")]
    probe = SamplingParams(gen_length=16, block_length=4, selector="attention")
    stop = reference_generate(family_model, prompts[0], probe).token_ids[1]  # in the first block: ends it early
    params = [SamplingParams(gen_length=16, block_length=4, selector="attention", ignore_eos=True),
              SamplingParams(gen_length=16, block_length=4, selector="none"),
              SamplingParams(gen_length=16, block_length=8, ignore_eos=True, stop_token_ids=(stop,)),
              SamplingParams(gen_length=16, block_length=4, selector="attention", anchor_ratio=0.5)]
    outs = run_engine(family_model, prompts, params, arrivals=[0, 1, 0, 2], stop_token_ids=(stop,),
                      page_size=4, kv_cache_memory=1 << 24)
    store = AffixStore(family_model)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        ref = reference_generate(family_model, prompt, sp, store, stop_token_ids=(stop,))
        assert (out.token_ids, out.nfe, out.refreshes) == (ref.token_ids, ref.nfe, ref.refreshes)
    assert len(outs[0].token_ids) == 16 and outs[0].stop_token_id is None and stop in outs[0].token_ids
    assert outs[3].stop_token_id == stop and len(outs[3].token_ids) < 16  # the same prompt, the model's stop
    with pytest.raises(ValueError, match="ignore_eos must be true or false"):
        SamplingParams(ignore_eos="yes")


def test_refreshed_tokens_count_the_columns_refreshes_fed(llada_model):
    """With a far-mask window a refresh feeds only the masks its window reached; the counts said every one of them
    at every refresh (61% too many here). Two requests, staggered, one with a window and one without, at other
    selectors and ratios: each's per-refresh figure is the mean of what its refreshes fed, the engine's the sum. A
    first refresh that chooses anchors inside its forward feeds every near column and keeps the recompute set's
    K/V: it counts that set, what every later refresh of the request feeds."""
    prompts = [layouts(seed=5)["prefix"], layouts(seed=6)["infix"]]
    params = [SamplingParams(gen_length=64, block_length=8, threshold=0.5, selector="random", anchor_ratio=0.2,
                             far_mask_window=0),
              SamplingParams(gen_length=32, block_length=8, threshold=0.5, selector="attention", anchor_ratio=0.5)]
    engine = LLMEngine(llada_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24))
    fed: dict[str, list[int | None]] = {}
    forward = engine.runner._forward

    def spy(batch, *args):
        if batch.refresh:
            for req, plan in zip(batch.requests, batch.plans, strict=True):
                fed.setdefault(req.request_id, []).append(None if batch.select else len(plan.fed))
        return forward(batch, *args)

    engine.runner._forward = spy
    outs = run_engine(llada_model, prompts, params, arrivals=[0, 2], engine=engine)
    assert fed[outs[1].request_id][0] is None  # its selecting refresh
    counts = [[c if c is not None else fed[o.request_id][1] for c in fed[o.request_id]] for o in outs]
    assert len(set(counts[0])) > 1 and len(set(counts[1])) == 1  # the window grows; without one, each the same
    assert [o.recomputed_per_refresh for o in outs] == [round(sum(c) / len(c)) for c in counts]
    assert engine.metrics.refreshed_tokens == sum(map(sum, counts))


def test_a_streamed_partial_output_carries_the_anchors_once_fixed(llada_model):
    """A stream cut early by a stop string reports the partial output's usage: its anchors were left empty until the
    request finished (0 anchor tokens in the usage of a stream that had 3)."""
    prompt = layouts(seed=2)["infix"]
    params = SamplingParams(gen_length=16, block_length=4, threshold=0.5, selector="attention", anchor_ratio=0.5,
                            ignore_eos=True)
    engine = LLMEngine(llada_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24))
    rid = engine.add_request(prompt, params, stream=True)
    partial, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
            elif out.request_id == rid:
                partial.append(out)
    assert len(partial) == 3 and final.anchors and all(p.anchors == final.anchors for p in partial)


def test_a_request_failing_after_its_batch_sampled_leaves_the_others_draws_alone(family_model, monkeypatch):
    """A fault in one request's proposal after the requests before it in the batch drew their noise: each runs
    alone with its generator rewound and decodes as alone; a generator that is not a torch.Generator on the model's
    device is refused when the request is added."""
    prompts = [layouts(seed=s)["infix"] for s in range(3)]
    params = [SamplingParams(**BASE, temperature=1.0, seed=5, selector="attention", ignore_eos=True),
              SamplingParams(**BASE, selector="attention", anchor_ratio=0.5),
              SamplingParams(gen_length=8, block_length=4, temperature=0.7, seed=9, ignore_eos=True)]
    store = AffixStore(family_model)
    want = [reference_generate(family_model, prompts[i], params[i], store).token_ids for i in (0, 2)]
    fail_proposals_of(monkeypatch, "bad")
    engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24), affix_source=store)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        engine.add_request(prompts[0], params[0], generator=object())
    for p, sp, rid in zip(prompts[:2], params[:2], ["a", "bad"], strict=True):
        engine.add_request(p, sp, request_id=rid)
    outs = {o.request_id: o for o in engine.step()}  # "a" and "bad" batched: "bad" fails after "a" drew
    engine.add_request(prompts[2], params[2], request_id="c")  # arriving a step later
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["bad"].status is Status.FAILED and "bad proposal" in outs["bad"].error
    assert [outs["a"].token_ids, outs["c"].token_ids] == want
