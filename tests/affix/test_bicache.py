"""BiCache baselines: matched layers at both ends and the splice itself (the profiled depth table:
tests/lab/eval/test_staleness.py)."""

from __future__ import annotations

import pytest
import torch

from acache.affix.bicache import matched_depth
from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.decoding.request_state import RequestState
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import affix_run, layouts
from tests.helpers import tokens

BASE = dict(gen_length=16, block_length=8, threshold=0.5)


@pytest.mark.parametrize("position", ["prefix", "infix", "suffix", "two-affix", "before the region"])
def test_matched_depth_ends(family_model, position):
    """Depth 0 is direct reuse on every family: the affix columns direct reuse recomputes too (a block-causal
    model's attention block shared with the request's own, a shifted model's column before the region, here an
    affix's last) used to keep their cached shallow states."""
    g = torch.Generator().manual_seed(11)
    question, affix = (torch.randint(3, 200, (n,), generator=g).tolist() for n in (4, 14))
    prompt = AffixPrompt.from_spans(question + affix, None, [(4, 18)]) if position == "before the region" else \
        layouts()[position]
    store = AffixStore(family_model)
    full = tokens(affix_run(family_model, prompt, SamplingParams(**BASE)))
    direct = tokens(affix_run(family_model, prompt, SamplingParams(**BASE, selector="none"), store))
    deep = affix_run(family_model, prompt, SamplingParams(**BASE, selector="bicache-matched", anchor_ratio=1.0),
                     store)
    shallow = affix_run(family_model, prompt,
                        SamplingParams(**BASE, selector="bicache-matched", anchor_ratio=0.0), store)
    assert tokens(deep) == full and deep[0].bicache_depth == family_model.config.num_layers
    assert tokens(shallow) == direct and shallow[0].bicache_depth == 0


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_engine_bicache_batch_matches_each_alone(family_model, ratio):
    """Requests of different depths in one engine batch: each as the reference path decodes it alone."""
    prompts = list(layouts().values())
    params = [SamplingParams(**BASE, selector="bicache-matched", anchor_ratio=r) for r in (ratio, 0.5, 1.0, 0.0)]
    store = AffixStore(family_model)
    outs = affix_run(family_model, prompts, params, store, arrivals=[0, 1, 0, 2])
    for out, p, sp in zip(outs, prompts, params, strict=True):
        ref = reference_generate(family_model, p, sp, store)
        assert out.token_ids == ref.token_ids and out.bicache_depth == ref.bicache_depth


def test_matched_depth_rounding():
    assert matched_depth(0.2, 30) == 6 and matched_depth(0.5, 2) == 1 and matched_depth(0.01, 4) == 1
    assert matched_depth(0.0, 8) == 0 and matched_depth(1.0, 8) == 8


def test_refresh_splices_affix_hidden_state_at_the_split(llada_dir):
    """With D = 1 of 2 layers: own tokens run layer 0 against the cached affix K/V; the affix enters
    layer 1 with its affix-alone layer-1 input; layer 1 then runs on everything."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    prompt = layouts(affix_len=6, question_len=4)["prefix"]  # affix columns 0..5, question 6..9
    store = AffixStore(model, keep_hidden=True)
    entry = store.compute(prompt.affix_ids(prompt.affixes[0]))
    from acache.models.kv import KVCache
    from acache.reference import _bicache_refresh

    cfg = model.config
    state = RequestState(prompt.layout, SamplingParams(gen_length=8, block_length=8), cfg.mask_token_id,
                         cfg.pad_token_id, model.shifted_logits, model.device)
    t = state.length
    keys = [torch.zeros(t, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    values = [torch.zeros_like(k) for k in keys]
    for layer in range(2):
        keys[layer][:6], values[layer][:6] = entry.keys[layer], entry.values[layer]
    hidden = _bicache_refresh(model, state, [(0, 6, entry)], 1, torch.arange(t), keys, values)  # no window: all fed
    x, pos = state.tokens[None], state.positions[None]
    own = torch.arange(6, t)
    affix_kv = KVCache([k[None] for k in entry.keys], [v[None] for v in entry.values], torch.arange(6)[None],
                       torch.ones(1, 6, dtype=torch.bool))
    shallow = model.run_layers(model.embed(x[:, own]), pos[:, own], None, affix_kv, range(0, 1), return_kv=True)
    h = torch.cat((entry.hidden[1][None], shallow.hidden), dim=1)
    deep = model.run_layers(h, pos, None, None, range(1, 2), return_kv=True)
    assert torch.allclose(hidden, model.norm(deep.hidden), atol=1e-5)
    assert torch.equal(keys[0][:6], entry.keys[0])  # shallow affix K/V stay cached
    assert torch.allclose(keys[0][6:], shallow.kv.keys[0][0], atol=1e-6)
    assert torch.allclose(keys[1], deep.kv.keys[0][0], atol=1e-5)
