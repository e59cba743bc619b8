"""Probe: can a small model learn to bind a name to its place at all, and how fast?

The diagnostic behind docs/model.md's run 3. Stories of 2-4 people who each move once ("mary moved to
the kitchen ."), so no recency is needed and guessing among the story's places scores 1/people; the
question asks where one of them is. Trains the acache LLaDA model (or, with ``--reference``, a stock
``torch.nn.TransformerEncoder`` with learned positions, to rule out a bug in acache's model code) on the
answer only and prints held-out exact match every ``--eval-every`` steps.

    python -m acache_lab.probes.binding --steps 20000 --batch-size 16
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from acache.cli import _positive_int
from acache.models.checkpoint import SPECIAL_TOKENS, random_config
from acache.models.llada import LLaDAModel
from acache_lab.tasks.generators import MOVES, NAMES, PLACES
from acache_lab.tasks.render import build_word_tokenizer
from acache_lab.train.trainer import init_for_training_


class Reference(torch.nn.Module):
    """A stock pre-norm encoder: the control that says a plateau is the task's, not acache's."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, max_len: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_len, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, 3 * hidden, 0.0, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids) + self.pos(positions), src_key_padding_mask=~valid))


def story(rng: random.Random, people: int, layout: str) -> tuple[list[str], int, str]:
    """Words with ``[ANSWER]`` at the answer slot, the slot's index, and the answer."""
    names = rng.sample(NAMES, people)
    where = {n: rng.choice(PLACES) for n in names}
    context = ["story", ":"] + [w for n in names for w in (n, rng.choice(MOVES), "to", "the", where[n], ".")]
    asked = rng.choice(names)
    question = ["question", ":", "where", "is", asked, "?"]
    slot = ["answer", ":", "[ANSWER]"]
    words = {"prefix": context + question + slot, "infix": question + context + slot,
             "suffix": question + slot + context}[layout]
    return words, words.index("[ANSWER]"), where[asked]


def batch(rng: random.Random, tok, size: int, people: tuple[int, int], layouts: list[str], mask_id: int,
          pad_id: int) -> tuple[torch.Tensor, ...]:
    rows = []
    for _ in range(size):
        words, slot, answer = story(rng, rng.randint(*people), rng.choice(layouts))
        ids = [tok.token_to_id(w) if w != "[ANSWER]" else mask_id for w in words]
        rows.append((ids, slot, tok.token_to_id(answer)))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((size, width), pad_id)
    valid = torch.zeros((size, width), dtype=torch.bool)
    for i, (row, _, _) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        valid[i, :len(row)] = True
    slots = torch.tensor([r[1] for r in rows])
    answers = torch.tensor([r[2] for r in rows])
    return ids, torch.arange(width).expand(size, -1), valid, slots, answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=_positive_int, default=3000)
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=_positive_int, default=4)
    p.add_argument("--hidden", type=_positive_int, default=128)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--people", default="2,4", help="min,max people per training story")
    p.add_argument("--eval-people", type=_positive_int, default=4)
    p.add_argument("--layouts", default="prefix,infix,suffix")
    p.add_argument("--reference", action="store_true", help="stock nn.TransformerEncoder instead of acache's")
    p.add_argument("--eval-every", type=_positive_int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embed-std", type=float, default=0.02, help="std of the token embedding at init")
    p.add_argument("--linear-std", type=float, default=0.02, help="std of every other weight matrix at init")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    tok = build_word_tokenizer()
    spec = SPECIAL_TOKENS["llada"]
    mask_id, pad_id = tok.token_to_id(spec["mask"]), tok.token_to_id(spec["eos"])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if args.reference:
        model = Reference(vocab, args.hidden, args.heads, args.layers)

        def logits(ids, pos, valid):
            return model(ids, pos, valid)
    else:
        model = LLaDAModel(random_config("llada", vocab, mask_id, pad_id, layers=args.layers, hidden_size=args.hidden,
                                         heads=args.heads, intermediate_size=3 * args.hidden, max_seq_len=256))
        init_for_training_(model, args.seed, args.linear_std, args.embed_std)

        def logits(ids, pos, valid):
            return model.logits(model(ids, pos, valid).hidden)
    people = tuple(int(x) for x in args.people.split(","))
    layouts = args.layouts.split(",")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    train_rng = random.Random(args.seed)
    held_out = batch(random.Random(10**9 + args.seed), tok, 300, (args.eval_people, args.eval_people), layouts,
                     mask_id, pad_id)
    started, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 100)
        ids, pos, valid, slots, answers = batch(train_rng, tok, args.batch_size, people, layouts, mask_id, pad_id)
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = logits(ids, pos, valid)
        loss = F.cross_entropy(out[torch.arange(len(slots)), slots].float(), answers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.eval_every == 0:
            model.eval()
            ids, pos, valid, slots, answers = held_out
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                pred = logits(ids, pos, valid)[torch.arange(len(slots)), slots].argmax(-1)
            acc = (pred == answers).float().mean().item()
            print(f"step {step:6d}  loss {sum(losses) / len(losses):.3f}  held-out exact match {100 * acc:5.1f}%  "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
            losses = []


if __name__ == "__main__":
    main()
