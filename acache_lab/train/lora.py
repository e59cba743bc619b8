"""Affix-aware LoRA fine-tuning of a real checkpoint (LLaDA, Dream) with the isolation objective.

The task-suite trainer (:mod:`acache_lab.train.trainer`) trains a small model from scratch; a released
8B model is too large to train whole and too valuable to train on synthetic tasks. This module trains low-rank
adapters (``peft``, the optional ``lora`` extra) on a checkpoint directory read by the engine's own loader,
with the same objective: LLaDA's masked-diffusion loss on the answer, a share of the rows computed under the
affix-isolated mask (:func:`acache_lab.train.isolation.isolation_mask`), i.e. as direct reuse serves them, and
optionally the neighbour term on those rows (:mod:`acache_lab.train.neighbours`, low-rank maps and sampled pairs),
without which no isolated run of the tiny models learned a binding inside an affix, and optionally a teacher term on
the other rows: KL(checkpoint || adapted model) of the token distributions, the checkpoint's own predictions taken
with the adapters switched off, so that the adapters keep what the model computes in context (Block-Attention's
second requirement).

Data is JSONL, the calibration format (:mod:`acache_lab.tasks.calibration`) with an answer: one record a line,
``{"affix": str, "prompt": str, "answer": str, "layout": "prefix"|"infix"|"suffix", "answer_prompt": str}``
(``layout`` defaults to prefix, ``answer_prompt`` to ""), tokenized with the checkpoint's own tokenizer; the
answer ends with the tokenizer's stop token. The run writes ``OUT/adapter`` (peft's ``save_pretrained``),
``OUT/finetune_log.json`` and, with ``merge``, ``OUT/merged``: the checkpoint with the adapters folded into
its weights, in the upstream layout, with the source's tokenizer files and the affix-training record that makes
the engine's front ends serve it by direct reuse.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from acache.affix.prompt import Affix, layout_segments, resolve_segments
from acache.models.base import DiffusionLM
from acache.models.checkpoint import derive_from, save_checkpoint
from acache.models.loader import checkpoint_dir, load_model, parse_device
from acache.models.tokenizer import Tokenizer
from acache.policies import LAYOUTS
from acache_lab.train.isolation import span_owners
from acache_lab.train.neighbours import NeighbourHeads, is_weight, is_whole, neighbour_record
from acache_lab.train.stopping import stop_requests
from acache_lab.train.trainer import (
    Neighbours,
    Row,
    Teacher,
    answer_row,
    collate_rows,
    masked_diffusion_loss,
    one_shot_answers,
    teacher_record,
    training_logits,
    with_room,
    writable_out,
    write_affix_training,
)

#: the decoder layer's projections (the unfused nn.Linear modules): attention and MLP
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
LOG_FILE = "finetune_log.json"
SHARD_BYTES = 5 * 2**30  # a merged checkpoint's shard size, as upstream shards theirs
PEFT_MISSING = "LoRA fine-tuning needs peft: pip install 'acache[lora]'"


def require_peft():
    """The ``peft`` module, or an ImportError that names the extra to install."""
    try:
        import peft
    except ImportError:
        raise ImportError(PEFT_MISSING) from None
    return peft


@dataclass
class LoraConfig:
    """One fine-tuning run: the checkpoint, the data, the adapters and the optimisation."""

    model: str
    data: str
    out: str
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    steps: int = 500
    lr: float = 1e-4
    warmup: int = 10
    batch_size: int = 4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    #: the share of rows trained as direct reuse serves them (each affix attends only within itself)
    isolation: float = 0.5
    #: weight of the neighbour term (:mod:`acache_lab.train.neighbours`) on the isolated rows: each affix token, at
    #: the output of layer ``neighbour_layer`` (None: a quarter of the way down, as the tiny recipes' 1 of 4),
    #: predicts the tokens up to ``neighbour_span`` either side of it, through maps of rank ``neighbour_rank``
    #: (None: full), ``neighbour_pairs`` sampled pairs an offset a step. 0: off
    neighbours: float = 0.0
    neighbour_layer: int | None = None
    neighbour_span: int = 4
    neighbour_rank: int | None = 64
    neighbour_pairs: int = 32
    #: weight of the teacher term on the rows attending in context: KL(checkpoint || adapted model) of the token
    #: distributions at their masked answer tokens, the checkpoint's own predictions taken with the adapters off
    #: (:func:`~acache_lab.train.trainer.teacher_divergence`). 0: off
    teacher: float = 0.0
    #: up to this many more EOS columns (the config's eos_token_id, LLaDA's |EOS| padding) after a drawn row's answer
    #: (which ends in the tokenizer's stop token), on ``answer_room_share`` of the
    #: draws (each 1..answer_room, within the context): a served request's max_tokens is rarely its answer's length,
    #: and a model that only saw each answer's own length does not learn to end one in more room (the tiny recipes'
    #: ``answer_room``, docs/accuracy.md "Answers given room"). 0: off
    answer_room: int = 0
    answer_room_share: float = 0.5
    #: held-out records in the data's format, read before training, every ``eval_every`` steps and at the end: each
    #: answer in one shot with its affix computed alone (as direct reuse serves it) and in context, so that the log
    #: (``probe`` in finetune_log.json) shows whether reuse catches up with context and context holds. None: none
    eval_data: str | None = None
    eval_every: int = 100
    merge: bool = False
    device: str = "auto"
    dtype: str = "auto"  # the weights' dtype: auto is the checkpoint's own torch_dtype
    bf16: bool | None = None  # bf16 autocast; None: on a GPU, off on the CPU
    time_limit_minutes: float | None = None
    seed: int = 0
    log_every: int = 10

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        for name in ("lr", "alpha", "grad_clip", "weight_decay", "dropout"):
            value = getattr(self, name)  # infinity or NaN trained to a NaN adapter and exited 0
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, not {value!r}")
        if self.rank <= 0 or self.alpha <= 0:
            raise ValueError(f"rank and alpha must be positive, got rank={self.rank}, alpha={self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout}")
        if self.steps <= 0 or self.batch_size <= 0 or self.log_every <= 0:
            raise ValueError("steps, batch_size and log_every must be positive")
        if not is_whole(self.eval_every, 1):
            raise ValueError(f"eval_every is a positive number of steps, not {self.eval_every!r}")
        if self.lr <= 0 or self.grad_clip <= 0 or self.warmup < 0 or self.weight_decay < 0:
            raise ValueError("lr and grad_clip must be positive, warmup and weight_decay >= 0")
        if not 0.0 <= self.isolation <= 1.0:
            raise ValueError(f"isolation is a share of rows in [0, 1], not {self.isolation}")
        if self.time_limit_minutes is not None and self.time_limit_minutes <= 0:
            raise ValueError(f"time_limit_minutes must be positive, not {self.time_limit_minutes}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module")
        if not is_weight(self.neighbours):
            raise ValueError(f"neighbours is a loss weight >= 0, not {self.neighbours!r}")
        if self.neighbours > 0 and self.isolation == 0:
            raise ValueError("neighbours trains the isolated rows' affix states: it needs isolation > 0")
        if not is_weight(self.teacher):
            raise ValueError(f"teacher is a loss weight >= 0, not {self.teacher!r}")
        if self.teacher > 0 and self.isolation == 1.0:
            raise ValueError("teacher holds the rows attending in context to the checkpoint's predictions: with "
                             "isolation 1 there are none")
        if self.neighbour_layer is not None and not is_whole(self.neighbour_layer, 0):
            raise ValueError(f"neighbour_layer is a layer index >= 0 or None, not {self.neighbour_layer!r}")
        for name in ("neighbour_span", "neighbour_pairs"):
            if not is_whole(getattr(self, name), 1):
                raise ValueError(f"{name} must be a positive whole number, not {getattr(self, name)!r}")
        if not is_whole(self.answer_room, 0):
            raise ValueError(f"answer_room is a number of extra answer columns >= 0, not {self.answer_room!r}")
        if not is_weight(self.answer_room_share) or not 0 < self.answer_room_share <= 1:
            raise ValueError(f"answer_room_share is the share of draws given room, in (0, 1], not "
                             f"{self.answer_room_share!r}")
        if self.teacher > 0 and self.answer_room and self.answer_room_share == 1:
            raise ValueError("teacher holds the rows without answer room to the checkpoint's predictions: with "
                             "answer_room_share 1 there are none")
        if self.neighbour_rank is not None and not is_whole(self.neighbour_rank, 1):
            raise ValueError(f"neighbour_rank must be a positive whole number or None, not {self.neighbour_rank!r}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then constant: a short adapter run has no schedule to speak of."""
        return self.lr * min(1.0, (step + 1) / (self.warmup + 1))

    def neighbour_layer_of(self, layers: int) -> int:
        """The layer whose output the neighbour term trains, on a model of ``layers`` layers."""
        layer = layers // 4 if self.neighbour_layer is None else self.neighbour_layer
        if layer >= layers:
            raise ValueError(f"neighbour_layer is the index of one of the model's {layers} layers, not {layer}")
        return layer


