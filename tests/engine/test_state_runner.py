"""The engine serving the state-cache families (the state-space variant, R2LM) with a cache of the model's own per
request: any mix of requests, arriving at any step, decodes each exactly as the reference loop does alone;
the cache budget admits, queues and refuses; an aborted or failed request leaves no cache behind."""

from __future__ import annotations

import pytest
import torch

from acache.affix.prompt import Affix, AffixPrompt, resolve_segments
from acache.engine import EngineConfig, LLMEngine
from acache.engine.state_cache_manager import BlockCache
from acache.engine.state_runner import new_state, run_plans
from acache.models.r2lm import R2LM, R2LMConfig
from acache.models.ssm import SSMBlockDiffusionLM, SSMConfig, init_scan_model_
from acache.reference import reference_generate_state_cache
from acache.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.helpers import fail_proposals_of, run_engine, tokens

R2LM_CONFIG = R2LMConfig(vocab_size=300, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=96, sidecar_heads=2, sidecar_head_dim=8, state_size=6, block_size=4,
                         mask_token_id=299, eos_token_id=298)
SSM_CONFIG = SSMConfig(vocab_size=300, hidden_size=48, num_layers=2, intermediate_size=96, num_heads=3, head_dim=8,
                       state_size=6, block_size=4, mask_token_id=299, eos_token_id=298)


@pytest.fixture(scope="module", params=["r2lm", "blockdiff_ssm"])
def model(request):
    m = R2LM(R2LM_CONFIG) if request.param == "r2lm" else SSMBlockDiffusionLM(SSM_CONFIG)
    init_scan_model_(m, seed=7, std=0.3)
    return m.eval()


#: one of each: cache policies, block lengths (within a model block, one, across several), commit rules,
#: sampling and stop tokens, so that a batch never holds two alike
MIXED = [dict(gen_length=8, block_length=4, threshold=0.3), dict(gen_length=12, block_length=6, cache="none"),
         dict(gen_length=8, block_length=2, remasking="low_confidence", steps=8, cache="prefix"),
         dict(gen_length=16, block_length=16, temperature=0.8, seed=11), dict(gen_length=4, block_length=4),
         dict(gen_length=8, block_length=8, threshold=0.05, stop_token_ids=(7,)),
         dict(gen_length=12, block_length=4, remasking="factor", factor=1.5)]


