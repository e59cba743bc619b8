"""How far a batch is from each of its rows alone, per family, on this device.

On a CPU the engine decodes a batch token for token as each request alone (the test suite's equivalences). On a
GPU the kernels chosen for a padded batch and for one row need not round alike; this probe measures by how much,
on the test suite's tiny random checkpoints (2 layers, width 64): the largest absolute difference between the
logits of a padded batch's forward and each row's alone, and how many of the decodes of the infill layouts
(engine, batched) differ from the reference decoding each alone, with where the first differs.

    python -m acache_lab.probes.batch_invariance --device cuda
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from acache.affix.prompt import AffixPrompt
from acache.engine.llm_engine import EngineConfig, LLMEngine
from acache.models.checkpoint import make_random_checkpoint
from acache.models.loader import load_model
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams

#: the test suite's tiny checkpoints (tests/conftest.py), block-diffusion attention blocks of 4
CHECKPOINT = {"layers": 2, "hidden_size": 64, "heads": 4, "kv_heads": 2, "seed": 1, "std": 0.15, "max_seq_len": 512}


def forward_gap(model, rows: list[list[int]]) -> float:
    """Largest ``|logits(batch) - logits(row alone)|`` over the rows' own positions."""
    width = max(len(r) for r in rows)
    dev = model.device
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=dev)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r, device=dev)
        valid[i, :len(r)] = True
    positions = torch.arange(width, device=dev).expand(len(rows), -1)
    with torch.inference_mode():
        batched = model.logits(model(tokens, positions, valid).hidden)
        gap = 0.0
        for i, r in enumerate(rows):
            alone = model.logits(model(tokens[i:i + 1, :len(r)], positions[i:i + 1, :len(r)]).hidden)
            gap = max(gap, float((batched[i, :len(r)] - alone[0]).abs().max()))
    return gap


def decode_gaps(model, prompts: list[AffixPrompt], params: SamplingParams) -> list[int | None]:
    """Per prompt: the first generated position where the engine's batched decode differs from the reference
    decoding it alone, or None."""
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 26))
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(sum(params.gen_length for _ in prompts) + 1):  # each step commits a token a request at least
        if len(done) == len(ids):
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    if len(done) < len(ids):
        raise RuntimeError(f"the engine left {len(ids) - len(done)} of {len(ids)} requests unfinished")
    firsts = []
    for rid, prompt in zip(ids, prompts, strict=True):
        want = reference_generate(model, prompt, params).token_ids
        got = done[rid]
        firsts.append(next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                           None if len(got) == len(want) else min(len(got), len(want))))
    return firsts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (6, 9, 4, 13)]
    layouts = [(rows[0], 0), (rows[1], 5), (rows[2], 4)]
    prompts = [AffixPrompt(tuple(ids), at) for ids, at in layouts]
    with tempfile.TemporaryDirectory() as root:
        for family in ("llada", "dream", "fast_dllm_v2"):
            extra = {"block_size": 4} if family == "fast_dllm_v2" else {}
            model = load_model(make_random_checkpoint(family, f"{root}/{family}", **CHECKPOINT, **extra),
                               device=args.device)
            model.fuse_projections()
            line = [f"{family}: forward gap {forward_gap(model, rows):.3g}"]
            for cache in ("none", "dual"):
                params = SamplingParams(gen_length=16, block_length=8, cache=cache, threshold=0.5)
                line.append(f"{cache}: first differing position per request {decode_gaps(model, prompts, params)}")
            print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
