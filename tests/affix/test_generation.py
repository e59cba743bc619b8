"""ACache generation: all anchors is the dual cache, no anchors is direct reuse, token for token."""

from __future__ import annotations

import pytest
import torch

from acache.affix.store import AffixStore
from acache.decoding.commit import Threshold
from acache.models.kv import KVCache
from acache.policies import ONE_PASS_SELECTORS
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import affix_engine, affix_run, layouts
from tests.helpers import block_causal, tokens

BASE = dict(gen_length=16, block_length=8, threshold=0.5)


@pytest.mark.parametrize("position", ["prefix", "infix", "suffix", "two-affix"])
@pytest.mark.parametrize("how", [dict(selector="all"), *(dict(selector=s, anchor_ratio=1.0) for s in (
    "attention", "attention-deviation", "cacheblend", "influence", "kv-deviation", "query-attention", "first-k",
    "random")), *(dict(selector=s, anchor_ratio=1.0, anchor_pass="two") for s in ONE_PASS_SELECTORS),
    dict(selector="attention", anchor_ratio=1.0, anchor_query="shallow")],
    ids=lambda h: "-".join(filter(None, (h["selector"], h.get("anchor_query"), h.get("anchor_pass")))))
def test_full_recompute_matches_dual_cache(family_model, position, how):
    prompt = layouts()[position]
    want = affix_run(family_model, prompt, SamplingParams(cache="dual", **BASE))
    (got,) = affix_run(family_model, prompt, SamplingParams(**BASE, **how))
    assert got.token_ids == want[0].token_ids
    assert got.recomputed_per_refresh == len(prompt.token_ids) + BASE["gen_length"]
    # every affix column recomputed: as an anchor, or as a column every refresh recomputes anyway (on the
    # block-diffusion model an attention block shared with the question)
    assert got.cached_tokens == 0 and 0 < len(got.anchors) <= sum(a.length for a in prompt.affixes)
    if family_model.config.block_size is None and not family_model.shifted_logits:
        assert len(got.anchors) == sum(a.length for a in prompt.affixes)


@pytest.mark.parametrize("selector", ["attention", "attention-deviation", "cacheblend", "influence", "random",
                                      "kv-deviation", "query-attention"])
def test_mixed_batch_matches_each_alone(family_model, selector):
    """The four layouts at other ratios, lengths and thresholds, together and arriving apart: each as alone."""
    prompts = list(layouts().values())
    params = [SamplingParams(**{**BASE, **shape}, selector=selector, anchor_ratio=ratio)
              for shape, ratio in ((dict(), 0.3), (dict(gen_length=8, block_length=4), 0.5),
                                   (dict(threshold=0.8), 0.1), (dict(gen_length=24, block_length=8), 0.3))]
    store = AffixStore(family_model)
    batched = affix_run(family_model, prompts, params, store)
    staggered = affix_run(family_model, prompts, params, store, arrivals=[3, 0, 1, 5])
    for i, p in enumerate(prompts):
        alone = reference_generate(family_model, p, params[i], store)
        assert alone.token_ids == batched[i].token_ids == staggered[i].token_ids
        if selector == "kv-deviation" and block_causal(family_model):
            continue  # a prefix affix's whole attention blocks deviate by rounding noise alone: ties, any order
        assert alone.anchors == batched[i].anchors == staggered[i].anchors


def test_mixed_anchor_queries_and_ratios_match_each_alone(family_model):
    """ACache's three query sources and different ratios in one batch, arriving apart: each request decodes,
    anchors included, as it would alone; the shallow probe picks its own anchors, not the probe's."""
    prompts = list(layouts().values())
    params = [SamplingParams(**BASE, selector="attention", anchor_query=q, anchor_ratio=r)
              for q, r in (("shallow", 0.3), ("probe", 0.2), ("shallow", 0.5), ("full", 0.3))]
    store = AffixStore(family_model)
    batched = affix_run(family_model, prompts, params, store)
    staggered = affix_run(family_model, prompts, params, store, arrivals=[2, 0, 4, 1])
    for prompt, p, b, s in zip(prompts, params, batched, staggered, strict=True):
        alone = reference_generate(family_model, prompt, p, store)
        assert alone.token_ids == b.token_ids == s.token_ids
        assert alone.anchors == b.anchors == s.anchors
    probe = [reference_generate(family_model, prompt, SamplingParams(**BASE, selector="attention",
                                                                     anchor_ratio=0.3), store).anchors
             for prompt in prompts]
    shallow = [reference_generate(family_model, prompt, params[0], store).anchors for prompt in prompts]
    assert probe != shallow


def direct_reuse_reference(model, prompt, gen_length, block_length, threshold):
    """Direct affix reuse written out plainly for one request: affix K/V from the affix alone, placed at
    its positions; every block start recomputes all non-affix tokens against it; inside a block only the
    block is fed against everything else from that refresh. Its tensors are made where the model runs."""
    with torch.device(model.device):
        return _direct_reuse(model, prompt, gen_length, block_length, threshold)


