"""Trains a small LLaDA-architecture diffusion LM on the task suite with the masked-diffusion objective.

Per sequence ``t ~ U(0, 1]``; each answer token is masked with probability ``t`` (at least one), and the
loss is the cross-entropy on masked answer tokens weighted by ``1 / t`` (LLaDA's SFT objective; the
prompt, affix included, stays visible unless ``context_mask_rate`` masks some of it too, with the same
weighting). Sequences are drawn fresh every step: a task, a layout, and a context whose length grows
over the curriculum. The result is written in the upstream LLaDA layout, so the public loader reads it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from acache.models.checkpoint import SPECIAL_TOKENS, init_random_, random_config, save_checkpoint, tokenizer_config
from acache.models.llada import LLaDAModel
from acache.tasks.generators import GENERATORS, TASKS
from acache.tasks.render import ANSWER_LENGTH, LAYOUTS, build_word_tokenizer, render

TRAIN_SEED_BASE = 0  # held-out evaluation draws from EVAL_SEED_BASE upwards, a disjoint stream
EVAL_SEED_BASE = 10**9


@dataclass
class ModelShape:
    layers: int = 4
    hidden_size: int = 256
    heads: int = 8
    intermediate_size: int = 768
    max_seq_len: int = 256


@dataclass
class TrainConfig:
    out: str = "models/acache-tiny"
    seed: int = 0
    model: ModelShape = field(default_factory=ModelShape)
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    tasks: tuple[str, ...] = TASKS
    min_sentences: int = 2
    max_sentences: int = 8
    curriculum_steps: int = 1000  # context length grows from min to max over these steps
    context_mask_rate: float = 0.0
    init_std: float = 0.02  # weight matrices at init
    embed_init_std: float = 0.02  # token embeddings at init (see docs/model.md, run 3)
    bf16: bool = True
    time_limit_minutes: float = 90.0
    log_every: int = 10

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"training config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown training options {sorted(unknown)}")
        if "model" in raw:
            raw["model"] = ModelShape(**raw["model"])
        if "tasks" in raw:
            raw["tasks"] = tuple(raw["tasks"])
        return cls(**raw)

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in GENERATORS]
        if bad:
            raise ValueError(f"unknown task {bad[0]!r}; known: {', '.join(TASKS)}")
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError("steps and batch_size must be positive")
        if self.init_std <= 0 or self.embed_init_std <= 0:
            raise ValueError("init_std and embed_init_std must be positive")
        if not 1 <= self.min_sentences <= self.max_sentences:
            raise ValueError("need 1 <= min_sentences <= max_sentences")


class Batcher:
    """Fresh training sequences: canvas ids, the answer columns, positions and padding."""

    def __init__(self, config: TrainConfig, tokenizer) -> None:
        self.config = config
        self.tok = tokenizer
        self.rng = random.Random(config.seed)
        self.eos = tokenizer.token_to_id(SPECIAL_TOKENS["llada"]["eos"])
        self.mask = tokenizer.token_to_id(SPECIAL_TOKENS["llada"]["mask"])
        self.pad = self.eos
        self._counter = TRAIN_SEED_BASE

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def sentences(self, step: int) -> int:
        c = self.config
        frac = min(1.0, step / max(1, c.curriculum_steps))
        top = c.min_sentences + round(frac * (c.max_sentences - c.min_sentences))
        return self.rng.randint(c.min_sentences, top)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``ids [B, T]``, ``answer [B, T]`` (True on answer columns), ``positions``, ``valid``."""
        rows = []
        for _ in range(self.config.batch_size):
            task = self.rng.choice(self.config.tasks)
            self._counter += 1
            rng = random.Random(f"train:{task}:{self._counter}")
            example = self.rng.choice(GENERATORS[task](rng, self.sentences(step)))
            r = render(example, self.rng.choice(LAYOUTS), self.encode, self.eos)
            ids = list(r.prompt.token_ids)
            g = r.prompt.gen_at
            rows.append((ids[:g] + list(r.answer) + ids[g:], g))
        width = max(len(ids) for ids, _ in rows)
        b = len(rows)
        ids = torch.full((b, width), self.pad, dtype=torch.long)
        answer = torch.zeros((b, width), dtype=torch.bool)
        valid = torch.zeros((b, width), dtype=torch.bool)
        for i, (row, g) in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            valid[i, :len(row)] = True
            answer[i, g:g + ANSWER_LENGTH] = True
        positions = torch.arange(width).expand(b, -1).contiguous()
        return ids, answer, positions, valid


