"""Probe: can the state-space mixer learn a lookup at all, from scratch and at the task model's scale?

The diagnostic behind docs/model.md's state-space section. Multi-query associative recall: a row is
``pairs`` facts ``key [gap fillers] value`` (distinct keys, random values), then one of the keys and a mask;
the model is trained on the mask's column only (cross-entropy on the value) and scored on 512 fixed
held-out rows. Guessing among the row's values scores 1/pairs. ``--family fast_dllm_v2`` (block-causal
attention) or ``llada`` (bidirectional) trains an attention model of the same width instead, as a control.
Weights start as the trainer starts them (token embeddings at N(0, 1)).

    python -m acache_lab.probes.recall --steps 5000
    python -m acache_lab.probes.recall --steps 5000 --family fast_dllm_v2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from acache.models.checkpoint import family_model
from acache_lab.train.trainer import init_for_training_, training_logits

KEYS, VALUES, FILLERS = 24, 24, 3


def rows(n: int, pairs: int, gap: int, gen: torch.Generator, mask: int, query_gap: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``pairs`` facts and a query (``query_gap`` fillers between the asked key and the mask),
    and the value each query asks for."""
    fill = [KEYS + VALUES + i % FILLERS for i in range(gap)]
    after = [KEYS + VALUES + i % FILLERS for i in range(query_gap)]
    ids, answers = [], []
    for _ in range(n):
        keys = torch.randperm(KEYS, generator=gen)[:pairs].tolist()
        values = torch.randint(KEYS, KEYS + VALUES, (pairs,), generator=gen).tolist()
        asked = int(torch.randint(pairs, (1,), generator=gen))
        ids.append([t for k, v in zip(keys, values, strict=True) for t in (k, *fill, v)] + [keys[asked], *after, mask])
        answers.append(values[asked])
    return torch.tensor(ids), torch.tensor(answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="blockdiff_ssm", choices=["blockdiff_ssm", "fast_dllm_v2", "llada"])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--gap", type=int, default=0, help="filler tokens between a key and its value")
    ap.add_argument("--query-gap", type=int, default=0, help="filler tokens between the asked key and the mask")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--state-size", type=int, default=16)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--scan-init", default="long", choices=["short", "long"])
    ap.add_argument("--embed-init-std", type=float, default=1.0, help="token embeddings at init (docs/model.md, run 3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 1 <= args.pairs <= KEYS:
        ap.error(f"--pairs must be between 1 and {KEYS}")

    vocab = KEYS + VALUES + FILLERS + 2
    mask, eos = vocab - 1, vocab - 2
    scan = {"state_size": args.state_size, "conv_kernel": args.conv_kernel} if args.family == "blockdiff_ssm" else {}
    block = {} if args.family == "llada" else {"block_size": 8}
    model = family_model(args.family, vocab, mask, eos, layers=args.layers, hidden_size=args.hidden_size, heads=4,
                         intermediate_size=2 * args.hidden_size, **block, **scan)
    init_for_training_(model, args.seed, 0.02, args.embed_init_std, torch.Generator().manual_seed(args.seed),
                       args.scan_init)  # the trainer's own initialisation
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def answer_logits(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return training_logits(model, ids, positions, torch.ones_like(ids, dtype=torch.bool))[:, -1]

    gen = torch.Generator().manual_seed(args.seed)
    test_ids, test_answers = rows(512, args.pairs, args.gap, torch.Generator().manual_seed(10_000 + args.seed), mask,
                                    args.query_gap)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, answers = rows(args.batch_size, args.pairs, args.gap, gen, mask, args.query_gap)
        loss = F.cross_entropy(answer_logits(ids), answers)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            with torch.no_grad():
                acc = (answer_logits(test_ids).argmax(-1) == test_answers).float().mean().item()
            print(f"{args.family} step {step}: loss {loss.item():.3f}, held-out recall {acc:.1%} "
                  f"(guessing among the row's values: {1 / args.pairs:.1%}; {time.perf_counter() - started:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
