"""Running requests on the engine, with per-request parameters and arrival steps, for equivalence tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from acache.engine import EngineConfig, EngineOutput, LLMEngine
from acache.sampling_params import SamplingParams


def as_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    return [params] * n if isinstance(params, SamplingParams) else list(params)


def run_engine(model, prompts, params, arrivals: Sequence[int] | None = None, engine: LLMEngine | None = None,
               generators: Sequence[torch.Generator | None] | None = None, stop_token_ids=(),
               **config) -> list[EngineOutput]:
    """Runs ``prompts`` to completion; request ``i`` is added before engine step ``arrivals[i]``. Returns the
    final outputs in prompt order."""
    params = as_list(params, len(prompts))
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompts)
    if engine is None:
        engine = LLMEngine(model, EngineConfig(**{"kv_cache_memory": 1 << 26, **config}), stop_token_ids)
    ids: dict[int, str] = {}
    done: dict[str, EngineOutput] = {}
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at <= step and i not in ids:
                gen = generators[i] if generators is not None else None
                ids[i] = engine.add_request(prompts[i], params[i], generator=gen)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if step > 100_000:
            raise RuntimeError("the engine did not finish")
    return [done[ids[i]] for i in range(len(prompts))]


def right_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as one right-padded batch: ids ``[B, T]`` and which of them are real."""
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad)
    valid = torch.zeros(ids.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        valid[i, :len(row)] = True
    return ids, valid


def block_causal(model) -> bool:
    """Whether ``model`` attends block-causally (block diffusion), where a few bidirectional properties differ."""
    return model.config.block_size is not None


def tokens(outs: Sequence[EngineOutput]) -> list[list[int]]:
    return [o.token_ids for o in outs]


def fail_proposals_of(monkeypatch, request_id: str) -> None:
    """Makes the proposal of request ``request_id`` raise, after the requests before it in its batch drew theirs."""
    from acache.engine.model_runner import ModelRunner

    real = ModelRunner._propose

    def propose(req, logits):
        if req.request_id == request_id:
            raise ValueError("bad proposal")
        return real(req, logits)

    monkeypatch.setattr(ModelRunner, "_propose", staticmethod(propose))