def masked_diffusion_loss(model: LLaDAModel, ids: torch.Tensor, answer: torch.Tensor, positions: torch.Tensor,
                          valid: torch.Tensor, mask_id: int, gen: torch.Generator,
                          context_mask_rate: float = 0.0) -> torch.Tensor:
    """LLaDA's objective on the answer (and optionally some context): 1/t-weighted CE on masked tokens."""
    b, t_len = ids.shape
    # stratified over the batch: each t is still U(0, 1], but the batch covers the range evenly, which
    # tames the variance of the 1/t weight
    t = ((torch.arange(b)[:, None] + torch.rand(b, 1, generator=gen)) / b).clamp_min(1e-3)
    u = torch.rand(b, t_len, generator=gen)
    masked = answer & (u < t)
    first = answer.float().argmax(-1)  # every row masks at least one answer token
    masked[torch.arange(b), first] |= ~masked.any(-1)
    if context_mask_rate > 0:
        masked |= valid & ~answer & (u < t * context_mask_rate)
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    hidden = model(noisy, positions, valid).hidden
    logits = model.logits(hidden)
    ce = F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none")
    weight = masked.float() / t
    return (ce * weight).sum() / (b * ANSWER_LENGTH)


def train(config: TrainConfig, progress: bool = True) -> dict:
    torch.manual_seed(config.seed)
    tokenizer = build_word_tokenizer()
    spec = SPECIAL_TOKENS["llada"]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    shape = config.model
    model_config = random_config("llada", vocab, tokenizer.token_to_id(spec["mask"]),
                                 tokenizer.token_to_id(spec["eos"]), layers=shape.layers,
                                 hidden_size=shape.hidden_size, heads=shape.heads,
                                 intermediate_size=shape.intermediate_size, max_seq_len=shape.max_seq_len)
    model = LLaDAModel(model_config)
    init_random_(model, config.seed, std=config.init_std)
    with torch.no_grad():  # norms start at one for training
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.embed.weight.normal_(0.0, config.embed_init_std, generator=torch.Generator().manual_seed(config.seed))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < config.warmup:
            return config.lr * (step + 1) / config.warmup
        progress_frac = (step - config.warmup) / max(1, config.steps - config.warmup)
        return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_frac))))

    batcher = Batcher(config, tokenizer)
    gen = torch.Generator().manual_seed(config.seed + 1)
    log: list[dict] = []
    started = time.perf_counter()
    window: list[float] = []
    bar = tqdm(range(config.steps), desc="train", unit="step", disable=not progress)
    steps_done = 0
    for step in bar:
        if time.perf_counter() - started > 60 * config.time_limit_minutes:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids, answer, positions, valid = batcher.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            loss = masked_diffusion_loss(model, ids, answer, positions, valid, batcher.mask, gen,
                                         config.context_mask_rate)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        window.append(loss.item())
        if len(window) == config.log_every or step == config.steps - 1:
            mean = sum(window) / len(window)
            log.append({"step": steps_done, "loss": mean, "lr": lr_at(step),
                        "elapsed_s": time.perf_counter() - started})
            bar.set_postfix(loss=f"{mean:.3f}")
            window = []
    bar.close()
    model.eval()
    out = Path(config.out)
    save_checkpoint(model, out, tokenizer, tokenizer_config("llada", tokenizer))
    summary = {"config": asdict(config), "steps_done": steps_done, "train_time_s": time.perf_counter() - started,
               "parameters": sum(p.numel() for p in model.parameters()), "log": log}
    (out / "training_log.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(log, out / "loss_curve.png")
    return summary


def plot_loss(log: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in log], [r["loss"] for r in log])
    ax.set_xlabel("step")
    ax.set_ylabel("masked-diffusion loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
