"""Affix-isolated training forwards compute what direct reuse serves: logit for logit against the reference
path's direct reuse (the affixes' K/V computed alone, attended from every other token), for every layout and
two affixes a prompt, and token for token against ``reference_generate`` with ``selector="none"``."""

from __future__ import annotations

import pytest
import torch

from acache.affix.store import AffixStore
from acache.models.kv import KVCache
from acache.models.loader import load_model
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from acache_lab.train.isolation import isolation_mask
from tests.affix.helpers import layouts

GEN = 4


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, llada_dir, dream_dir):
    return load_model(llada_dir if request.param == "llada" else dream_dir)


def canvas(model, prompt):
    """The prompt with its generation region of masks in place, and its affix spans on that canvas."""
    ids = list(prompt.token_ids)
    tokens = ids[:prompt.gen_at] + [model.config.mask_token_id] * GEN + ids[prompt.gen_at:]
    spans = [(a.start + GEN * (a.start >= prompt.gen_at), a.end + GEN * (a.start >= prompt.gen_at))
             for a in prompt.affixes]
    return torch.tensor(tokens), spans


def direct_reuse_states(model, prompt, tokens, spans):
    """What direct reuse computes: every other column fed, each affix's K/V computed alone sitting in ``past``."""
    store = AffixStore(model)
    t = len(tokens)
    shared = torch.zeros(t, dtype=torch.bool)
    cfg = model.config
    keys = [torch.zeros(t, cfg.num_kv_heads, cfg.head_dim) for _ in model.layers]
    values = [torch.zeros(t, cfg.num_kv_heads, cfg.head_dim) for _ in model.layers]
    for (c0, c1), span in zip(spans, prompt.affixes, strict=True):
        entry, _ = store.acquire(prompt.affix_ids(span))
        shared[c0:c1] = True
        for layer in range(len(keys)):
            keys[layer][c0:c1], values[layer][c0:c1] = entry.keys[layer], entry.values[layer]
    pos = torch.arange(t)
    past = KVCache([k[shared][None] for k in keys], [v[shared][None] for v in values], pos[shared][None],
                   torch.ones(1, int(shared.sum()), dtype=torch.bool))
    fed = ~shared
    return model(tokens[fed][None], pos[fed][None], None, past=past).hidden[0], fed


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix"])
@torch.inference_mode()
def test_an_isolated_forward_is_direct_reuse_logit_for_logit(model, layout):
    """The final states of every column direct reuse feeds, and so the logits read from them (Dream reads a
    column's logits from the state before it, which an isolated forward also has: the affix's own)."""
    prompt = layouts(seed=3)[layout]
    tokens, spans = canvas(model, prompt)
    want, fed = direct_reuse_states(model, prompt, tokens, spans)
    mask = isolation_mask(torch.ones(1, len(tokens), dtype=torch.bool), [spans])
    got = model(tokens[None], torch.arange(len(tokens))[None], mask).hidden[0][fed]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(got[None]), model.logits(want[None]), rtol=1e-4, atol=1e-4)
    full = model(tokens[None], torch.arange(len(tokens))[None]).hidden[0][fed]
    assert (full - want).abs().max() > 1e-3  # the mask matters: full attention is not direct reuse


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix"])
def test_one_shot_decoding_under_the_mask_is_reference_direct_reuse(llada_dir, layout):
    """One forward, the first refresh, commits the whole answer (steps 1): the tokens are the isolated
    forward's argmax."""
    model = load_model(llada_dir)
    prompt = layouts(seed=5)[layout]
    params = SamplingParams(gen_length=GEN, block_length=GEN, steps=1, cache="dual", selector="none",
                            remasking="low_confidence")
    ref = reference_generate(model, prompt, params, stop_token_ids=())
    tokens, spans = canvas(model, prompt)
    mask = isolation_mask(torch.ones(1, len(tokens), dtype=torch.bool), [spans])
    with torch.inference_mode():
        logits = model.logits(model(tokens[None], torch.arange(len(tokens))[None], mask).hidden)[0]
    answer = logits[prompt.gen_at:prompt.gen_at + GEN].argmax(-1).tolist()
    eos = model.config.eos_token_id
    assert ref.token_ids == (answer[:answer.index(eos)] if eos in answer else answer)


def test_the_mask_row_by_row():
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    mask = isolation_mask(valid, [[(0, 2), (3, 5)], []])
    assert mask.shape == (2, 6, 6)
    assert mask[0, 0].tolist() == [True, True, False, False, False, False]  # a span sees itself only
    assert mask[0, 3].tolist() == [False, False, False, True, True, False]
    assert mask[0, 2].all() and mask[0, 5].all()  # the other columns see everything
    assert mask[1].tolist() == [[True] * 4 + [False] * 2] * 6  # no spans: padding is still never attended


@pytest.mark.parametrize("spans, message", [([[(0, 2)]], "spans are given for 1 rows of a batch of 2"),
                                            ([[(3, 3)]], "empty or outside"), ([[(4, 9)]], "empty or outside"),
                                            ([[(0, 3), (2, 4)]], "overlaps another")])
def test_bad_spans_are_named(spans, message):
    valid = torch.ones(2 if "rows" in message else 1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        isolation_mask(valid, spans)


def test_a_per_query_mask_is_refused_with_a_past_or_block_causal_attention(blockdiff_dir, llada_dir):
    mask = torch.ones(1, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="per-query attention_mask"):
        load_model(blockdiff_dir)(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], mask)
    llada = load_model(llada_dir)
    past = llada(torch.tensor([[4, 5]]), torch.arange(2)[None], return_kv=True).kv
    with pytest.raises(ValueError, match="per-query attention_mask"):
        llada(torch.tensor([[1, 2, 3]]), torch.arange(2, 5)[None], mask, past=past)