def load_finetune_data(path: str | Path, tokenizer: Tokenizer, stop_id: int, context: int,
                       what: str = "fine-tuning data") -> tuple[list[Row], list[str]]:
    """The JSONL file's rows as training sequences, and the layouts they use; every bad record is reported with
    its line number, a missing or empty file as ``what``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rows, layouts = [], []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: a record is a JSON object, not {type(item).__name__}")
        missing = [k for k in ("affix", "prompt", "answer") if k not in item]
        if missing:
            raise ValueError(f"{where}: the record lacks {', '.join(repr(k) for k in missing)}")
        fields = {k: item.get(k, d) for k, d in (("affix", ""), ("prompt", ""), ("answer", ""),
                                                  ("layout", "prefix"), ("answer_prompt", ""))}
        bad = [k for k, v in fields.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"{where}: {bad[0]!r} must be a string, not {type(fields[bad[0]]).__name__}")
        if fields["layout"] not in LAYOUTS:
            raise ValueError(f"{where}: unknown layout {fields['layout']!r}; choose one of {', '.join(LAYOUTS)}")
        try:
            prompt = resolve_segments(layout_segments(fields["layout"], Affix(fields["affix"]), fields["prompt"],
                                                      fields["answer_prompt"]), encode)
            answer = encode(fields["answer"])
        except ValueError as exc:  # an empty affix, text the vocabulary cannot encode
            raise ValueError(f"{where}: {exc}") from None
        if not answer:
            raise ValueError(f"{where}: the answer is empty")
        row = answer_row(prompt, [*answer, stop_id])
        if len(row.ids) > context:
            raise ValueError(f"{where}: {len(row.ids)} tokens with the answer, more than the model's context of "
                             f"{context}")
        rows.append(row)
        layouts.append(fields["layout"])
    if not rows:
        raise ValueError(f"{path} holds no records ({what})")
    return rows, sorted(set(layouts), key=LAYOUTS.index)


def _check_targets(model: DiffusionLM, targets: tuple[str, ...]) -> None:
    if any(getattr(layer, "fused", False) for layer in model.layers):
        raise ValueError("the model's projections are fused (fuse_projections): LoRA adapts the separate "
                         "nn.Linear modules, so fine-tune a model as load_model returns it")
    linears = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = [t for t in targets if t not in linears]
    if unknown:
        raise ValueError(f"unknown LoRA target module {unknown[0]!r}; the model's linear modules are "
                         f"{', '.join(sorted(linears))}")


@dataclass
class LoraRun:
    """A trained run in memory: the peft-wrapped model, where it came from, its log and its training record."""

    adapted: nn.Module
    source: Path
    summary: dict
    record: dict
    heads: NeighbourHeads | None = None  # the neighbour term's maps, when it trained one (never saved)


def finetune(config: LoraConfig, progress: bool = True) -> dict:
    """Trains LoRA adapters on ``config.model`` with the isolation objective and writes them (and, with
    ``merge``, the merged checkpoint) under ``config.out``; returns the run's log. A Ctrl-C or SIGTERM while it
    writes waits for the writing to end (a kill cuts it)."""
    run = train_lora(config, progress)
    with stop_requests(print, "", "saving the adapters: wait a moment (a kill now cuts the files)") as stop:
        stop["saving"] = True  # a signal is noted, not acted on, until the files are whole
        summary = save_run(run, config)
    if stop["asked"] and not summary.get("stopped_by"):
        summary["stopped_by"] = stop["asked"]  # asked while saving: the run was whole, the caller still asked
    return summary


def train_lora(config: LoraConfig, progress: bool = True) -> LoraRun:
    """The training half of :func:`finetune`: nothing is written, so a caller can still look at the adapted
    model before :func:`save_run` (which merges it in place)."""
    peft = require_peft()
    source = checkpoint_dir(config.model)
    writable_out(config.out)  # before the weights load and the steps run: found out at the end, they are lost
    device = parse_device(config.device)
    bf16 = device.type == "cuda" if config.bf16 is None else config.bf16
    for path, what in ((config.data, "fine-tuning data"), (config.eval_data, "held-out data")):
        if path is not None and not Path(path).is_file():  # before the weights: an 8B load takes minutes
            raise FileNotFoundError(f"{what} not found: {path}")
    model = load_model(source, dtype=config.dtype, device=device)
    if model.block_causal or hasattr(model, "train_logits"):
        raise ValueError(f"affix-isolated fine-tuning trains bidirectional attention families (llada, dream), "
                         f"not {model.family}")
    _check_targets(model, config.targets)
    tokenizer = Tokenizer.from_dir(source)
    stop_id = tokenizer.eos_token_id
    if stop_id is None:
        stop_id = model.config.eos_token_id
    context = model.config.max_position_embeddings
    rows, layouts = load_finetune_data(config.data, tokenizer, stop_id, context)
    held = [] if config.eval_data is None else load_finetune_data(config.eval_data, tokenizer, stop_id, context,
                                                                  "held-out data")[0]

    torch.manual_seed(config.seed)  # the adapters' initialisation
    lora = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                           target_modules=list(config.targets))
    adapted = peft.get_peft_model(model, lora)
    adapted.peft_config["default"].base_model_name_or_path = str(source.resolve())
    adapted.train()
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    heads = layer = sampler = None
    if config.neighbours > 0:  # training-only maps: optimised with the adapters, never saved with them
        layer = config.neighbour_layer_of(len(model.layers))
        heads = NeighbourHeads(model.config.hidden_size, config.neighbour_span, config.neighbour_rank).to(device)
        opt.add_param_group({"params": list(heads.parameters()), "weight_decay": 0.0})
        sampler = torch.Generator().manual_seed(config.seed + 2)  # the pairs' draws leave the masking noise alone

    def base_predictions(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        with adapted.disable_adapter():  # the checkpoint as it was: the teacher term's target
            return training_logits(model, ids, positions, valid)

    rng = random.Random(config.seed)
    gen = torch.Generator().manual_seed(config.seed + 1)
    pad = model.config.pad_token_id
    log: list[dict] = []
    window: list[float] = []
    steps_done, tokens = 0, 0
    started = time.perf_counter()
    limit_s = math.inf if config.time_limit_minutes is None else 60 * config.time_limit_minutes
    probes: list[dict] = []
    probing = 0.0  # seconds the probe took, left out of the time limit and the training time

    def probe(at: int) -> None:
        nonlocal probing
        begun = time.perf_counter()
        read = probe_rows(model, held, pad, device, config.batch_size, model.config.mask_token_id, bf16)
        probing += time.perf_counter() - begun
        probes.append({"step": at, **read})
        bar.write(f"probe at step {at}: exact {read['reuse']['exact']:.1%} under reuse, "
                  f"{read['context']['exact']:.1%} in context; answer NLL {read['reuse']['answer_nll']:.3f} / "
                  f"{read['context']['answer_nll']:.3f}")

    bar = tqdm(range(config.steps), desc="finetune", unit="step", disable=not progress)
    if held:
        probe(0)
    stopped_by = None
    with stop_requests(bar.write, "Ctrl-C: stopping after this step and saving what was trained (Ctrl-C again "
                       "quits at once)", "") as stop:
        for step in bar:
            if stop["asked"]:  # Ctrl-C or SIGTERM: what was trained is saved, as at the time limit
                stopped_by = stop["asked"]
                bar.write(f"{stopped_by}: stopped after {steps_done} steps; saving the adapters trained so far")
                break
            if time.perf_counter() - started - probing > limit_s:
                stopped_by = f"the time limit of {config.time_limit_minutes} min"
                bar.write(f"time limit of {config.time_limit_minutes} min reached after {steps_done} steps")
                break
            for group in opt.param_groups:
                group["lr"] = config.lr_at(step)
            drawn = rng.choices(rows, k=config.batch_size)
            if config.answer_room:
                drawn = [with_room(r, rng.randint(1, config.answer_room), model.config.eos_token_id, context)
                         if rng.random() < config.answer_room_share else r for r in drawn]
            batch = collate_rows(drawn, pad).to(device)
            isolated = torch.rand(config.batch_size, generator=gen) < config.isolation
            batch, attention = batch.reused(isolated, model.shifted_logits)
            neighbours = taught = None
            if config.teacher > 0:
                # rows given room aside: the checkpoint never learnt to end an answer in more columns than its own
                plain = torch.tensor([r.room == 0 for r in drawn])
                taught = Teacher(config.teacher, base_predictions, ~isolated & plain)
            if heads is not None:
                owners = span_owners(batch.valid, batch.isolated_spans(isolated))
                neighbours = Neighbours(config.neighbours, heads, layer, owners, config.neighbour_pairs, sampler)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid,
                                             model.config.mask_token_id, gen, masking="count",
                                             weighting="masked_count", attention=attention, neighbours=neighbours,
                                             teacher=taught)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            opt.step()
            steps_done, tokens = step + 1, tokens + int(batch.valid.sum())
            window.append(loss.item())
            if len(window) == config.log_every or steps_done == config.steps:
                mean = sum(window) / len(window)
                log.append({"step": steps_done, "loss": mean, "lr": config.lr_at(step),
                            "elapsed_s": time.perf_counter() - started - probing})
                bar.set_postfix(loss=f"{mean:.3f}")
                window.clear()
            if held and steps_done % config.eval_every == 0:
                probe(steps_done)
    if window:  # the run stopped inside a logging window: its last steps are logged too
        log.append({"step": steps_done, "loss": sum(window) / len(window), "lr": config.lr_at(max(0, steps_done - 1)),
                    "elapsed_s": time.perf_counter() - started - probing})
        window.clear()
    if held and probes[-1]["step"] != steps_done:  # the last step, or where the time limit stopped the run
        probe(steps_done)
    bar.close()
    train_time = time.perf_counter() - started - probing
    adapted.eval()
    record = {"affix_isolation": config.isolation, "steps": steps_done, "init_from": str(source.resolve()),
              "layouts": layouts, "lora": {"rank": config.rank, "alpha": config.alpha,
                                           "targets": list(config.targets),
                                           "data": str(Path(config.data).resolve())}}
    if heads is not None:
        record.update(neighbour_record(config.neighbours, layer, config.neighbour_span))
    if config.teacher > 0:  # the teacher is the checkpoint the adapters start from
        record.update(teacher_record(record["init_from"], config.teacher))
    summary = {"config": asdict(config), "steps_done": steps_done, "train_time_s": train_time, "probe_time_s": probing,
               "tokens": tokens, "rows": len(rows), "layouts": layouts,
               "trainable_parameters": sum(p.numel() for p in trainable),
               "neighbour_parameters": 0 if heads is None else sum(p.numel() for p in heads.parameters()),
               "parameters": sum(p.numel() for p in model.parameters()), "log": log, "probe": probes,
               "stopped_by": stopped_by}
    return LoraRun(adapted, source, summary, record, heads)


def probe_rows(model: DiffusionLM, rows: list[Row], pad: int, device: torch.device, batch_size: int, mask_id: int,
               bf16: bool) -> dict[str, dict[str, float]]:
    """Held-out ``rows`` answered in one shot (:func:`~acache_lab.train.trainer.one_shot_answers`) with every affix
    computed alone ("reuse", what direct reuse serves) and in context ("context"): the share answered exactly and
    the answer tokens' mean negative log-likelihood, a row each."""
    was_training = model.training
    model.eval()
    right = {"reuse": 0, "context": 0}
    nll = {"reuse": 0.0, "context": 0.0}
    for start in range(0, len(rows), batch_size):
        batch = collate_rows(rows[start:start + batch_size], pad).to(device)
        reused = batch.reused(torch.ones(len(batch.ids), dtype=torch.bool), model.shifted_logits)
        for view, (seen, attention) in (("reuse", reused), ("context", (batch, batch.valid))):
            exact, row_nll = one_shot_answers(model, seen.ids, seen.answer, seen.positions, attention, mask_id,
                                              bf16)
            right[view] += int(exact.sum())
            nll[view] += float(row_nll.sum())
    model.train(was_training)
    return {view: {"exact": right[view] / len(rows), "answer_nll": nll[view] / len(rows)} for view in right}


