"""Decoding a model that sees no later block and keeps the finished ones in a cache of its own: the
state-space variant (:class:`~acache.models.ssm.SSMBlockDiffusionLM`, a state) and R2LM
(:class:`~acache.models.r2lm.R2LM`, attention K/V). Both offer ``empty_cache()``, ``extend(tokens, start,
cache) -> (logits, cache)``, ``extend_many(rows, logits=, cache=)`` (the same for several rows at once, either
output skipped when it is not wanted) and ``cache_bytes(cache)``.

The request's :class:`~acache.decoding.request_state.RequestState` decides every step, as for the attention
families: with a cached policy a step feeds the model blocks its decoding block touches, against the cache
of every column before them. :func:`run_plans` carries that out for one request or many: it first advances
each cache over the columns the plan now reads from it (all final: the prompt and finished blocks), then runs
the fed columns against it, leaving the cache as it was. With ``cache="none"`` the whole canvas runs from an
empty cache at every step: the uncached path the cached one must equal token for token. The engine's
:mod:`~acache.engine.state_runner` and :func:`generate_blockwise` (the reference loop) share this code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from acache.affix.prompt import AffixPrompt
from acache.decoding.request_state import RequestState, StepPlan
from acache.decoding.sampler import propose
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams


@dataclass
class BlockCache:
    """One request's cache: what ``extend`` left after canvas columns ``[0, covered)``."""

    value: Any
    covered: int = 0


@dataclass
class BlockwiseResult:
    token_ids: list[int]  # cut at the first stop token
    nfe: int  # forwards that decoded a step
    cache_bytes: int  # the cache's size once decoding ended


def run_plans(model: SSMBlockDiffusionLM | R2LM, items: Sequence[tuple[torch.Tensor, StepPlan, BlockCache]]
              ) -> list[torch.Tensor]:
    """The block logits ``[L, V]`` of each ``(tokens, plan, cache)``. A plan reads columns ``[0, P)`` from the
    cache and feeds ``[P, ...)``; each cache is first advanced to ``P`` (in place), then every fed segment
    runs against its cache, all rows through one ``extend_many`` each time."""
    behind = [(tokens, plan, cache) for tokens, plan, cache in items if len(plan.past) > cache.covered]
    if behind:
        rows = [(tokens[cache.covered:len(plan.past)], cache.covered, cache.value) for tokens, plan, cache in behind]
        for (_, plan, cache), (_, value) in zip(behind, model.extend_many(rows, logits=False), strict=True):
            cache.value, cache.covered = value, len(plan.past)
    for _, plan, cache in items:
        if len(plan.past) != cache.covered:
            raise RuntimeError(f"the cache covers {cache.covered} columns but the step reads {len(plan.past)}")
    rows = [(tokens[plan.fed], len(plan.past), cache.value if len(plan.past) else model.empty_cache())
            for tokens, plan, cache in items]
    return [logits[plan.block] for (_, plan, _), (logits, _) in zip(items, model.extend_many(rows, cache=False),
                                                                     strict=True)]


def new_state(model: SSMBlockDiffusionLM | R2LM, prompt: AffixPrompt, params: SamplingParams,
              stop_token_ids: set[int] | frozenset[int]) -> RequestState:
    """A request's decoding state for a state-cache model (no affix is shared: every column is its own)."""
    cfg = model.config
    state = RequestState(prompt.layout, params, cfg.mask_token_id, cfg.pad_token_id, model.shifted_logits,
                         model.device, stop_token_ids, cfg.block_size, state_cache=True)
    none = torch.zeros(state.length, dtype=torch.bool, device=model.device)
    state.set_recompute(none, none)
    return state


def check_blockwise_request(family: str, prompt: AffixPrompt, params: SamplingParams) -> None:
    """What a family decoded block by block cannot do, refused by name; the engine and
    :func:`generate_blockwise` both ask here, so the two accept the same requests."""
    if params.affix_policy is not None and prompt.affixes:
        raise ValueError(f"affix reuse (affix_policy={params.affix_policy!r}) is not supported for the "
                         f"{family} family: its cache is built block by block, per request")
    for name in ("focus_layers", "far_mask_window"):
        if getattr(params, name) is not None:
            raise ValueError(f"{name} is not supported for the {family} family")
    if prompt.gen_at != len(prompt.token_ids):
        raise ValueError(f"the prompt has {len(prompt.token_ids) - prompt.gen_at} tokens after its generation "
                         f"region, which a {family} model cannot read (it sees no later block): "
                         "put all of the prompt before the answer")


@torch.inference_mode()
def generate_blockwise(model: SSMBlockDiffusionLM | R2LM, prompt: Sequence[int], params: SamplingParams,
                       generator: torch.Generator | None = None) -> BlockwiseResult:
    """Decodes one request on its own, the reference the engine is tested against."""
    cfg = model.config
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if not prompt or bad:
        raise ValueError("prompt must be a non-empty list of token ids in the vocabulary"
                         + (f" (got {bad[0]})" if bad else ""))
    ids = tuple(int(t) for t in prompt)
    plain = AffixPrompt(ids, len(ids))
    check_blockwise_request(model.family, plain, params)
    if generator is None:
        generator = params.generator(model.device, default_seed=0)
    state = new_state(model, plain, params, {cfg.eos_token_id, *params.stop_token_ids})
    cache = BlockCache(model.empty_cache())
    while True:
        logits = run_plans(model, [(state.tokens, state.plan(), cache)])[0]
        gens = [generator] if params.temperature > 0 and generator is not None else None
        x0, conf = propose(logits[None], params.temperature, gens, mask_token_id=cfg.mask_token_id)
        if state.commit(x0[0], conf[0]):
            break
    return BlockwiseResult(state.output()[0], state.nfe, model.cache_bytes(cache.value))