def reference(model, prompts, params):
    return [reference_generate_state_cache(model, p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("arrivals", [[0] * 7, [0, 3, 1, 7, 2, 0, 12]])
def test_mixed_requests_arriving_apart_decode_as_alone(model, arrivals):
    prompts = random_prompts([3, 9, 5, 1, 14, 6, 8], vocab=290, seed=4)
    params = [SamplingParams(**kw) for kw in MIXED]
    outs = run_engine(model, prompts, params, arrivals, max_num_seqs=4)
    assert tokens(outs) == reference(model, prompts, params)
    assert max(o.stats.max_batch for o in outs) > 1  # they did share forwards
    assert all(o.nfe >= 1 for o in outs)


def test_cached_steps_equal_uncached_in_the_engine(model):
    prompts = random_prompts([2, 5, 7, 10], vocab=290, seed=6)
    kinds = [kw for kw in MIXED if kw.get("cache") != "none"]
    for shift in range(len(kinds)):  # each prompt with another of the mixed settings, arriving apart
        mixed = [kinds[(shift + i) % len(kinds)] for i in range(len(prompts))]
        cached = run_engine(model, prompts, [SamplingParams(**kw) for kw in mixed], [0, 2, 1, 4])
        uncached = run_engine(model, prompts, [SamplingParams(**{**kw, "cache": "none"}) for kw in mixed],
                              [3, 0, 0, 1])
        assert tokens(cached) == tokens(uncached)
        assert [o.nfe for o in cached] == [o.nfe for o in uncached]


def test_rows_run_together_equal_rows_run_alone(model):
    """``extend_many`` (one stacked forward for the state-space variant) gives each row what ``extend`` gives it,
    logits and cache, whatever the rows' lengths and starts."""
    ids = random_prompts([4, 8, 3], vocab=290, seed=8)
    start_cache = model.extend(torch.tensor(ids[1][:4]), 0, model.empty_cache())[1]
    rows = [(torch.tensor(ids[0]), 0, model.empty_cache()), (torch.tensor(ids[1][4:]), 4, start_cache),
            (torch.tensor(ids[2]), 0, model.empty_cache())]
    for (logits, cache), row in zip(model.extend_many(rows), rows, strict=True):
        alone_logits, alone_cache = model.extend(*row)
        assert torch.allclose(logits, alone_logits, atol=1e-5)
        flat = [t for part in cache for t in (part if isinstance(part, tuple) else (part,))]
        alone = [t for part in alone_cache for t in (part if isinstance(part, tuple) else (part,))]
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(flat, alone, strict=True))


def test_a_failing_request_fails_alone(model, monkeypatch):
    """A forward that raises for one row's tokens fails that request alone: the others, batched with it and
    arriving apart, decode as they do alone, and every reservation is freed."""
    poison = 13
    prompts = random_prompts([9, 6, 14], vocab=290, seed=5)
    prompts[1] = [poison, *prompts[1]]
    params = [SamplingParams(**kw) for kw in MIXED[:3]]
    want = reference(model, [prompts[0], prompts[2]], [params[0], params[2]])
    real = model.extend_many

    def extend_many(rows, logits=True, cache=True):
        if any(bool((tokens == poison).any()) for tokens, _, _ in rows):
            raise ValueError("poisoned row")
        return real(rows, logits, cache)

    monkeypatch.setattr(model, "extend_many", extend_many)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    outs = run_engine(model, prompts, params, arrivals=[0, 0, 1], engine=engine)
    assert outs[1].status.value == "failed" and "poisoned row" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == want
    assert engine.kv.used_bytes == 0 and not engine.kv.caches and not engine.has_unfinished()


def test_rows_of_any_length_run_together_as_alone(model):
    """Rows that pad whole blocks, and a one-token row after a cache whose convolution window is full, give in
    one ``extend_many`` what each gives alone; each row's cache owns its storage."""
    ids = random_prompts([12, 9, 4], vocab=290, seed=12)
    after8 = model.extend(torch.tensor(ids[1][:8]), 0, model.empty_cache())[1]
    rows = [(torch.tensor(ids[0]), 0, model.empty_cache()), (torch.tensor(ids[1][8:]), 8, after8),
            (torch.tensor(ids[2]), 0, model.empty_cache())]
    together = model.extend_many(rows)
    for (logits, cache), row in zip(together, rows, strict=True):
        alone_logits, alone_cache = model.extend(*row)
        assert torch.allclose(logits, alone_logits, atol=1e-5)
        flat = [t for part in cache for t in (part if isinstance(part, tuple) else (part,))]
        alone = [t for part in alone_cache for t in (part if isinstance(part, tuple) else (part,))]
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(flat, alone, strict=True))
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in flat if t.numel())
    no_logits = model.extend_many(rows, logits=False)
    assert all(logits is None for logits, _ in no_logits)
    logits_only = model.extend_many(rows, cache=False)
    assert all(c is None and torch.equal(lg, t[0]) for (lg, c), t in zip(logits_only, together, strict=True))


def test_a_plan_that_reads_past_its_cache_is_refused(model):
    from acache.engine.state_runner import new_state

    state = new_state(model, AffixPrompt((1, 2, 3, 4, 5), 5), SamplingParams(gen_length=4, block_length=4),
                      {model.config.eos_token_id})
    cache = BlockCache(model.empty_cache(), covered=8)  # claims more than the plan reads
    with pytest.raises(RuntimeError, match="the cache covers 8 columns but the step reads 4"):
        run_plans(model, [(state.tokens, state.plan(), cache)])