def save_run(run: LoraRun, config: LoraConfig) -> dict:
    """Writes the adapter, the log and, with ``config.merge``, the merged checkpoint (merging ``run.adapted``
    in place); returns the log with where each went."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    # the embeddings are never adapted: False also keeps peft from reading the base config as a transformers one
    run.adapted.save_pretrained(str(out / ADAPTER_DIR), save_embedding_layers=False)
    summary = {**run.summary, "adapter": str(out / ADAPTER_DIR), "merged": None}
    shutil.rmtree(out / MERGED_DIR, ignore_errors=True)  # an earlier run's merged model is not this run's
    if config.merge:
        merged = run.adapted.merge_and_unload()
        summary["merged"] = str(write_merged(merged, run.source, out / MERGED_DIR, run.record))
    (out / LOG_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_merged(model: DiffusionLM, source: Path, out: Path, record: dict) -> Path:
    """Writes a merged model as a checkpoint the engine (and the upstream code) loads like ``source``: its
    weights under upstream names, the source's config keys the engine does not write (``auto_map`` and the
    like) kept, the source's tokenizer and other non-weight files copied, and the affix-training record."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    save_checkpoint(model, out, shards=max(1, math.ceil(size / SHARD_BYTES)),
                    dtype=str(model.dtype).removeprefix("torch."))
    derive_from(source, out)
    if record.get("affix_isolation", 0) > 0:  # no isolated row trained: not a model to serve by direct reuse
        write_affix_training(out, record)
    return out
