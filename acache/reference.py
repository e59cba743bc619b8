"""The reference path: one request alone, on dense tensors, with no pages, no batching and no padding.

It exists as the oracle the engine is tested against: it drives the same per-request state machine
(:class:`~acache.decoding.request_state.RequestState`) and the same selectors, but keeps the request's
K/V in one dense ``[T, Hkv, D]`` tensor a layer and runs every forward on a batch of one. Any
difference between the engine and this path is a batching, padding or paging bug. The state-cache families
have theirs beside it, :func:`reference_generate_state_cache`: one request, its own cache, the runner's
:func:`~acache.engine.state_runner.run_plans` on a batch of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from acache.affix.bicache import BiCacheProfile, bicache_depth, bicache_forward
from acache.affix.context import SelectionContext, request_seed
from acache.affix.one_pass import refresh_selecting, selecting_inputs
from acache.affix.placement import place_affixes
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import admission_anchors, drop_uncounted, make_selector, request_anchor_counts
from acache.affix.store import AffixStore
from acache.decoding.request_state import RequestState
from acache.decoding.sampler import propose
from acache.engine.state_cache_manager import BlockCache, check_state_request
from acache.engine.state_runner import new_state, run_plans
from acache.models.base import DiffusionLM
from acache.models.kv import KVCache
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams


@dataclass
class ReferenceResult:
    token_ids: list[int]  # cut at the first stop token
    anchors: list[int]  # absolute positions of the recomputed affix tokens
    nfe: int
    refreshes: int
    bicache_depth: int | None = None


@torch.inference_mode()
def reference_generate(model: DiffusionLM, prompt: AffixPrompt | Sequence[int], params: SamplingParams,
                       store: AffixStore | None = None, stop_token_ids: Sequence[int] = (),
                       generator: torch.Generator | None = None,
                       bicache_profile: BiCacheProfile | None = None) -> ReferenceResult:
    """Decodes one request alone. ``store`` holds the shared affixes (a fresh one if None); ``generator``
    draws its sampling noise (seeded from ``params.seed`` if None)."""
    cfg = model.config
    if not isinstance(prompt, AffixPrompt):
        prompt = AffixPrompt(tuple(prompt), len(prompt))  # its ids taken as integers, or named
    prompt.check_fits(cfg.vocab_size, cfg.max_position_embeddings, params.gen_length)
    if params.focus_layers is not None:
        raise ValueError("focus_layers is not run by the reference path (FOCUS prunes the engine's batched "
                         "steps); compare a focused engine run with the engine's own unfocused one")
    if generator is None:
        generator = params.generator(model.device, default_seed=0)
    stops = params.stop_ids({cfg.eos_token_id, *stop_token_ids})
    state = RequestState(prompt.layout, params, cfg.mask_token_id, cfg.pad_token_id, model.shifted_logits,
                         model.device, stops, cfg.block_size)
    t, dev = state.length, model.device
    shape = (t, cfg.num_kv_heads, cfg.head_dim)
    keys = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in model.layers]
    values = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in model.layers]
    reuse, bicache = params.affix_reuse(bool(prompt.affixes))
    store = store if store is not None else AffixStore(model)
    shared = torch.zeros(t, dtype=torch.bool, device=dev)
    held, spans = [], []
    try:
        for span in prompt.affixes if reuse else ():
            entry, _ = store.acquire(prompt.affix_ids(span), span.name)
            held.append(entry)
            c0 = state.canvas.column(0, span.start)
            spans.append((c0, c0 + span.length, entry))
            shared[c0:c0 + span.length] = True
            for layer in range(len(keys)):
                keys[layer][c0:c0 + span.length] = entry.keys[layer]
                values[layer][c0:c0 + span.length] = entry.values[layer]
        depth = split = None
        done = False
        cols = [(c0, c1) for c0, c1, _ in spans]
        counts = [] if bicache else request_anchor_counts(state, cols)
        if bicache:
            depth = bicache_depth(params.selector, params.anchor_ratio, len(model.layers),
                                  int(shared.sum()) / t, bicache_profile)
            split = len(model.layers) - depth
            for entry in held:
                store.ensure_hidden(entry)
            state.admit()
        elif reuse and spans and (anchors := admission_anchors(make_selector(params.selector, params.anchor_query),
                                                               state, cols, counts, prompt.token_ids)) is not None:
            state.admit(shared, anchors)  # nothing to choose with a forward (no anchors, or a layout-only selector)
        elif reuse and params.resolved_anchor_pass == "one":  # chosen inside the first refresh
            state.admit(shared, select=True)
        elif reuse:
            placements = [[(span.start, entry) for span, entry in zip(prompt.affixes, held, strict=True)]]
            # masks beyond a far window are out of selection's forwards, as out of every other
            canvas = replace(state.canvas, valid=state.canvas.valid & ~state.far_columns())
            kv, slot = place_affixes(model, canvas, placements)
            ctx = SelectionContext(model, canvas, slot, kv, [request_seed(params.seed, prompt.token_ids)],
                                   state.base_recompute(shared)[None])
            anchors = make_selector(params.selector, params.anchor_query).select(ctx, params.anchor_ratio)[0]
            state.admit(shared, drop_uncounted(anchors, cols, counts))
            if params.probe_step:
                x0, conf = propose(ctx.probe_logits(params.block_length), params.temperature,
                                   [generator] if params.temperature > 0 else None, mask_token_id=cfg.mask_token_id)
                done = state.commit(x0[0], conf[0], probe=True)
        else:
            state.admit()
        while not done:
            plan = state.plan()
            fed, past = plan.fed, plan.past
            pos = state.positions
            block = plan.block[None]
            if plan.select:
                hidden, block = _select_refresh(model, state, spans, keys, values), fed[plan.block][None]
            elif split is not None and plan.refresh:
                hidden = _bicache_refresh(model, state, spans, split, fed, keys, values)
            else:
                cache = KVCache([k[past][None] for k in keys], [v[past][None] for v in values], pos[past][None],
                                torch.ones(1, len(past), dtype=torch.bool, device=dev)) if len(past) else None
                out = model(state.tokens[fed][None], pos[fed][None], None, past=cache, return_kv=plan.write)
                if plan.write:
                    for layer in range(len(keys)):
                        keys[layer][fed] = out.kv.keys[layer][0].to(keys[layer].dtype)
                        values[layer][fed] = out.kv.values[layer][0].to(values[layer].dtype)
                hidden = out.hidden
            logits = model.logits(hidden, block)
            gens = [generator] if params.temperature > 0 else None
            x0, conf = propose(logits, params.temperature, gens, mask_token_id=cfg.mask_token_id)
            done = state.commit(x0[0], conf[0])
    finally:
        for entry in held:
            store.release(entry)
    ids, _ = state.output()
    return ReferenceResult(ids, state.positions[state.anchors].tolist(), state.nfe, state.refreshes, depth)


def _select_refresh(model: DiffusionLM, state: RequestState, spans: list, keys: list[torch.Tensor],
                    values: list[torch.Tensor]) -> torch.Tensor:
    """The first refresh choosing its anchors inside the forward (:mod:`acache.affix.one_pass`) on the dense K/V,
    where the affixes' cached K/V sit at their columns: fixes the anchors in ``state``, writes the K/V of its own
    columns and anchors, and returns the final states in canvas layout ``[1, T, hidden]``."""
    inputs = selecting_inputs([(state, [(c0, c1) for c0, c1, _ in spans])], state.tokens.device)
    result = refresh_selecting(model, *inputs,
                               lambda layer, cols: (keys[layer][cols], values[layer][cols]))
    state.fix_anchors(result.anchors[0])
    cols = result.cols[0][result.valid[0]]
    for layer in range(len(keys)):
        keys[layer][cols] = result.keys[layer][0][result.valid[0]].to(keys[layer].dtype)
        values[layer][cols] = result.values[layer][0][result.valid[0]].to(values[layer].dtype)
    return result.hidden


def _bicache_refresh(model: DiffusionLM, state: RequestState, spans: list, split: int, fed: torch.Tensor,
                     keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """BiCache's split refresh of the ``fed`` columns (all but far masks), on the dense K/V; returns their final
    states."""
    dev = state.tokens.device
    fed_hidden = torch.zeros(1, len(fed), model.config.hidden_size, dtype=model.dtype, device=dev)
    for c0, c1, entry in spans:
        fed_hidden[0, torch.searchsorted(fed, torch.arange(c0, c1, device=dev))] = entry.hidden[split].to(model.dtype)
    is_affix = state.copied_affix_columns([(c0, c1) for c0, c1, _ in spans])  # the rest runs with the request's own
    own_at = torch.nonzero(~is_affix[fed]).flatten()  # indices into fed
    own, acols = fed[own_at], fed[is_affix[fed]]
    pos = state.positions
    past = KVCache([k[acols][None] for k in keys], [v[acols][None] for v in values], pos[acols][None],
                   torch.ones(1, len(acols), dtype=torch.bool, device=dev))
    ones = torch.ones(1, len(own), dtype=torch.bool, device=dev)
    out, shallow, deep = bicache_forward(model, split, state.tokens[own][None], pos[own][None], ones, past,
                                         fed_hidden, own_at[None], pos[fed][None],
                                         torch.ones(1, len(fed), dtype=torch.bool, device=dev))
    for j in range(split):
        keys[j][own] = shallow.keys[j][0].to(keys[j].dtype)
        values[j][own] = shallow.values[j][0].to(values[j].dtype)
    for j, layer in enumerate(range(split, len(keys))):
        keys[layer][fed] = deep.keys[j][0].to(keys[layer].dtype)
        values[layer][fed] = deep.values[j][0].to(values[layer].dtype)
    return out.hidden


@dataclass
class StateCacheResult:
    token_ids: list[int]  # cut at the first stop token
    nfe: int  # forwards that decoded a step
    cache_bytes: int  # the cache's size once decoding ended


@torch.inference_mode()
def reference_generate_state_cache(model: SSMBlockDiffusionLM | R2LM, prompt: Sequence[int], params: SamplingParams,
                       generator: torch.Generator | None = None) -> StateCacheResult:
    """Decodes one request on its own, the reference the engine is tested against."""
    cfg = model.config
    plain = AffixPrompt(tuple(prompt), len(prompt))  # empty too: the answer starts at column 0, as on the engine
    bad = [t for t in plain.token_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in the vocabulary (got {bad[0]})")
    check_state_request(model.family, plain, params)
    if generator is None:
        generator = params.generator(model.device, default_seed=0)
    state = new_state(model, plain, params, params.stop_ids({cfg.eos_token_id}))
    cache = BlockCache(model.empty_cache())
    while True:
        logits = run_plans(model, [(state.tokens, state.plan(), cache)])[0]
        gens = [generator] if params.temperature > 0 and generator is not None else None
        x0, conf = propose(logits[None], params.temperature, gens, mask_token_id=cfg.mask_token_id)
        if state.commit(x0[0], conf[0]):
            break
    return StateCacheResult(state.output()[0], state.nfe, model.cache_bytes(cache.value))
