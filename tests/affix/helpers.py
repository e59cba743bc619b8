"""Requests with affixes at each position, built from random token ids."""

from __future__ import annotations

import torch

from acache.affix.prompt import AffixPrompt


def layouts(affix_len: int = 20, question_len: int = 6, seed: int = 0, block_causal: bool = False
            ) -> dict[str, AffixPrompt]:
    """One prompt of each layout. A ``block_causal`` model reads nothing after its answer: its "suffix" is the affix
    last before the answer."""
    g = torch.Generator().manual_seed(seed)
    aff = torch.randint(0, 256, (affix_len,), generator=g).tolist()
    sys_aff = torch.randint(0, 256, (8,), generator=g).tolist()
    q = torch.randint(0, 256, (question_len,), generator=g).tolist()
    h = question_len // 2
    n = affix_len
    return {
        "prefix": AffixPrompt.from_spans(aff + q, None, [(0, n)]),
        "infix": AffixPrompt.from_spans(q[:h] + aff + q[h:], None, [(h, h + n)]),
        "suffix": AffixPrompt.from_spans(q + aff, None if block_causal else question_len,
                                         [(question_len, question_len + n)]),
        "two-affix": AffixPrompt.from_spans(sys_aff + q[:h] + aff + q[h:], None,
                                            [(0, 8, "system"), (8 + h, 8 + h + n, "doc")]),
    }


def affix_engine(model, store=None, bicache_profile=None, **config):
    from acache.engine import EngineConfig, LLMEngine

    return LLMEngine(model, EngineConfig(**{"kv_cache_memory": 1 << 26, **config}), affix_source=store,
                     bicache_profile=bicache_profile)


def affix_run(model, prompts, params, store=None, engine=None, bicache_profile=None, arrivals=None):
    """Engine outputs of ``prompts`` (one AffixPrompt or a list) under ``params`` (one or one per prompt)."""
    from tests.helpers import run_engine

    prompts = prompts if isinstance(prompts, list) else [prompts]
    engine = engine or affix_engine(model, store, bicache_profile)
    return run_engine(model, prompts, params, arrivals=arrivals, engine=engine)


def assert_each_as_alone(model, prompts, params, store, arrivals) -> None:
    """``prompts`` under ``params`` (one each) decode on the engine, batched at once and arriving at the steps
    ``arrivals``, as each does alone on the reference path: tokens and anchors."""
    from acache.reference import reference_generate

    batched = affix_run(model, prompts, params, store)
    staggered = affix_run(model, prompts, params, store, arrivals=arrivals)
    for prompt, p, b, s in zip(prompts, params, batched, staggered, strict=True):
        alone = reference_generate(model, prompt, p, store)
        assert alone.token_ids == b.token_ids == s.token_ids
        assert alone.anchors == b.anchors == s.anchors


def selection_context(model, prompts, gen_length: int, store=None):
    """The all-mask canvas of ``prompts`` (one AffixPrompt or a list) with their affixes' cached K/V placed:
    what a selector sees at admission."""
    from acache.affix.context import SelectionContext
    from acache.affix.placement import place_affixes
    from acache.affix.store import AffixStore
    from acache.decoding.canvas import build_canvas

    prompts = prompts if isinstance(prompts, list) else [prompts]
    store = store or AffixStore(model)
    canvas = build_canvas([p.layout for p in prompts], gen_length, model.config.mask_token_id,
                          model.config.pad_token_id, model.device)
    kv, slot = place_affixes(model, canvas, [[(s.start, store.compute(p.affix_ids(s))) for s in p.affixes]
                                             for p in prompts])
    return SelectionContext(model, canvas, slot, kv)