def test_the_budget_admits_queues_and_refuses(model):
    """A request reserves the most its cache holds and the copies its step makes beside it: one fixed state and the
    three copies a batched step makes of it (state-space), or the K/V before its last block and the copy its step
    extends through the whole canvas (R2LM)."""
    prompts = random_prompts([6, 30], vocab=290, seed=2)
    params = SamplingParams(gen_length=8, block_length=4)
    if isinstance(model, SSMBlockDiffusionLM):  # one state a request, whatever its length
        state = model.cache_bytes(model.empty_cache())
        need = [4 * state] * 2
    else:  # every position's K/V: the cache covers the columns before the last block (blocks of 4)
        need = [model.cache_bytes_for((len(p) + 4) // 4 * 4) + model.cache_bytes_for(len(p) + 8) for p in prompts]
        assert need[1] > need[0]
        done = reference_generate_state_cache(model, prompts[1], params)
        assert done.cache_bytes <= model.cache_bytes_for((len(prompts[1]) + 4) // 4 * 4)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=max(need)))  # room for one request at a time
    outs = run_engine(model, prompts, params, engine=engine)
    assert tokens(outs) == reference(model, prompts, [params] * 2)
    assert all(o.stats.max_batch == 1 for o in outs)  # the second waited for the first
    summary = engine.summary()
    assert summary["peak_kv_bytes"] == max(need) and summary["kv_pages_in_use"] == 0
    small = LLMEngine(model, EngineConfig(kv_cache_memory=min(need) - 1))
    with pytest.raises(ValueError, match="raise kv_cache_memory"):
        small.add_request(prompts[0], params)
    assert not small.has_unfinished()


def test_abort_frees_the_cache(model):
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    rid = engine.add_request(random_prompts([9], vocab=290)[0], SamplingParams(gen_length=16, block_length=4))
    engine.step()
    engine.step()
    assert engine.kv.used_bytes > 0 and rid in engine.kv.caches
    assert engine.abort(rid) and not engine.abort(rid)
    assert engine.kv.used_bytes == 0 and not engine.kv.caches and not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, why", [
    (dict(selector="attention"), "affix reuse .* is not supported for the"),
    (dict(focus_layers=1), "focus_layers is not supported for the"),
])
def test_what_the_family_cannot_do_is_refused_by_name(model, kwargs, why):
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    prompt = resolve_segments([[1, 2], Affix(token_ids=[3, 4, 5, 6]), [7]], lambda s: [])
    with pytest.raises(ValueError, match=why):
        engine.add_request(prompt, SamplingParams(gen_length=4, block_length=4, **kwargs))
    with pytest.raises(ValueError, match="is too long"):
        engine.add_request([1] * model.config.max_position_embeddings, SamplingParams(gen_length=4, block_length=4))
    assert not engine.has_unfinished()
    for method in (engine.affixes.save, engine.affixes.load):
        with pytest.raises(ValueError, match="shares no affix K/V"):
            method("anywhere")


def test_the_token_budget_counts_what_a_cache_must_take_in(model):
    """A request's first step also runs its prompt into the cache; the scheduler counts those tokens, so under a
    small budget long prompts take their first steps apart, and later steps (a block or two) together."""
    prompts = random_prompts([30, 29, 31], vocab=290, seed=3)
    params = SamplingParams(gen_length=8, block_length=4)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24, max_num_batched_tokens=40))
    for p in prompts:
        engine.add_request(p, params)
    first = engine.scheduler.schedule()
    reqs = {r.request_id: r for b in first.forwards for r in b.requests}
    assert len(reqs) == 1  # 28+ prompt tokens to take in and 8 fed: no room for a second
    req = next(iter(reqs.values()))
    assert engine.kv.step_cost(req, req.state.plan()) == 28 + len(req.state.plan().fed)
    engine.scheduler.update_from_output(first, engine.runner.execute(first))
    assert engine.kv.step_cost(req, req.state.plan()) == len(req.state.plan().fed) <= 8
    again = run_engine(model, prompts, params, max_num_batched_tokens=40)
    assert tokens(again) == reference(model, prompts, [params] * 3)


def test_an_empty_prompt_decodes_on_the_engine_as_on_the_reference(model):
    prompts = [[], *random_prompts([6], vocab=290, seed=9)]
    params = [SamplingParams(**MIXED[0]), SamplingParams(**MIXED[3])]
    outs = run_engine(model, prompts, params, [0, 1])
    assert tokens(outs) == reference(model, prompts, params)


def test_refreshed_tokens_count_the_step_spans_refreshes_fed(model):
    """A state-cache family's refresh feeds the attention blocks its step touches, not the canvas its recompute set
    spans: the counts said the whole canvas (160 where 32 were fed)."""
    prompts = random_prompts([8, 5], vocab=290, seed=9)
    params = [SamplingParams(gen_length=32, block_length=8, ignore_eos=True),
              SamplingParams(gen_length=16, block_length=4, threshold=0.3, ignore_eos=True)]
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    fed: dict[str, list[int]] = {}
    forward = engine.runner._forward

    def spy(batch, *args):
        if batch.refresh:
            for req, plan in zip(batch.requests, batch.plans, strict=True):
                fed.setdefault(req.request_id, []).append(len(plan.fed))
        return forward(batch, *args)

    engine.runner._forward = spy
    outs = run_engine(model, prompts, params, [0, 1], engine=engine)
    counts = [fed[o.request_id] for o in outs]
    assert [o.recomputed_per_refresh for o in outs] == [round(sum(c) / len(c)) for c in counts]
    assert engine.metrics.refreshed_tokens == sum(map(sum, counts)) < sum(len(p) + 32 for p in prompts)