def _direct_reuse(model, prompt, gen_length, block_length, threshold):
    cfg = model.config
    ids = list(prompt.token_ids[:prompt.gen_at]) + [cfg.mask_token_id] * gen_length + list(
        prompt.token_ids[prompt.gen_at:])
    x = torch.tensor([ids])
    t = len(ids)
    pos = torch.arange(t)[None]
    col = {}  # prompt index -> canvas column
    for i in range(len(prompt.token_ids)):
        col[i] = i if i < prompt.gen_at else i + gen_length
    affix_cols, affix_k, affix_v = [], [[] for _ in range(cfg.num_layers)], [[] for _ in range(cfg.num_layers)]
    for span in prompt.affixes:
        alone = model(torch.tensor([prompt.affix_ids(span)]), torch.arange(span.length)[None], return_kv=True).kv
        affix_cols += [col[i] for i in range(span.start, span.end)]
        for layer in range(cfg.num_layers):
            affix_k[layer].append(alone.keys[layer])
            affix_v[layer].append(alone.values[layer])
    affix_cols_t = torch.tensor(affix_cols)
    affix_kv = KVCache([torch.cat(k, 1) for k in affix_k], [torch.cat(v, 1) for v in affix_v],
                       pos[:, affix_cols_t], torch.ones(1, len(affix_cols), dtype=torch.bool))
    other = torch.tensor([c for c in range(t) if c not in set(affix_cols)])
    rule = Threshold(threshold)
    g0 = prompt.gen_at
    for b in range(gen_length // block_length):
        s, e = g0 + b * block_length, g0 + (b + 1) * block_length
        step, cache = 0, None
        while (x[:, s:e] == cfg.mask_token_id).any():
            masked = x[:, s:e] == cfg.mask_token_id
            if step == 0:
                out = model(x[:, other], pos[:, other], past=affix_kv, return_kv=True)
                full_k = [torch.zeros(1, t, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
                full_v = [torch.zeros_like(k) for k in full_k]
                for layer in range(cfg.num_layers):
                    full_k[layer][:, other] = out.kv.keys[layer]
                    full_v[layer][:, other] = out.kv.values[layer]
                    full_k[layer][:, affix_cols_t] = affix_kv.keys[layer]
                    full_v[layer][:, affix_cols_t] = affix_kv.values[layer]
                keep = torch.tensor([c for c in range(t) if not s <= c < e])
                cache = KVCache([k[:, keep] for k in full_k], [v[:, keep] for v in full_v], pos[:, keep],
                                torch.ones(1, len(keep), dtype=torch.bool))
                where = [other.tolist().index(c) for c in range(s, e)]
                logits = model.logits(out.hidden, torch.tensor(where))
            else:
                out = model(x[:, s:e], pos[:, s:e], past=cache)
                logits = model.logits(out.hidden)
            probs = torch.softmax(logits, -1)  # confidence over the whole vocabulary
            logits[..., cfg.mask_token_id] = float("-inf")  # [MASK] is never proposed
            x0 = logits.argmax(-1)
            conf = torch.where(masked, probs.gather(-1, x0[..., None])[..., 0], float("-inf"))
            commit = rule.select(conf, masked, step)
            if step == 0 and model.shifted_logits:  # the block's first token alone, on its refresh
                commit = torch.zeros_like(masked)
                commit[:, 0] = True
            x[:, s:e] = torch.where(commit, x0, x[:, s:e])
            step += 1
    return x[0, g0:g0 + gen_length].tolist()


@pytest.mark.parametrize("position", ["prefix", "infix", "suffix", "two-affix"])
def test_no_anchors_is_direct_reuse(family_model, position):
    if block_causal(family_model):
        pytest.skip("the plain direct reuse above is bidirectional; a block-causal model's reuse is tested in "
                    "tests/models/test_block_diffusion.py")
    prompt = layouts()[position]
    want = direct_reuse_reference(family_model, prompt, **BASE)
    (got,) = affix_run(family_model, prompt, SamplingParams(**BASE, selector="none"))
    assert got.token_ids == want
    assert got.anchors == []
    full = affix_run(family_model, prompt, SamplingParams(**BASE))
    assert got.token_ids != full[0].token_ids  # reuse is stale here, so the comparison above has teeth


def test_zero_ratio_attention_equals_none(family_model):
    prompt = layouts()["infix"]
    store = AffixStore(family_model)
    a = affix_run(family_model, prompt, SamplingParams(**BASE, selector="none"), store)
    b = affix_run(family_model, prompt, SamplingParams(**BASE, selector="attention", anchor_ratio=0.0), store)
    assert tokens(a) == tokens(b) and b[0].anchors == []


@pytest.mark.parametrize("anchor_pass", ["one", "two"])
def test_stats_and_store_hits(llada_dir, anchor_pass):
    """Store hits, anchor counts and refresh sizes; a selection of its own is timed, one inside the refresh has
    no time of its own."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    prompt = layouts()["two-affix"]
    engine = affix_engine(model)
    params = SamplingParams(**BASE, selector="attention", anchor_ratio=0.25, anchor_pass=anchor_pass)
    (first,) = affix_run(model, prompt, params, engine=engine)
    (second,) = affix_run(model, prompt, params, engine=engine)
    assert (first.stats.affix_queries, first.stats.affix_hits) == (2, 0)
    assert (second.stats.affix_queries, second.stats.affix_hits) == (2, 2)
    assert len(first.anchors) == 2 + 5  # ceil(0.25 * 8) + ceil(0.25 * 20)
    n_affix = 28
    assert first.recomputed_per_refresh == len(prompt.token_ids) - n_affix + 7 + BASE["gen_length"]
    assert len(first.stats.refresh_times_s) == 2
    assert first.stats.selection_time_s > 0 if anchor_pass == "two" else first.stats.selection_time_s == 0
    assert all(e.refcount == 0 for e in engine.affixes.entries.values())
    assert engine.pool.num_used == sum(len(e.pages) for e in engine.affixes.entries.values())
