"""A Fast-dLLM-style reference loop, the shape of upstream's ``generate_with_dual_cache``: a batch of equal-length
prompts decoded in lockstep on one dense canvas; at each block start one forward of every request's whole prompt
and canvas (its K/V kept), inside the block the block alone against them. No pages, no scheduler, no affix reuse:
what a user of the upstream code runs, timed beside the engine by ``acache bench --fastdllm-loop``."""

from __future__ import annotations

import time

import torch

from acache.decoding.commit import commit_step, make_commit_rule
from acache.decoding.sampler import propose
from acache.models.base import DiffusionLM
from acache.sampling_params import SamplingParams


@torch.inference_mode()
def fastdllm_generate(model: DiffusionLM, prompts: list[list[int]], params: SamplingParams,
                      ) -> tuple[list[list[int]], float, float]:
    """The generated region of each prompt (no stop-token cut: the engine benchmark counts every column), and the
    seconds spent in block-start forwards and in in-block forwards. Greedy; an unshifted, bidirectional model."""
    if model.shifted_logits or model.config.block_size is not None:
        raise ValueError("the Fast-dLLM-style loop is written for LLaDA-style models (unshifted, bidirectional)")
    if params.temperature > 0 or params.selector is not None or params.cache != "dual":
        raise ValueError("the Fast-dLLM-style loop decodes greedily on the dual cache, with no affix reuse")
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the Fast-dLLM-style loop batches prompts of one length, as upstream does")
    cfg, dev = model.config, model.device
    b, n, block = len(prompts), len(prompts[0]), params.block_length
    total = n + params.gen_length
    x = torch.full((b, total), cfg.mask_token_id, dtype=torch.long, device=dev)
    x[:, :n] = torch.tensor(prompts, dtype=torch.long, device=dev)
    positions = torch.arange(total, device=dev).expand(b, -1)
    rule = make_commit_rule(params)
    refresh_s = step_s = 0.0
    for index in range(params.num_blocks):
        start, end = n + index * block, n + (index + 1) * block
        masked = x[:, start:end] == cfg.mask_token_id
        rule.begin_block(masked.sum(-1))
        t0 = _synced(dev)
        out = model(x, positions, return_kv=True)  # the whole prompt and canvas, recomputed at every block start
        logits = model.logits(out.hidden, slice(start, end))
        past = out.kv.columns(torch.cat((torch.arange(start, device=dev), torch.arange(end, total, device=dev))))
        refresh_s += _synced(dev) - t0
        step = 0
        while True:
            x0, conf = propose(logits, 0.0, mask_token_id=cfg.mask_token_id)
            x[:, start:end], masked = commit_step(rule, x[:, start:end], x0, conf, masked, step, False)
            step += 1
            if not bool(masked.any()):
                break
            t0 = _synced(dev)
            logits = model.logits(model(x[:, start:end], positions[:, start:end], past=past).hidden)
            step_s += _synced(dev) - t0
    return x[:, n:].tolist(), refresh_s, step_s


def _synced(device: torch.device) -> float:
    """The clock once ``device`` has done its queued work: on a GPU a forward's time is its kernels', not their
    launches' (the engine's runner times its forwards the same way)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
