"""Block diffusion in Fast-dLLM v2's layout: the block-causal mask, the upstream config, and a block cache
that is exact (cached decoding equals uncached decoding token for token, a prefix affix is reused exactly)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.engine import EngineConfig, LLMEngine
from acache.models import ConfigError, FastDLLMv2Model, Tokenizer, load_model
from acache.models.layers import block_causal_mask
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.conftest import random_prompts, tiny_checkpoint
from tests.helpers import run_engine


@pytest.fixture(scope="module")
def model(blockdiff_dir):
    return load_model(blockdiff_dir)


def test_block_causal_mask_equals_a_loop():
    g = torch.Generator().manual_seed(0)
    key_mask = torch.rand(2, 9, generator=g) > 0.2
    key_pos = torch.randint(0, 20, (2, 9), generator=g)
    q_pos = torch.randint(0, 20, (2, 5), generator=g)
    got = block_causal_mask(key_mask, q_pos, key_pos, 4)
    for b in range(2):
        for i in range(5):
            want = [bool(key_mask[b, j]) and int(key_pos[b, j]) // 4 <= int(q_pos[b, i]) // 4 for j in range(9)]
            if not any(want):  # nothing visible: only padding queries get here, they keep the key mask
                want = key_mask[b].tolist()
            assert got[b, i].tolist() == want


def test_upstream_layout_and_config(tmp_path):
    root = tiny_checkpoint(tmp_path / "bd", "fast_dllm_v2", block_size=8)
    raw = json.loads((root / "config.json").read_text())
    assert raw["model_type"] == "Fast_dLLM_Qwen" and raw["architectures"] == ["Fast_dLLM_QwenForCausalLM"]
    assert raw["bd_size"] == 8 and raw["mask_token_id"] == Tokenizer.from_dir(root).token_to_id("|<MASK>|")
    m = load_model(root)
    assert isinstance(m, FastDLLMv2Model) and m.config.block_size == 8 and m.shifted_logits
    names = set(load_file(root / "model.safetensors"))
    assert names == set(m.hf_tensor_names(m.config))  # every tensor accounted for, both ways
    assert {"model.layers.1.self_attn.k_proj.bias", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"} <= names
    for change, why in [({"bd_size": None}, "missing the field 'bd_size'"),
                        ({"bd_size": 0}, "bd_size must be a positive"),
                        ({"bd_size": "32"}, "bd_size must be a positive"),
                        ({"mask_token_id": None}, "mask_token_id=151665 is outside the vocabulary")]:
        bad = {k: v for k, v in {**raw, **change}.items() if v is not None}
        (root / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=why):
            load_model(root)


def test_a_later_block_never_changes_an_earlier_one(model):
    ids = random_prompts([11], seed=4)[0]
    pos = torch.arange(11)[None]
    base = model(torch.tensor([ids]), pos).hidden
    changed = list(ids)
    changed[9] = (changed[9] + 1) % 200  # block 2 (positions 8-11)
    other = model(torch.tensor([changed]), pos).hidden
    assert torch.equal(base[0, :8], other[0, :8])
    assert not torch.allclose(base[0, 8:], other[0, 8:])


CASES = [dict(block_length=4, remasking="threshold", threshold=0.5), dict(block_length=2, remasking="low_confidence",
                                                                         steps=8),
         dict(block_length=8, remasking="factor", factor=1.0), dict(block_length=4, temperature=0.9, seed=3),
         dict(block_length=4, remasking="low_confidence", steps=16, refresh_interval=3)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cached_decoding_equals_uncached(model, case):
    """Every prompt length against the attention blocks of 4 (aligned or not), each cache policy."""
    for prompt in random_prompts([3, 4, 5, 8, 10], seed=case):
        base = dict(gen_length=16, **CASES[case])
        uncached = reference_generate(model, prompt, SamplingParams(**base, cache="none"))
        for cache in ("prefix", "dual"):
            cached = reference_generate(model, prompt, SamplingParams(**base, cache=cache))
            assert cached.token_ids == uncached.token_ids, (len(prompt), cache)


def prefix_prompt(affix_len: int, seed: int) -> AffixPrompt:
    affix, question = random_prompts([affix_len, 5], seed=seed)
    return AffixPrompt.from_spans(affix + question, None, [(0, affix_len)])


@pytest.mark.parametrize("affix_len", [8, 10])
def test_prefix_affix_reuse_is_exact(model, affix_len):
    """A prefix affix's K/V computed alone are its K/V in any request: direct reuse decodes as no reuse, on the
    reference path and on the engine (an affix ending inside an attention block has that block recomputed)."""
    store = AffixStore(model)
    prompts = [prefix_prompt(affix_len, s) for s in range(4)]
    params = SamplingParams(gen_length=8, block_length=4, threshold=0.6, selector="none")
    plain = SamplingParams(gen_length=8, block_length=4, threshold=0.6)
    outs = run_engine(model, prompts, params, arrivals=[0, 1, 1, 3])
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference_generate(model, prompt, plain).token_ids
        assert reference_generate(model, prompt, params, store).token_ids == want
        assert out.token_ids == want


def infix_prompt() -> AffixPrompt:
    return AffixPrompt.from_spans(random_prompts([3], seed=5)[0] + random_prompts([8], seed=6)[0] + [1, 2],
                                  None, [(3, 11)])


def test_an_exact_prefix_affix_takes_no_anchors(model):
    """A prefix affix's cached K/V are exact, so no selector spends anchors on it short of recomputing it whole:
    the one-pass selectors' first refresh is direct reuse's, a pass of its own is skipped, a probe's choice is
    dropped, and each request decodes as under direct reuse; an infix affix keeps its anchors, and ratio 1 is
    still full recomputation. Mixed parameters, staggered arrivals, engine equals the reference path."""
    cases = [(prefix_prompt(8, 1), dict(selector="attention", anchor_ratio=0.2)),  # chosen in one pass
             (prefix_prompt(10, 2), dict(selector="cacheblend", anchor_ratio=0.5, gen_length=16, block_length=8)),
             (prefix_prompt(8, 3), dict(selector="kv-deviation", anchor_ratio=0.3)),  # a pass of its own
             (prefix_prompt(10, 4), dict(selector="random", anchor_ratio=0.4, seed=3)),
             (infix_prompt(), dict(selector="attention", anchor_ratio=0.25)),
             (prefix_prompt(10, 2), dict(selector="attention", anchor_ratio=1.0)),
             (prefix_prompt(8, 1), dict(selector="attention", anchor_ratio=0.3, probe_step=True)),  # the probe runs
             (layouts()["two-affix"], dict(selector="attention", anchor_ratio=0.3)),  # the first exact, the second not
             (layouts()["two-affix"], dict(selector="cacheblend", anchor_ratio=0.3, anchor_pass="two"))]
    base = dict(gen_length=8, block_length=4, threshold=0.6)
    prompts = [prompt for prompt, _ in cases]
    params = [SamplingParams(**{**base, **kw}) for _, kw in cases]
    outs = run_engine(model, prompts, params, arrivals=[0, 1, 0, 2, 1, 3, 0, 2, 1])
    store = AffixStore(model)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        ref = reference_generate(model, prompt, sp, store)
        assert out.token_ids == ref.token_ids and out.anchors == ref.anchors, sp
    # ratio 1 on a 10-token prefix: 8 anchors, its columns 8-9 sharing the request's block are recomputed anyway
    assert [len(out.anchors) for out in outs] == [0, 0, 0, 0, 2, 8, 0, 6, 6]  # ceil(0.3 * 20): the second affix's
    assert outs[5].cached_tokens == 0
    # no anchor on a column recomputed anyway (a block shared with the question): the infix affix (3-10) keeps 4-7,
    # the two-affix requests' second affix (11-30) neither 11 nor 28-30, in one pass and in a pass of its own
    assert set(outs[4].anchors) <= {4, 5, 6, 7}
    assert not {11, 28, 29, 30} & {a for out in outs[-2:] for a in out.anchors}
    assert [outs[-2].cached_tokens, outs[-1].cached_tokens] == [8 + 20 - 4 - 6] * 2
    doc = prompts[-1].affixes[1]
    assert all(doc.start <= a < doc.start + doc.length for out in outs[-2:] for a in out.anchors)
    for i in range(4):
        kw = {k: v for k, v in cases[i][1].items() if k not in ("selector", "anchor_ratio")}
        direct = SamplingParams(**{**base, **kw, "selector": "none"})
        assert outs[i].token_ids == reference_generate(model, prompts[i], direct, store).token_ids


@pytest.mark.parametrize("selector", ["attention", "kv-deviation"])
def test_an_exact_prefix_affix_runs_no_selection(model, selector, monkeypatch):
    """A request whose only affix is exact runs neither a selecting refresh nor a selection pass of its own: each
    layer runs once a decoding step (NFE), and the one-pass forward is never called."""
    from acache.engine import model_runner

    selecting = []
    real = model_runner.refresh_selecting
    monkeypatch.setattr(model_runner, "refresh_selecting", lambda *a: selecting.append(1) or real(*a))
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 26))
    prompt, params = prefix_prompt(8, 1), SamplingParams(gen_length=8, block_length=4, threshold=0.6,
                                                         selector=selector, anchor_ratio=0.3)
    run_engine(model, [prompt], params, engine=engine)  # the affix's own forward, cached for the run counted
    calls = []
    hooks = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in model.layers]
    try:
        (out,) = run_engine(model, [prompt], params, engine=engine)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.anchors == [] and len(calls) == len(model.layers) * out.nfe and not selecting
    # the same request with its affix after a token is approximate: it selects (in one pass for attention)
    infix = SamplingParams(gen_length=8, block_length=4, threshold=0.6, selector=selector, anchor_ratio=0.3)
    (out,) = run_engine(model, [infix_prompt()], infix, engine=engine)
    assert len(out.anchors) == 3 and bool(selecting) == (selector == "attention")


def test_engine_matches_reference_with_mixed_requests(model):
    prompts = [prefix_prompt(10, 7)] + [AffixPrompt.from_spans(p) for p in random_prompts([3, 6, 9], seed=2)]
    prompts.append(infix_prompt())  # an infix affix: approximate, anchors as for LLaDA
    params = [SamplingParams(gen_length=8, block_length=4, selector="attention", anchor_ratio=0.5),
              SamplingParams(gen_length=8, block_length=2, remasking="low_confidence", steps=8),
              SamplingParams(gen_length=16, block_length=8, cache="prefix", threshold=0.4),
              SamplingParams(gen_length=8, block_length=4, temperature=0.7, seed=1),
              SamplingParams(gen_length=8, block_length=4, selector="attention", probe_step=True)]
    outs = run_engine(model, prompts, params, arrivals=[0, 2, 0, 1, 3])
    store = AffixStore(model)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        ref = reference_generate(model, prompt, sp, store)
        assert out.token_ids == ref.token_ids and out.anchors == ref.anchors, sp
        assert (out.nfe, out.refreshes) == (ref.nfe, ref.refreshes), sp


def test_text_after_the_answer_is_refused_not_ignored(model, blockdiff_dir):
    """A block-causal model reads no later block: a suffix (an affix or plain text after the answer) was computed at
    every refresh and never read, the answer the same whatever it said. What users call (LLM.generate, the server's
    check before a request, so the CLI too) refuses it by name, as for the state-cache families."""
    from acache import LLM

    suffix = layouts(affix_len=8)["suffix"]
    plain_suffix = AffixPrompt.from_spans(random_prompts([12], seed=3)[0], 5)
    llm = LLM(blockdiff_dir, kv_cache_memory=1 << 24)
    for prompt, params in ((suffix, SamplingParams(gen_length=4, block_length=4, selector="attention")),
                           (plain_suffix, SamplingParams(gen_length=4, block_length=4))):
        after = len(prompt.token_ids) - prompt.gen_at
        with pytest.raises(ValueError, match=f"the prompt has {after} tokens after its generation region, which a "
                                             "fast_dllm_v2 model cannot read"):
            LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24)).check_request(prompt, params)
        with pytest.raises(ValueError, match=f"prompt 1: the prompt has {after} tokens after its generation region"):
            llm.generate([layouts(affix_len=8)["prefix"], prompt], params, use_tqdm=False)
    assert llm.engine.request_ids() == []  # the batch is checked whole before any of it is queued