def test_a_request_failing_after_its_batch_sampled_leaves_the_others_draws_alone(model, monkeypatch):
    """A fault in one request's proposal, after the requests before it in the batch drew their noise: each is run
    alone with its generator rewound, so the sampled requests decode as alone (they drew twice, and decoded
    otherwise)."""
    prompts = random_prompts([9, 6, 14], vocab=290, seed=5)
    params = [SamplingParams(gen_length=8, block_length=4, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(gen_length=8, block_length=4),
              SamplingParams(gen_length=12, block_length=4, temperature=0.7, seed=9, ignore_eos=True)]
    want = reference(model, [prompts[0], prompts[2]], [params[0], params[2]])
    fail_proposals_of(monkeypatch, "bad")
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    ids = [engine.add_request(p, sp, request_id=rid)
           for p, sp, rid in zip(prompts[:2], params[:2], ["a", "bad"], strict=True)]
    outs = {o.request_id: o for o in engine.step()}  # "a" and "bad" batched: "bad" fails after "a" drew
    ids.append(engine.add_request(prompts[2], params[2], request_id="c"))  # arriving a step later
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["bad"].status.value == "failed" and "bad proposal" in outs["bad"].error
    assert [outs[ids[0]].token_ids, outs[ids[2]].token_ids] == want


def test_what_a_step_holds_stays_within_what_its_requests_reserved(model, monkeypatch):
    """R2LM: at every row's extend, the caches held and the copy just made fit in the bytes reserved (advancing a
    batch's caches made every row's new K/V beside its old one: 1.75 times the budget in a review's run); the cache
    reserved is the one its last block reads, so four requests fit where the whole canvas each did not."""
    if isinstance(model, SSMBlockDiffusionLM):
        pytest.skip("the state-space model's copies are made inside one batched forward")
    prompts = random_prompts([20, 18, 22, 19], vocab=290, seed=4)
    params = [SamplingParams(gen_length=16, block_length=4), SamplingParams(gen_length=12, block_length=4,
                                                                            threshold=0.2),
              SamplingParams(gen_length=16, block_length=4, threshold=0.3), SamplingParams(gen_length=8,
                                                                                          block_length=4)]
    want = reference(model, prompts, params)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24))
    worst = []
    real = model.extend

    def extend(tokens, start, cache, logits=True):
        out = real(tokens, start, cache, logits)
        held = sum(model.cache_bytes(c.value) for c in engine.kv.caches.values())
        worst.append(held + model.cache_bytes(out[1]) - engine.kv.used_bytes)
        return out

    many = model.extend_many
    advanced = []

    def extend_many(rows, logits=True, cache=True):
        out = many(rows, logits, cache)
        advanced.append(len(rows) if cache else 0)
        held = sum(model.cache_bytes(c.value) for c in engine.kv.caches.values())
        worst.append(held + sum(model.cache_bytes(value) for _, value in out) - engine.kv.used_bytes)
        return out

    monkeypatch.setattr(model, "extend", extend)
    monkeypatch.setattr(model, "extend_many", extend_many)
    outs = run_engine(model, prompts, params, arrivals=[0, 0, 1, 1], engine=engine)
    assert tokens(outs) == want
    assert max(worst) <= 0, max(worst)
    assert max(advanced) == 1  # one cache advanced at a time, its old K/V let go before the next is made
    # three requests behind their caches at once: still advanced one by one
    items = [(torch.tensor(p + [1] * 8), SamplingParams(gen_length=8, block_length=4), None) for p in prompts[:3]]
    states = [new_state(model, AffixPrompt(tuple(p[:-8].tolist()), len(p) - 8), sp, set()) for p, sp, _ in items]
    advanced.clear()
    run_plans(model, [(st.tokens, st.plan(), BlockCache(model.empty_cache())) for st in states])
    assert advanced == [1, 1, 1, 0]
    assert max(o.stats.max_batch for o in outs) > 1
    whole = sum(model.cache_bytes_for(len(p) + sp.gen_length) for p, sp in zip(prompts, params, strict=True))
    reqs = [engine._request(p, sp, str(i), None, False) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    assert sum(engine.kv.held_bytes(r) for r in reqs) < whole
