"""``probe_step``: the anchor-selection probe decodes the first step of the first block.

Its definition (the first step is what direct reuse commits, the next forward a refresh with anchors),
the engine against the reference path with mixed requests, and the state rule that forces the refresh.
"""

from __future__ import annotations

import pytest
import torch

from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.decoding.request_state import Phase, RequestState
from acache.engine import EngineConfig, LLMEngine
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.helpers import run_engine


def prompts() -> dict[str, AffixPrompt]:
    """Every layout of the helpers, and one whose affix ends right before the generation region (for a
    shifted model the probe must then compute that column fresh, as a refresh does)."""
    out = dict(layouts(seed=3))
    g = torch.Generator().manual_seed(5)
    q, aff = torch.randint(0, 256, (5,), generator=g).tolist(), torch.randint(0, 256, (14,), generator=g).tolist()
    out["affix-last"] = AffixPrompt.from_spans(q + aff, None, [(5, 19)])
    return out


def first_commit(monkeypatch, model, prompt, params, store) -> torch.Tensor:
    """The canvas right after the request's first commit."""
    seen: list[torch.Tensor] = []
    original = RequestState.commit

    def recording(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        seen.append(self.tokens.clone())
        return done

    monkeypatch.setattr(RequestState, "commit", recording)
    reference_generate(model, prompt, params, store)
    monkeypatch.setattr(RequestState, "commit", original)
    return seen[0]


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix", "affix-last"])
def test_the_first_step_is_what_direct_reuse_commits(family_model, monkeypatch, layout):
    prompt, store = prompts()[layout], AffixStore(family_model)
    base = dict(gen_length=8, block_length=4, remasking="low_confidence", steps=4)
    reuse = first_commit(monkeypatch, family_model, prompt, SamplingParams(**base, selector="none"), store)
    for policy, ratio in (("attention", 0.3), ("all", 1.0), ("first-k", 0.5)):
        params = SamplingParams(**base, selector=policy, anchor_ratio=ratio, probe_step=True)
        assert torch.equal(first_commit(monkeypatch, family_model, prompt, params, store), reuse), policy


def test_one_step_decoded_by_the_probe_is_direct_reuse(llada_dir):
    """A block decoded in one step is finished by the probe: direct reuse's answer, no refresh at all."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    store = AffixStore(model)
    base = dict(gen_length=4, block_length=4, remasking="low_confidence", steps=1)
    for prompt in prompts().values():
        reuse = reference_generate(model, prompt, SamplingParams(**base, selector="none"), store)
        probed = reference_generate(model, prompt, SamplingParams(**base, selector="attention", anchor_ratio=0.5,
                                                                  probe_step=True), store)
        assert probed.token_ids == reuse.token_ids
        assert (probed.nfe, probed.refreshes) == (1, 0) and (reuse.nfe, reuse.refreshes) == (1, 1)


def test_the_probe_takes_a_step_and_the_anchors_refresh_next(family_model):
    """Same steps as without it (the probe's forward is one of them), one refresh of the anchors after it."""
    store = AffixStore(family_model)
    base = dict(gen_length=8, block_length=4, remasking="low_confidence", steps=8, selector="attention")
    for prompt in prompts().values():
        plain = reference_generate(family_model, prompt, SamplingParams(**base), store)
        probed = reference_generate(family_model, prompt, SamplingParams(**base, probe_step=True), store)
        assert probed.nfe == plain.nfe == 8
        assert probed.refreshes == plain.refreshes == 2  # block 0's refresh moved to its second step


def test_the_state_refreshes_after_the_probe_whatever_the_interval():
    from acache.decoding.canvas import Layout

    params = SamplingParams(gen_length=8, block_length=8, remasking="low_confidence", steps=4, selector="attention",
                            probe_step=True)
    state = RequestState(Layout((1, 2, 3), 3), params, 9, 0, False, torch.device("cpu"))
    shared = torch.tensor([True, True, False] + [False] * 8)
    state.admit(shared, shared & False)
    proposal = torch.arange(10, 18), torch.linspace(0.1, 0.9, 8)
    assert state.phase is Phase.REFRESH and not state.commit(*proposal, probe=True)
    assert state.step == 1 and state.phase is Phase.REFRESH and int(state.masked.sum()) == 6
    assert state.refreshes == 0 and state.nfe == 1
    with pytest.raises(RuntimeError, match="only the first step of the first block"):
        state.commit(*proposal, probe=True)
    state.commit(*proposal)
    assert state.phase is Phase.STEP and state.refreshes == 1


def test_engine_with_mixed_requests_decodes_each_as_alone(family_model):
    """Requests with and without the probe step, of different block lengths, rules, ratios, selectors and
    temperatures, arriving at different steps: each as the reference path decodes it alone."""
    ps = list(prompts().values())
    mix = [dict(gen_length=8, block_length=4, probe_step=True),
           dict(gen_length=8, block_length=8, remasking="low_confidence", steps=4, probe_step=True, anchor_ratio=0.5),
           dict(gen_length=8, block_length=4),
           dict(gen_length=4, block_length=2, threshold=0.3, probe_step=True, selector="random", seed=2),
           dict(gen_length=8, block_length=4, temperature=0.8, seed=7, probe_step=True, anchor_query="full"),
           dict(gen_length=8, block_length=4, probe_step=True, selector="cacheblend", refresh_interval=2)]
    requests, params = [], []
    for i in range(12):
        kw = {"selector": "attention", "anchor_ratio": 0.2, "threshold": 0.6, **mix[i % len(mix)]}
        requests.append(ps[i % len(ps)])
        params.append(SamplingParams(**kw))
    engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24, max_num_seqs=5))
    outs = run_engine(family_model, requests, params, arrivals=[i % 4 for i in range(12)], engine=engine)
    store = AffixStore(family_model)
    for i, (prompt, sp, out) in enumerate(zip(requests, params, outs, strict=True)):
        ref = reference_generate(family_model, prompt, sp, store)
        assert out.error is None and out.token_ids == ref.token_ids, (i, sp)
        assert out.anchors == ref.anchors and (out.nfe, out.refreshes) == (ref.nfe, ref.refreshes), (i, sp)
    assert engine.pool.num_used == engine.affixes.pages_in_use
