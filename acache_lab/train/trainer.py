"""Trains a small diffusion LM (LLaDA, or a block-diffusion family) on the task suite with masked diffusion.

Per sequence ``t ~ U(0, 1]``; each answer token is masked with probability ``t`` (at least one), and the loss
is the cross-entropy on masked answer tokens weighted by ``1 / t`` (LLaDA's SFT objective; the prompt, affix
included, stays visible unless ``context_mask_rate`` masks some of it too, with the same weighting).
``answer_masking="all"`` (per config or per stage) fixes ``t = 1``, and ``eos_weight`` scales the loss on the
answer's EOS padding. Each task's answer region has its own length (``acache_lab.tasks.render.ANSWER_LENGTHS``),
recorded in ``training_log.json``. Sequences are drawn fresh every step: a task, a layout, and a context whose
length grows over the curriculum. The result is written in the upstream LLaDA layout, so the public loader
reads it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import anchor_count
from acache.models.base import DiffusionLM
from acache.models.checkpoint import SPECIAL_TOKENS, family_model, init_weights_, save_checkpoint, tokenizer_config
from acache.models.config import AFFIX_TRAINING_KEY
from acache.models.loader import CONFIG_FILE
from acache.models.registry import family_class
from acache.models.ssm import SCAN_INITS
from acache.policies import ANCHOR_PASSES, LAYOUTS
from acache_lab.tasks.generators import BRIDGED_TASKS, TASKS, TRAIN_GENERATORS, TRAIN_SEED_BASE, held_out
from acache_lab.tasks.render import ANSWER_LENGTHS, TASK_CHAT_TEMPLATE, TWO_AFFIXES, build_word_tokenizer, render
from acache_lab.train.average import average_models
from acache_lab.train.bridge import Bridge, bridge_head, bridge_loss
from acache_lab.train.isolation import (
    LayeredMask,
    isolation_mask,
    span_owners,
    with_anchors,
    with_fresh_columns,
    with_one_pass_anchors,
)
from acache_lab.train.json_fields import check_fields
from acache_lab.train.neighbours import (
    NeighbourHeads,
    is_weight,
    is_whole,
    neighbour_loss,
    neighbour_record,
)
from acache_lab.train.stopping import stop_requests

#: the loss settings a config may choose (TrainConfig and masked_diffusion_loss check against these)
WEIGHTINGS = ("inverse_t", "masked_count")
REDUCTIONS = ("mean", "sum")
MASKINGS = ("rate_t", "all", "count")
ROOM_LOSSES = ("columns", "region")
TWO_AFFIX_FALLBACKS = ("first", "draw")
PROBE_SEED = 1  # the in-training probe's held-out set; `acache eval tasks` reports on seed 0


@dataclass
class ModelShape:
    layers: int = 4
    hidden_size: int = 256
    heads: int = 8
    intermediate_size: int = 768
    max_seq_len: int = 256
    rope_theta: float | None = None  # None: the family's upstream default
    block_size: int | None = None  # block-causal families: the attention block (None: the family's default)
    state_size: int | None = None  # the state-cache families: each scan's state N (None: the family's default)
    conv_kernel: int | None = None  # the state-space variant: taps of its short convolution (None: its default)
    n_groups: int | None = None  # the state-space variant: groups of heads with their own B and C (None: one)

    def scan_options(self) -> dict[str, int]:
        """The state-cache families' options this shape sets, as ``family_model`` takes them."""
        return {k: v for k, v in (("state_size", self.state_size), ("conv_kernel", self.conv_kernel),
                                  ("n_groups", self.n_groups)) if v is not None}


@dataclass(frozen=True)
class Stage:
    """A curriculum stage: for ``steps`` steps, draw these tasks with contexts of this many sentences,
    optionally with its own ``answer_masking``."""

    steps: int
    tasks: tuple[str, ...]
    min_sentences: int
    max_sentences: int
    answer_masking: str | None = None  # this stage's, instead of the config's


@dataclass
class TrainConfig:
    out: str = "models/acache-tiny"
    seed: int = 0
    #: the model family written (its upstream layout and attention): llada, or fast_dllm_v2 (block diffusion)
    family: str = "llada"
    #: the prompt layouts drawn for training rows; a block-causal model cannot read an affix after the
    #: generation region, so its recipes leave ``suffix`` out. ``two-affix`` (demonstrations and story, each an
    #: affix) applies to tasks with demonstrations; another task's row drawn in it takes a plain layout, as
    #: ``two_affix_fallback`` says
    layouts: tuple[str, ...] = LAYOUTS
    #: the plain layout of a row of a task without demonstrations drawn in ``two-affix``: "first", the first plain
    #: one among ``layouts`` (what every recipe before the twentieth affix run trained), or "draw", one of them at
    #: random, so that listing ``two-affix`` several times does not tilt the other tasks towards the first plain one
    two_affix_fallback: str = "first"
    model: ModelShape = field(default_factory=ModelShape)
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 100
    #: the learning rate's decay: None, a cosine from ``lr`` to a tenth of it over every step after warm-up;
    #: N, constant at ``lr`` after warm-up and the same cosine over the last N steps only (a task that starts
    #: to learn late keeps the full rate until the end of the run)
    decay_steps: int | None = None
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max gradient norm
    tasks: tuple[str, ...] = TASKS
    min_sentences: int = 2
    max_sentences: int = 8
    curriculum_steps: int = 1000  # context length grows from min to max over these steps
    context_mask_rate: float = 0.0
    loss_weighting: str = "inverse_t"  # or "masked_count": see masked_diffusion_loss
    answer_reduction: str = "mean"  # a row's weighted CE over its answer columns: "mean" (LLaDA's) or "sum"
    answer_masking: str = "rate_t"  # answer columns masked at rate t (LLaDA's) or "all" of them (t = 1)
    eos_weight: float = 1.0  # loss weight of the answer's EOS padding columns relative to its words
    #: up to this many EOS columns added after a row's answer region, on ``answer_room_share`` of the rows (each
    #: drawn 1..answer_room, within the model's max_seq_len): a served request's max_tokens is rarely its answer's
    #: length, and a model that only ever saw its task's own region does not learn to end an answer in more room.
    #: 0 adds none (and draws nothing, so a run without it is unchanged)
    answer_room: int = 0
    answer_room_share: float = 0.5
    #: the layouts whose rows may be given room (None: every one). A row's layout is the one it is rendered in: a
    #: task without demonstrations drawn in ``two-affix`` takes its plain layout's rule
    answer_room_layouts: tuple[str, ...] | None = None
    #: what a row given room weighs in the loss: "columns", each of its answer columns as any (with
    #: ``answer_reduction`` "sum" a 2-column region with 30 columns of room weighs sixteen times a row without, and
    #: its easy EOS columns crowd the batch's gradient), or "region", in total what its task's region alone would:
    #: every answer column of the row scaled by region / (region + room), the answer's own ones too
    answer_room_loss: str = "columns"
    init_std: float = 0.02  # weight matrices at init
    embed_init_std: float = 0.02  # token embeddings at init (see docs/model.md, run 3)
    bf16: bool = True
    time_limit_minutes: float = 90.0
    log_every: int = 10
    eval_every: int = 0  # every this many steps, one-shot exact match on held-out questions (0: never)
    eval_examples: int = 96  # per task, layouts in turn, contexts of eval_sentences
    eval_sentences: int = 6
    #: explicit curriculum; when given, the stages' steps sum to ``steps`` and replace tasks,
    #: min/max_sentences and curriculum_steps (which otherwise make one stage whose context grows)
    stages: tuple[Stage, ...] = ()
    #: a checkpoint directory whose weights the run starts from instead of a fresh initialisation (same
    #: model shape); the steps, schedule and data stream start from the beginning. A list of two or more
    #: checkpoints of one model starts from their mean (:func:`~acache_lab.train.average.average_models`)
    init_from: str | tuple[str, ...] | None = None
    #: stop after this many steps while the schedule still spans ``steps``: a run cut short (by its time
    #: limit, say) is reproduced exactly by naming the step it stopped at
    stop_after: int | None = None
    #: every this many steps, the weights so far are also written to ``out/step-N`` (a loadable checkpoint,
    #: with the affix-training record when there is one): for averaging the tail of a run
    #: (``python -m acache_lab.probes.average_checkpoints``) or keeping an earlier point; None writes only the end
    save_every: int | None = None
    #: a task's own context-length range ``[min, max]`` sentences, instead of the stage's: long documents for
    #: qa1 in the same batches as short stories for the demonstration tasks
    task_sentences: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: how a new scan's decays start (a state-cache family's mixers, R2LM's sidecar): ``short`` or ``long``
    #: (Mamba's ranges; ``acache.models.ssm.SCAN_INITS``)
    scan_init: str = "short"
    #: the share of rows trained as direct reuse serves them: each affix attends only within itself, every
    #: other token to everything (affix-aware training, :mod:`acache_lab.train.isolation`); 0 trains none
    affix_isolation: float = 0.0
    #: the share of the isolated rows that also recompute anchors, ``ceil(affix_anchor_ratio * n)`` random tokens of
    #: each affix, as ACache's refresh with its anchors fixed serves them (the two-pass form: the anchors read the
    #: question, the rest of the affix keeps its alone K/V; :func:`acache_lab.train.isolation.with_anchors`)
    affix_anchored: float = 0.0
    affix_anchor_ratio: float = 0.2
    #: which refresh the anchored rows train: ``"two"`` the refresh with its anchors fixed, as above; ``"one"`` the
    #: first refresh that chooses them inside it, every column in context up to the first stale layer
    #: (:func:`acache_lab.train.isolation.with_one_pass_anchors`)
    affix_anchor_pass: str = "two"
    #: weight of a term that pulls each isolated row's states towards the same row's in-context states, layer by
    #: layer, on the columns outside its affixes (:func:`reuse_distillation`): the question's side shown what it
    #: computes in context at every depth, not only the answer it should reach; 0 trains none
    affix_distill: float = 0.0
    #: learning-rate multipliers of single layers, by index (``{"1": 10.0}``): a deepened model's inserted layers
    #: start silent (:mod:`acache_lab.train.expand`) and, trained at the base rate, stay nearly so. AdamW's weight
    #: decay scales with the rate, so a layer's decay is multiplied too
    layer_lr_scale: dict[str, float] = field(default_factory=dict)
    #: weight of a term under which each isolated affix token, at the output of layer ``affix_neighbour_layer``,
    #: predicts the tokens up to ``affix_neighbour_span`` either side of it inside its affix
    #: (:mod:`acache_lab.train.neighbours`): the affix's own states made to hold what a question computed alone
    #: will look up there; 0 trains none
    affix_neighbours: float = 0.0
    affix_neighbour_layer: int = 1
    affix_neighbour_span: int = 4
    #: a checkpoint (same vocabulary and mask token) whose in-context predictions the rows not isolated are held to:
    #: the loss adds ``affix_teacher_weight`` times KL(teacher || model) of the token distributions at those
    #: rows' masked answer columns (:func:`teacher_divergence`), so that what affix training teaches the isolated
    #: rows does not cost what the model computes in context; None trains none
    affix_teacher: str | None = None
    affix_teacher_weight: float = 1.0
    #: weight of a term under which the answer column of an isolated two-affix row names, at the output of layer
    #: ``affix_bridge_layer``, what its question's first hop finds (``Example.bridge``: the holder in ``codes``), so
    #: that the second hop has the layers after it (:mod:`acache_lab.train.bridge`); 0 trains none
    affix_bridge: float = 0.0
    affix_bridge_layer: int = 2

    def init_paths(self) -> tuple[str, ...]:
        """The checkpoints ``init_from`` names (none, one, or those it averages)."""
        if self.init_from is None:
            return ()
        return (self.init_from,) if isinstance(self.init_from, str) else tuple(self.init_from)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"training config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a {type(raw).__name__}, not an object of training options")
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown training options {sorted(unknown)}")
        check_fields(path, cls, raw)
        if "model" in raw:
            if not isinstance(raw["model"], dict):
                raise ValueError(f"{path}: 'model' must be an object of the model's shape, got {raw['model']!r}")
            unknown = set(raw["model"]) - set(ModelShape.__dataclass_fields__)
            if unknown:
                raise ValueError(f"{path}: unknown model options {sorted(unknown)}; known: "
                                 f"{', '.join(ModelShape.__dataclass_fields__)}")
            check_fields(path, ModelShape, raw["model"], "model.")
            raw["model"] = ModelShape(**raw["model"])
        if "tasks" in raw:
            raw["tasks"] = tuple(raw["tasks"])
        if "stages" in raw:
            try:
                for i, st in enumerate(raw["stages"]):
                    check_fields(path, Stage, st, f"stages[{i}].")
                raw["stages"] = tuple(Stage(**{**st, "tasks": tuple(st["tasks"])}) for st in raw["stages"])
            except (TypeError, KeyError, AttributeError) as exc:
                raise ValueError(f"{path}: a stage needs steps, tasks, min_sentences and max_sentences, and "
                                 f"may set answer_masking ({exc})") from None
        return cls(**raw)

    def __post_init__(self) -> None:
        known = ", ".join(TRAIN_GENERATORS)
        for tasks in (self.tasks, *(st.tasks for st in self.stages)):
            bad = [t for t in tasks if t not in TRAIN_GENERATORS]
            if bad or not tasks:
                raise ValueError(f"unknown task {bad[0]!r}; known: {known}" if bad else "a stage has no tasks")
        for st in self.stages:
            if st.steps <= 0 or not 1 <= st.min_sentences <= st.max_sentences:
                raise ValueError(f"bad stage {st}: need steps > 0 and 1 <= min_sentences <= max_sentences")
        if self.stages and sum(st.steps for st in self.stages) != self.steps:
            raise ValueError(f"the stages' steps sum to {sum(st.steps for st in self.stages)}, "
                             f"not to steps={self.steps}")
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError("steps and batch_size must be positive")
        if self.warmup < 0:
            raise ValueError(f"warmup must be 0 or more steps, not {self.warmup}")
        if isinstance(self.init_from, list | tuple):
            self.init_from = tuple(self.init_from)
            if len(self.init_from) < 2 or not all(isinstance(p, str) and p for p in self.init_from):
                raise ValueError("init_from is a checkpoint directory, or a list of two or more to start from their "
                                 f"mean, not {list(self.init_from)!r}")
            seen: dict[Path, str] = {}
            for p in self.init_from:
                if Path(p).resolve() in seen:
                    raise ValueError(f"init_from names {seen[Path(p).resolve()]} more than once (as {p}): a mean takes "
                                     "each checkpoint once")
                seen[Path(p).resolve()] = p
        elif self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(f"init_from is a checkpoint directory, or a list of them, not {self.init_from!r}")
        if self.stop_after is not None and not 0 < self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be between 1 and steps={self.steps}, not {self.stop_after}")
        if self.save_every is not None and (isinstance(self.save_every, bool) or not isinstance(self.save_every, int)
                                            or not 0 < self.save_every <= self.steps):
            raise ValueError(f"save_every must be a whole number of steps between 1 and steps={self.steps}, "
                             f"not {self.save_every!r}")
        if self.decay_steps is not None and not 0 < self.decay_steps <= self.steps - self.warmup:
            raise ValueError(f"decay_steps must be between 1 and steps - warmup = {self.steps - self.warmup}, "
                             f"not {self.decay_steps}")
        if self.grad_clip <= 0 or self.adam_eps <= 0:
            raise ValueError("grad_clip and adam_eps must be positive")
        for name, low, high, closed in (("lr", 0.0, math.inf, False), ("weight_decay", 0.0, math.inf, True),
                                        ("context_mask_rate", 0.0, 1.0, True),
                                        ("time_limit_minutes", 0.0, math.inf, False)):
            value = getattr(self, name)  # a string, NaN, infinity or a negative decay trained on, or failed late
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or not (low <= value if closed else low < value) or value > high:
                raise ValueError(f"{name} must be a finite number in {'[' if closed else '('}{low:g}, {high:g}], not "
                                 f"{value!r}")
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 1:
            raise ValueError(f"log_every is a positive number of steps, not {self.log_every!r}")
        if self.answer_reduction not in REDUCTIONS:
            raise ValueError(f"answer_reduction must be 'mean' or 'sum', not {self.answer_reduction!r}")
        for masking in (self.answer_masking, *(st.answer_masking for st in self.stages if st.answer_masking)):
            if masking not in MASKINGS:
                raise ValueError(f"answer_masking must be one of {', '.join(MASKINGS)}, not {masking!r}")
        if self.eos_weight < 0:
            raise ValueError("eos_weight must be >= 0")
        if isinstance(self.answer_room, bool) or not isinstance(self.answer_room, int) or self.answer_room < 0:
            raise ValueError(f"answer_room is a number of extra answer columns >= 0, not {self.answer_room!r}")
        if isinstance(self.answer_room_share, bool) or not isinstance(self.answer_room_share, int | float) \
                or not 0 < self.answer_room_share <= 1:
            raise ValueError(f"answer_room_share is the share of rows given room, in (0, 1], not "
                             f"{self.answer_room_share!r}")
        if self.answer_room_loss not in ROOM_LOSSES:
            raise ValueError(f"answer_room_loss must be one of {', '.join(ROOM_LOSSES)}, not {self.answer_room_loss!r}")
        if self.answer_room_loss == "region":
            if not self.answer_room:
                raise ValueError("answer_room_loss 'region' scales the rows given room: set answer_room too")
            if self.answer_reduction != "sum":
                raise ValueError("answer_room_loss 'region' scales rows under answer_reduction 'sum'; with 'mean' "
                                 "every row already weighs one row")
            if self.eos_weight != 1.0:
                raise ValueError("answer_room_loss 'region' scales a row by its columns, which holds only while its "
                                 "EOS columns weigh as its words: leave eos_weight at 1")
        if self.loss_weighting not in WEIGHTINGS:
            raise ValueError(f"loss_weighting must be 'inverse_t' or 'masked_count', not {self.loss_weighting!r}")
        if self.scan_init not in SCAN_INITS:
            raise ValueError(f"scan_init must be one of {sorted(SCAN_INITS)}, not {self.scan_init!r}")
        if self.init_std <= 0 or self.embed_init_std <= 0:
            raise ValueError("init_std and embed_init_std must be positive")
        if not 1 <= self.min_sentences <= self.max_sentences:
            raise ValueError("need 1 <= min_sentences <= max_sentences")
        if self.eval_every < 0 or self.eval_examples <= 0 or self.eval_sentences < 1:
            raise ValueError("eval_every must be >= 0, eval_examples and eval_sentences positive")
        self.task_sentences = {task: tuple(span) for task, span in self.task_sentences.items()}
        for task, span in self.task_sentences.items():
            if task not in TRAIN_GENERATORS:
                raise ValueError(f"task_sentences: unknown task {task!r}; known: {known}")
            if len(span) != 2 or not 1 <= span[0] <= span[1]:
                raise ValueError(f"task_sentences[{task!r}] must be [min, max] with 1 <= min <= max, not {span}")
        if self.model.rope_theta is not None and self.model.rope_theta <= 0:
            raise ValueError("model.rope_theta must be positive")
        cls = family_class(self.family)  # names the known families when it is not one
        if self.model.block_size is not None and (not cls.block_causal or self.model.block_size <= 0):
            raise ValueError(f"model.block_size is a positive attention block of a block-causal family, not of "
                             f"{cls.family}")
        for name, value in self.model.scan_options().items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
            takes = ("blockdiff_ssm", "r2lm") if name == "state_size" else ("blockdiff_ssm",)
            if cls.family not in takes:
                raise ValueError(f"model.{name} is an option of {' and '.join(takes)} only, not of {cls.family}")
        if not 0.0 <= self.affix_isolation <= 1.0:
            raise ValueError(f"affix_isolation is a share of rows in [0, 1], not {self.affix_isolation}")
        if not 0.0 <= self.affix_anchored <= 1.0:
            raise ValueError(f"affix_anchored is a share of the isolated rows in [0, 1], not {self.affix_anchored}")
        if not 0.0 < self.affix_anchor_ratio <= 1.0:
            raise ValueError(f"affix_anchor_ratio must be in (0, 1], not {self.affix_anchor_ratio}")
        if self.affix_anchor_pass not in ANCHOR_PASSES:
            raise ValueError(f"affix_anchor_pass must be one of {', '.join(ANCHOR_PASSES)}, not "
                             f"{self.affix_anchor_pass!r}")
        if self.affix_anchored > 0 and self.affix_isolation == 0:
            raise ValueError("affix_anchored takes its rows among the isolated ones (affix_isolation > 0)")
        if self.affix_isolation > 0 and self.context_mask_rate > 0:
            raise ValueError("affix_isolation trains rows as direct reuse serves them, their affixes clean as the "
                             "cache holds them, so context_mask_rate must be 0")
        if not isinstance(self.layer_lr_scale, dict):
            raise ValueError(f"layer_lr_scale maps layer indices to multipliers, not {self.layer_lr_scale!r}")
        scales: dict[str, float] = {}
        for index, scale in self.layer_lr_scale.items():
            key = str(index)
            if not key.isdigit() or int(key) >= self.model.layers:
                raise ValueError(f"layer_lr_scale: {key!r} is not a layer of a {self.model.layers}-layer model "
                                 f"(0 to {self.model.layers - 1})")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
                raise ValueError(f"layer_lr_scale[{key!r}] must be a positive finite number, not {scale!r}")
            if str(int(key)) in scales:
                raise ValueError(f"layer_lr_scale names layer {int(key)} twice")
            scales[str(int(key))] = float(scale)
        self.layer_lr_scale = scales
        for name, what in (("affix_distill", "pulls the isolated rows towards their in-context states"),
                           ("affix_neighbours", "trains the isolated rows' affix states"),
                           ("affix_bridge", "trains the isolated rows")):
            weight = getattr(self, name)
            if not is_weight(weight):
                raise ValueError(f"{name} is a loss weight >= 0, not {weight!r}")
            if weight > 0 and (self.affix_isolation == 0 or self.affix_anchored > 0):
                raise ValueError(f"{name} {what}: it needs affix_isolation > 0 and no anchored rows (affix_anchored 0)")
        layers = (("affix_neighbour_layer", self.affix_neighbours), ("affix_bridge_layer", self.affix_bridge))
        for name, weight in layers:
            layer = getattr(self, name)
            if not is_whole(layer, -math.inf) or (weight > 0 and not 0 <= layer < self.model.layers):
                raise ValueError(f"{name} is the index of one of the model's {self.model.layers} layers, not {layer!r}")
        reach = self.affix_neighbour_span
        if not is_whole(reach, 1):
            raise ValueError(f"affix_neighbour_span is a positive number of tokens, not {reach!r}")
        if not is_weight(self.affix_teacher_weight) or self.affix_teacher_weight == 0:
            raise ValueError(f"affix_teacher_weight is a positive loss weight, not {self.affix_teacher_weight!r}")
        if self.affix_teacher is not None:
            if not isinstance(self.affix_teacher, str) or not self.affix_teacher:
                raise ValueError(f"affix_teacher is a checkpoint directory, not {self.affix_teacher!r}")
            if self.affix_isolation == 1.0:
                raise ValueError("affix_teacher holds the rows attending in context to its predictions: with "
                                 "affix_isolation 1 there are none")
        if self.affix_isolation > 0 and (cls.block_causal or cls.family in ("blockdiff_ssm", "r2lm")):
            raise ValueError(f"affix_isolation trains bidirectional attention families (llada, dream), not "
                             f"{cls.family}")
        terms = [name for name in ("affix_anchored", "affix_distill", "affix_neighbours", "affix_bridge")
                 if getattr(self, name) > 0]
        if cls.shifted_logits and terms:  # those rows are built column for column, without the refreshed column
            raise ValueError(f"{', '.join(terms)} train {cls.family} rows that would miss the column before the "
                             "answer, which a shifted family refreshes under reuse; plain affix_isolation trains it")
        self.layouts = tuple(self.layouts)
        known = (*LAYOUTS, TWO_AFFIXES)
        bad = [x for x in self.layouts if x not in known]
        if bad or not self.layouts:
            raise ValueError(f"layouts must be some of {', '.join(known)}, got {list(self.layouts)}")
        if self.answer_room_layouts is not None:
            if not self.answer_room:
                raise ValueError("answer_room_layouts says which rows get answer room: set answer_room too")
            rooms = self.answer_room_layouts
            if not isinstance(rooms, list | tuple) or not rooms or any(x not in self.layouts for x in rooms):
                raise ValueError(f"answer_room_layouts must list one or more of the layouts trained "
                                 f"({', '.join(dict.fromkeys(self.layouts))}), not {rooms!r}")
            # one spelling a set of layouts: the config's order, each once, and every layout as None
            rooms = tuple(x for x in dict.fromkeys(self.layouts) if x in rooms)
            self.answer_room_layouts = None if set(rooms) == set(self.layouts) else rooms
        if self.affix_teacher is not None and self.answer_room and self.answer_room_share == 1 \
                and self.answer_room_layouts is None:
            raise ValueError("affix_teacher holds the rows without answer room to its predictions: with "
                             "answer_room_share 1 in every layout there are none, so the teacher would teach nothing")
        if self.layouts == (TWO_AFFIXES,):
            raise ValueError(f"layouts needs a plain layout ({', '.join(LAYOUTS)}) beside {TWO_AFFIXES}, for the "
                             "rows of tasks without demonstrations")
        if self.two_affix_fallback not in TWO_AFFIX_FALLBACKS:
            raise ValueError(f"two_affix_fallback must be one of {', '.join(TWO_AFFIX_FALLBACKS)}, not "
                             f"{self.two_affix_fallback!r}")
        if self.two_affix_fallback == "draw" and TWO_AFFIXES not in self.layouts:
            raise ValueError(f"two_affix_fallback 'draw' picks a plain layout for rows drawn in {TWO_AFFIXES}: put "
                             f"{TWO_AFFIXES} among the layouts")
        if self.affix_bridge > 0:
            if TWO_AFFIXES not in self.layouts:
                raise ValueError(f"affix_bridge trains the {TWO_AFFIXES} rows: put {TWO_AFFIXES} among the layouts")
            if not self.trained_tasks & set(BRIDGED_TASKS):
                raise ValueError(f"affix_bridge needs a task whose examples carry a first hop "
                                 f"({', '.join(BRIDGED_TASKS)}) among the tasks")

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step``: linear warm-up, then the cosine to a tenth of ``lr`` that
        ``decay_steps`` places."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        start = self.warmup if self.decay_steps is None else self.steps - self.decay_steps
        frac = max(0.0, (step - start) / max(1, self.steps - start))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def stage_at(self, step: int) -> Stage:
        """The stage that ``step`` trains in (one growing stage when no stages are given)."""
        if not self.stages:
            frac = min(1.0, step / max(1, self.curriculum_steps))
            top = self.min_sentences + round(frac * (self.max_sentences - self.min_sentences))
            return Stage(self.steps, self.tasks, self.min_sentences, top)
        for st in self.stages:
            if step < st.steps:
                return st
            step -= st.steps
        return self.stages[-1]

    @property
    def trained_tasks(self) -> set[str]:
        """Every task some stage draws."""
        return {t for st in (self.stages or (self.stage_at(0),)) for t in st.tasks}

    @property
    def eval_tasks(self) -> tuple[str, ...]:
        """Every task the run trains on, the suite's first, then warm-ups."""
        return tuple(t for t in TRAIN_GENERATORS if t in self.trained_tasks)


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

    def state(self) -> dict:
        """Where the data stream is, for a resumed run to continue it exactly."""
        return {"rng": self.rng.getstate(), "counter": self._counter}

    def restore(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self._counter = state["counter"]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def row(self, example, layout: str, rng: random.Random | None = None, room: int = 0) -> Row:
        """The example's full sequence (answer in place), where its answer starts, its length, and its affix
        spans on that sequence (those after the answer moved past it). A task without demonstrations drawn in
        the two-affix layout takes a plain layout of the config: one ``rng`` draws, or without it the first.
        ``room`` EOS columns follow the task's answer region, as many as the model's max_seq_len leaves, where the
        config's ``answer_room_layouts`` lets the row's layout have them."""
        if layout == TWO_AFFIXES and not example.context:
            plain = [x for x in self.config.layouts if x != TWO_AFFIXES]
            layout = plain[0] if rng is None else rng.choice(plain)
        if self.config.answer_room_layouts is not None and layout not in self.config.answer_room_layouts:
            room = 0
        r = render(example, layout, self.encode, self.eos)
        limit = self.config.model.max_seq_len
        row = with_room(answer_row(r.prompt, r.answer), room, self.eos, limit)
        if len(row.ids) > limit:
            raise ValueError(f"a {example.task} example in the {layout} layout takes {len(row.ids)} tokens, more than "
                             f"the model's max_seq_len of {limit}: lower the config's sentences or raise max_seq_len")
        if layout == TWO_AFFIXES and example.bridge:  # the bridge term reads the two-affix rows only
            row = row._replace(bridge=self.token(example.bridge[0]))
        return row

    def check_lengths(self, draws: int = 8) -> None:
        """Raises the ValueError :meth:`row` would raise on a row past the model's max_seq_len, for every task of
        every stage in every layout of the config at the stage's most sentences (``draws`` stories each, on
        generators of their own: the training stream is not touched)."""
        stages = self.config.stages or (self.config.stage_at(self.config.steps - 1),)  # the last step: the longest
        for stage in stages:
            for task in stage.tasks:
                most = self.config.task_sentences.get(task, (stage.min_sentences, stage.max_sentences))[1]
                for i in range(draws):
                    for example in TRAIN_GENERATORS[task](random.Random(f"check:{task}:{i}"), most):
                        for layout in self.config.layouts:
                            self.row(example, layout)

    def token(self, word: str) -> int:
        """The id of ``word``, which must be one token of the vocabulary."""
        token = self.tok.token_to_id(word)
        if token is None:
            raise ValueError(f"{word!r} is not one word of the task vocabulary")
        return token

    def batch(self, step: int) -> Batch:
        """``ids [B, T]``, ``answer [B, T]`` (True on answer columns), ``positions``, ``valid`` and each row's
        affix spans."""
        rows = []
        stage = self.config.stage_at(step)
        for _ in range(self.config.batch_size):
            task = self.rng.choice(stage.tasks)
            self._counter += 1
            rng = random.Random(f"train:{task}:{self._counter}")
            lo, hi = self.config.task_sentences.get(task, (stage.min_sentences, stage.max_sentences))
            sentences = self.rng.randint(lo, hi)
            example = self.rng.choice(TRAIN_GENERATORS[task](rng, sentences))
            draw = self.rng if self.config.two_affix_fallback == "draw" else None
            layout = self.rng.choice(self.config.layouts)
            room = 0
            if self.config.answer_room and self.rng.random() < self.config.answer_room_share:
                room = self.rng.randint(1, self.config.answer_room)
            rows.append(self.row(example, layout, draw, room))
        return self.collate(rows)

    def collate(self, rows: list[Row]) -> Batch:
        return collate_rows(rows, self.pad)


class Row(NamedTuple):
    ids: list[int]
    answer_at: int
    answer_len: int
    spans: tuple[tuple[int, int], ...]  # the affixes, [start, end) on ids
    bridge: int = -1  # the first hop's token for the bridge term, -1: none
    room: int = 0  # EOS columns after the task's answer region, counted in answer_len (``TrainConfig.answer_room``)


def answer_row(prompt: AffixPrompt, answer: Sequence[int]) -> Row:
    """The full training sequence of a prompt and its answer: the answer in the generation region, the affix
    spans of the prompt moved past it where they follow it (the suffix layout)."""
    ids = list(prompt.token_ids)
    g, n = prompt.gen_at, len(answer)
    spans = tuple((a.start + n * (a.start >= g), a.end + n * (a.start >= g)) for a in prompt.affixes)
    return Row(ids[:g] + list(answer) + ids[g:], g, n, spans)


def with_room(row: Row, room: int, eos: int, limit: int) -> Row:
    """``row`` with up to ``room`` more EOS columns after its answer region, as many as ``limit`` tokens leave (what
    follows the region, a suffix affix, moves past them): a served request's max_tokens is rarely its answer's
    length, and a model that only saw its own region does not learn to end an answer in more room."""
    extra = max(0, min(room, limit - len(row.ids)))
    end = row.answer_at + row.answer_len
    spans = tuple((a + extra * (a >= end), b + extra * (a >= end)) for a, b in row.spans)
    return row._replace(ids=row.ids[:end] + [eos] * extra + row.ids[end:], answer_len=row.answer_len + extra,
                        spans=spans, room=row.room + extra)


def collate_rows(rows: Sequence[Row], pad: int) -> Batch:
    """Right-padded ``[B, T]`` tensors of rows, positions from 0."""
    width = max(len(r.ids) for r in rows)
    b = len(rows)
    ids = torch.full((b, width), pad, dtype=torch.long)
    answer = torch.zeros((b, width), dtype=torch.bool)
    valid = torch.zeros((b, width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)] = torch.tensor(r.ids)
        valid[i, :len(r.ids)] = True
        answer[i, r.answer_at:r.answer_at + r.answer_len] = True
    positions = torch.arange(width).expand(b, -1).contiguous()
    bridge = torch.tensor([r.bridge for r in rows], dtype=torch.long)
    room = torch.tensor([r.room for r in rows], dtype=torch.long)
    return Batch(ids, answer, positions, valid, tuple(r.spans for r in rows), bridge, room)


class Batch(NamedTuple):
    ids: torch.Tensor
    answer: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    spans: tuple[tuple[tuple[int, int], ...], ...]
    bridge: torch.Tensor | None = None  # [B]: each row's first-hop token for the bridge term, -1 where none
    room: torch.Tensor | None = None  # [B]: each row's room columns after its answer region (``Row.room``)

    def to(self, device: torch.device | str) -> Batch:
        """The batch's tensors on ``device`` (the spans are plain indices)."""
        bridge, room = (None if x is None else x.to(device) for x in (self.bridge, self.room))
        return Batch(*(x.to(device) for x in (self.ids, self.answer, self.positions, self.valid)), self.spans, bridge,
                     room)

    def isolated_spans(self, isolated: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
        """Each row's affix spans where ``isolated [B]`` says so, none on the other rows."""
        return [s if keep else () for s, keep in zip(self.spans, isolated.tolist(), strict=True)]

    def outside_affixes(self, isolated: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: the valid columns of the ``isolated`` rows outside their affixes, where direct reuse and the
        in-context forward differ (what ``affix_distill`` compares)."""
        return self.valid & (span_owners(self.valid, self.isolated_spans(isolated)) == 0) & isolated[:, None]

    def with_anchors(self, isolated: torch.Tensor, anchored: torch.Tensor, ratio: float, gen: torch.Generator,
                     anchor_pass: str = "two") -> tuple[Batch, torch.Tensor | LayeredMask]:
        """The batch with the ``anchored [B]`` rows' anchors (``ceil(ratio * n)`` random tokens of each affix)
        copied after its columns, and the mask under which those rows compute ACache's refresh with the anchors
        fixed, the other ``isolated [B]`` rows direct reuse and the rest full attention
        (:func:`acache_lab.train.isolation.with_anchors`); with ``anchor_pass="one"`` the anchored rows compute
        the first refresh that chooses them inside it (:func:`~acache_lab.train.isolation.with_one_pass_anchors`:
        every affix token copied, the mask changing at a layer)."""
        spans = self.isolated_spans(isolated)
        anchors = [random_anchors(row, ratio, gen) if take else []
                   for row, take in zip(spans, anchored.tolist(), strict=True)]
        build = {"one": with_one_pass_anchors, "two": with_anchors}[anchor_pass]
        ids, positions, valid, mask = build(self.ids, self.positions, self.valid, spans, anchors)
        answer = F.pad(self.answer, (0, ids.shape[1] - self.ids.shape[1]))
        return Batch(ids, answer, positions, valid, self.spans, self.bridge, self.room), mask

    def reused(self, isolated: torch.Tensor, shifted: bool) -> tuple[Batch, torch.Tensor]:
        """The batch and the mask under which the ``isolated [B]`` rows compute direct reuse as the engine serves
        it (:meth:`attention`); on a ``shifted`` family the column before a row's answer, where an affix ends there,
        is recomputed in context (:func:`acache_lab.train.isolation.with_fresh_columns`), its copy after the
        columns."""
        attention = self.attention(isolated)
        spans = self.isolated_spans(isolated)
        first = self.answer.int().argmax(1).tolist()
        fresh = [[a - 1] if shifted and any(s <= a - 1 < e for s, e in row) else []
                 for row, a in zip(spans, first, strict=True)]
        if not any(fresh):
            return self, attention
        ids, positions, valid, mask = with_fresh_columns(self.ids, self.positions, self.valid, spans, fresh)
        answer = F.pad(self.answer, (0, ids.shape[1] - self.ids.shape[1]))
        return Batch(ids, answer, positions, valid, self.spans, self.bridge, self.room), mask

    def attention(self, isolated: torch.Tensor | None) -> torch.Tensor:
        """What the forward attends with: ``valid``, or where ``isolated [B]`` says so the affix-isolated mask
        (:mod:`acache_lab.train.isolation`), under which a row's forward is direct reuse of its affixes."""
        if isolated is None or not bool(isolated.any()):
            return self.valid
        return isolation_mask(self.valid, self.isolated_spans(isolated))


def random_anchors(spans: Sequence[tuple[int, int]], ratio: float, gen: torch.Generator) -> list[int]:
    """``anchor_count(ratio, n)`` columns of each ``[start, end)`` span, drawn uniformly from ``gen``."""
    out = []
    for start, end in spans:
        out += [start + int(i) for i in torch.randperm(end - start, generator=gen)[:anchor_count(ratio, end - start)]]
    return out


def training_logits(model: DiffusionLM, ids: torch.Tensor, positions: torch.Tensor,
                    valid: torch.Tensor | LayeredMask) -> torch.Tensor:
    """``[B, T, V]`` predictions of a right-padded batch, for a transformer family or a state-cache family (the
    state-space variant, R2LM), whose rows start at position 0. ``valid`` may be a per-query ``[B, T, T]``
    mask (affix-isolated rows), or a :class:`LayeredMask` that changes at a layer (one-pass anchored rows)."""
    if hasattr(model, "train_logits"):  # a state-cache family
        if isinstance(valid, LayeredMask):
            raise ValueError(f"{model.family} trains no one-pass refresh: a mask that changes at a layer is for the "
                             "attention families")
        return model.train_logits(ids, valid)
    if isinstance(valid, LayeredMask):
        layers = len(model.layers)
        early = model.run_layers(model.embed(ids), positions, valid.early, None, range(min(valid.split, layers)))
        late = model.run_layers(early.hidden, positions, valid.late, None, range(min(valid.split, layers), layers))
        return model.logits(model.norm(late.hidden))
    return model.logits(model(ids, positions, valid).hidden)


def layer_states(model: DiffusionLM, ids: torch.Tensor, positions: torch.Tensor,
                 attention: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's output states ``[B, T, hidden]`` of an attention family's forward (the last one before the
    final norm), under ``attention`` (``valid`` or a per-query mask)."""
    out = model.run_layers(model.embed(ids), positions, attention, None, range(len(model.layers)),
                           capture_inputs=True)
    return out.layer_inputs[1:]


def reuse_distillation(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor],
                       columns: torch.Tensor) -> torch.Tensor:
    """How far the isolated forward's states are from the in-context ones at ``columns [B, T]``: each column's
    squared error relative to the in-context state's squared norm, averaged over the columns and the layers
    (zero with no column). Under isolation only the affixes' own attention changes, so these columns carry
    everything direct reuse gets wrong. Layer 0's keys are context-free, so its term is zero and an ``L``-layer
    mean is ``(L - 1) / L`` of the mean over the layers that can differ."""
    if not bool(columns.any()):
        return student[0].new_zeros((), dtype=torch.float32)
    terms = []
    for s, t in zip(student, teacher, strict=True):
        s, t = s[columns].float(), t[columns].float()
        terms.append(((s - t).square().sum(-1) / t.square().sum(-1).clamp_min(1e-6)).mean())
    return torch.stack(terms).mean()


def teacher_divergence(student: torch.Tensor, teacher: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``KL(teacher || student)`` of the token distributions that the logits ``[B, T, V]`` give, averaged over
    ``columns [B, T]`` (zero with no column): how far the model's predictions have moved from the teacher's where
    both read the same noisy row in context."""
    if not bool(columns.any()):
        return student.new_zeros((), dtype=torch.float32)
    s = F.log_softmax(student[columns].float(), -1)
    t = F.log_softmax(teacher[columns].float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def teacher_record(teacher: str, weight: float) -> dict:
    """The teacher term's entries in a checkpoint's affix-training record (the task-suite trainer's and LoRA's
    alike): which checkpoint taught the rows attending in context, and at what weight."""
    return {"affix_teacher": teacher, "affix_teacher_weight": weight}


def loss_weights(masked: torch.Tensor, answer: torch.Tensor, t: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-token loss weights ``[B, T]``: zero where not masked; ``1/t`` or answer length / masked count."""
    if weighting == "inverse_t":
        return masked.float() / t
    return masked.float() * answer.sum(-1, keepdim=True) / (masked & answer).sum(-1, keepdim=True).clamp_min(1)


def draw_masks(answer: torch.Tensor, valid: torch.Tensor, gen: torch.Generator, masking: str = "rate_t",
               context_mask_rate: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns :func:`masked_diffusion_loss` masks ``[B, T]`` and each row's rate ``t`` ``[B, 1]`` (the share of
    its answer masked, under ``masking="count"``)."""
    b, t_len = answer.shape
    # stratified over the batch: each t is still U(0, 1], but the batch covers the range evenly, which
    # tames the variance of the 1/t weight
    # drawn from the CPU generator whatever the device, so a run's noise does not depend on where it runs
    t = ((torch.arange(b)[:, None] + torch.rand(b, 1, generator=gen)) / b).clamp_min(1e-3).to(answer.device)
    if masking == "all":
        t = torch.ones_like(t)
    u = torch.rand(b, t_len, generator=gen).to(answer.device)
    if masking == "count":  # k of a row's n answer columns, k uniform in 1..n, the columns uniform among them
        n = answer.sum(-1, keepdim=True)
        k = (t * n).ceil().clamp_min(1)  # t is uniform on (0, 1]: k is uniform on 1..n
        rank = torch.where(answer, u, 2.0).argsort(-1).argsort(-1)
        masked = answer & (rank < k)
        t = k / n.clamp_min(1)
    else:
        masked = answer & (u < t)
        first = answer.float().argmax(-1)  # every row masks at least one answer token
        masked[torch.arange(b, device=answer.device), first] |= ~masked.any(-1)
    if context_mask_rate > 0:
        masked |= valid & ~answer & (u < t * context_mask_rate)
    return masked, t


def masked_diffusion_loss(model: DiffusionLM, ids: torch.Tensor, answer: torch.Tensor, positions: torch.Tensor,
                          valid: torch.Tensor, mask_id: int, gen: torch.Generator,
                          context_mask_rate: float = 0.0, weighting: str = "inverse_t",
                          reduction: str = "mean", masking: str = "rate_t", eos_id: int | None = None,
                          eos_weight: float = 1.0, attention: torch.Tensor | LayeredMask | None = None,
                          distill: tuple[float, torch.Tensor] | None = None,
                          neighbours: Neighbours | None = None, teacher: Teacher | None = None,
                          bridge: Bridge | None = None, room: torch.Tensor | None = None) -> torch.Tensor:
    """LLaDA's objective on the answer (and optionally some context): weighted CE on masked tokens.

    ``weighting="inverse_t"`` is LLaDA's ``1/t``. ``"masked_count"`` uses its empirical counterpart,
    answer length / answer tokens masked: what ``1/t`` estimates, but bounded by the answer length.
    With a 6-column answer a row with small ``t`` masks one token and ``1/t`` gives that token a weight
    up to 1000, so one row steers the whole step (docs/model.md, run 7). ``reduction="mean"`` divides
    each row by the answer length, as LLaDA's SFT does; ``"sum"`` keeps a one-token answer's loss on
    the scale of a plain cross-entropy (docs/model.md, run 7). ``masking="all"`` hides the whole answer
    (``t = 1``); ``masking="count"`` masks ``k`` of a row's ``n`` answer columns, ``k`` uniform in ``1..n``
    (the discrete form of the objective): never none, so no column is forced, and with ``"masked_count"``
    (``n / k``) the estimate is unbiased, where ``"rate_t"`` forces the first answer column of a row that drew
    none and so weighs it above the others (up to ``1/t``). ``eos_weight`` scales the loss on the answer's EOS
    padding (``eos_id``). ``attention``
    (default ``valid``) is what the forward attends with: a ``[B, T, T]`` mask trains rows under direct reuse, a
    :class:`~acache_lab.train.isolation.LayeredMask` rows as ACache's one-pass refresh serves them.
    ``distill`` ``(weight, columns [B, T])`` adds ``weight`` times :func:`reuse_distillation` of this forward's
    states at ``columns`` against a no-gradient forward of the same noisy rows attending with ``valid``.
    ``neighbours`` adds its weight times :func:`~acache_lab.train.neighbours.neighbour_loss` of its layer's output
    states (the affix tokens unmasked: ``context_mask_rate`` 0), predicting the clean ``ids``. ``teacher`` adds its
    weight times :func:`teacher_divergence` from a frozen model's in-context predictions on its rows' masked answer
    columns (the same noisy rows, attending with ``valid``). ``bridge`` adds its weight times
    :func:`~acache_lab.train.bridge.bridge_loss` of its layer's output states at each row's first answer column.
    ``room [B]``, each row's EOS columns after its task's region (counted in ``answer``), scales a row's answer
    weights by region / (region + room): in total a row given room weighs what its region alone would (exactly
    under ``masked_count``, in expectation under ``inverse_t``), its answer's own columns scaled with its room's.
    """
    if masking not in MASKINGS or reduction not in REDUCTIONS or weighting not in WEIGHTINGS:
        raise ValueError(f"unknown masking {masking!r}, reduction {reduction!r} or weighting {weighting!r}")
    if eos_weight != 1.0 and eos_id is None:
        raise ValueError("eos_weight needs eos_id")
    if room is not None and (reduction != "sum" or eos_weight != 1.0):
        raise ValueError("room scales a row by its columns: it needs reduction 'sum' and eos_weight 1")
    if neighbours is not None:  # refused before the forward, not after it
        if context_mask_rate > 0:
            raise ValueError("neighbours trains clean affix tokens, as the cache holds them: context_mask_rate must "
                             "be 0")
        if neighbours.owner.shape != ids.shape:
            raise ValueError(f"neighbours' owner {tuple(neighbours.owner.shape)} does not match the batch's ids "
                             f"{tuple(ids.shape)}")
    b = ids.shape[0]
    masked, t = draw_masks(answer, valid, gen, masking, context_mask_rate)
    first = answer.float().argmax(-1)
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    attention = valid if attention is None else attention
    in_context = states = None
    if distill is not None or neighbours is not None or bridge is not None:
        if isinstance(attention, LayeredMask) or hasattr(model, "train_logits"):
            raise ValueError("distill, neighbours and bridge read an attention family's isolated rows layer by layer, "
                             "not a one-pass refresh or a state-cache family")
        states = layer_states(model, noisy, positions, attention)
        logits = model.logits(model.norm(states[-1]))
    if distill is not None:
        rows = distill[1].any(-1)  # the in-context forward runs only the rows the term reads
        with torch.no_grad():
            in_context = layer_states(model, noisy[rows], positions[rows], valid[rows]) if bool(rows.any()) else None
    if states is None:
        logits = training_logits(model, noisy, positions, attention)
    ce = F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none")
    weight = loss_weights(masked, answer, t, weighting)
    if eos_weight != 1.0:
        weight = torch.where(answer & (ids == eos_id), weight * eos_weight, weight)
    width = answer.sum(-1, keepdim=True).clamp_min(1)
    if room is not None:
        weight = torch.where(answer, weight * (width - room.to(ids.device)[:, None]).clamp_min(1) / width, weight)
    if reduction == "mean":  # answer columns over the row's answer length, context over its length
        context = valid & ~answer
        weight = torch.where(answer, weight / width, weight / context.sum(-1, keepdim=True).clamp_min(1))
    loss = (ce * weight).sum() / b
    if in_context is not None:
        loss = loss + distill[0] * reuse_distillation([x[rows] for x in states], in_context, distill[1][rows])
    if teacher is not None and bool(teacher.rows.any()):
        taught = teacher.rows
        with torch.no_grad():
            target = teacher.predict(noisy[taught], positions[taught], valid[taught])
        loss = loss + teacher.weight * teacher_divergence(logits[taught], target, masked[taught] & answer[taught])
    if neighbours is not None:
        loss = loss + neighbours.weight * neighbour_loss(model, neighbours.heads, states[neighbours.layer], ids,
                                                         neighbours.owner, neighbours.pairs, neighbours.sampler)
    if bridge is not None:
        loss = loss + bridge.weight * bridge_loss(model, bridge.head, states[bridge.layer], bridge.targets, first,
                                                  masked)
    return loss


class Neighbours(NamedTuple):
    """What :func:`masked_diffusion_loss` needs for the neighbour term: its ``weight``, the training-only
    ``heads``, which ``layer``'s output states predict, and ``owner [B, T]``, the isolated rows' affix spans
    (:func:`~acache_lab.train.isolation.span_owners`; 0 elsewhere). ``pairs`` bounds the pairs an offset predicts,
    drawn from ``sampler`` (None: all of them), a generator of its own so that the masking noise is the same with
    the term as without it."""

    weight: float
    heads: NeighbourHeads
    layer: int
    owner: torch.Tensor
    pairs: int | None = None
    sampler: torch.Generator | None = None


class Teacher(NamedTuple):
    """What :func:`masked_diffusion_loss` needs for the teacher term: its ``weight``, ``predict`` (the frozen
    teacher's logits ``[B, T, V]`` of ``(ids, positions, valid)``, called without gradient) and the ``rows [B]`` it
    reads (those attending in context)."""

    weight: float
    predict: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    rows: torch.Tensor


def frozen_predictions(model: DiffusionLM) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A :class:`Teacher`'s ``predict`` for a separate frozen model (a LoRA run's teacher is its own base model with
    the adapters switched off instead)."""
    return lambda ids, positions, valid: training_logits(model, ids, positions, valid)


def load_teacher(path: str | Path, model: DiffusionLM) -> DiffusionLM:
    """The frozen checkpoint at ``path`` in eval mode on ``model``'s device, or an error naming what does not match:
    the teacher term compares distributions over the same vocabulary, so the two must share it."""
    from acache.models.loader import load_model

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"affix_teacher: no checkpoint at {path} (no config.json)")
    teacher = load_model(path)
    if teacher.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"affix_teacher {path}: its vocabulary has {teacher.config.vocab_size} tokens, the model's "
                         f"{model.config.vocab_size}")
    if teacher.config.mask_token_id != model.config.mask_token_id:
        raise ValueError(f"affix_teacher {path}: its mask token is {teacher.config.mask_token_id}, the model's "
                         f"{model.config.mask_token_id}: another tokenizer")
    teacher.requires_grad_(False)
    return teacher.to(next(model.parameters()).device).eval()


class Probe:
    """Held-out exact match during training, cheaply: every answer column masked, one forward, argmax.

    One-shot decoding is a little harsher than `acache eval tasks` (which commits tokens over several
    steps), so it tracks progress without the cost of a full evaluation.
    """

    def __init__(self, config: TrainConfig, batcher: Batcher) -> None:
        self.batcher = batcher
        self.reuse = config.affix_isolation > 0
        self.batches = {}
        self.anchored = {}  # with random anchors refreshed, drawn once: what ACache's refresh answers
        for task in config.eval_tasks:
            exs = held_out(task, config.eval_examples, config.eval_sentences, seed=PROBE_SEED)
            rows = [batcher.row(e, config.layouts[i % len(config.layouts)]) for i, e in enumerate(exs)]
            self.batches[task] = batch = batcher.collate(rows)
            if config.affix_anchored > 0:
                every = torch.ones(len(rows), dtype=torch.bool)
                gen = torch.Generator().manual_seed(PROBE_SEED)
                self.anchored[task] = batch.with_anchors(every, every, config.affix_anchor_ratio, gen,
                                                         config.affix_anchor_pass)

    @torch.no_grad()
    def __call__(self, model: DiffusionLM, bf16: bool) -> dict[str, float]:
        was_training = model.training
        model.eval()
        out = {}
        for task, batch in self.batches.items():
            views = {task: (batch, batch.valid)}
            if self.reuse:  # the same questions with every affix computed alone: what direct reuse answers
                every = torch.ones(len(batch.ids), dtype=torch.bool)
                views[f"{task}@reuse"] = batch.reused(every, model.shifted_logits)
            if task in self.anchored:
                views[f"{task}@anchors"] = self.anchored[task]
            for name, (view, attention) in views.items():
                exact, _ = one_shot_answers(model, view.ids, view.answer, view.positions, attention,
                                            self.batcher.mask, bf16)
                out[name] = exact.float().mean().item()
        model.train(was_training)
        return out


@torch.no_grad()
def one_shot_answers(model: DiffusionLM, ids: torch.Tensor, answer: torch.Tensor, positions: torch.Tensor,
                     attention: torch.Tensor | LayeredMask, mask_id: int,
                     bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every answer column (``answer [B, T]``) masked, one forward: per row, whether the argmax is the whole
    answer (``[B]`` bool) and the mean negative log-likelihood of its answer tokens (``[B]``). Harsher than
    decoding over several steps, and cheap enough to watch a run with."""
    noisy = torch.where(answer, torch.full_like(ids, mask_id), ids)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = training_logits(model, noisy, positions, attention)
    exact = ((logits.argmax(-1) == ids) | ~answer).all(-1)
    rows = answer.nonzero()[:, 0]  # the answer columns only: a real vocabulary makes [B, T, V] in fp32 large
    nll = torch.zeros(len(ids), device=ids.device).index_add_(
        0, rows, F.cross_entropy(logits[answer].float(), ids[answer], reduction="none"))
    return exact, nll / answer.sum(-1).clamp_min(1)


def init_for_training_(model: DiffusionLM, seed: int, std: float, embed_std: float,
                       embed_generator: torch.Generator | None = None, scan_init: str = "short") -> None:
    """Weights at N(0, std) (a state-cache family's decays and steps as :func:`init_weights_` sets them), norms
    at one, token embeddings at N(0, embed_std) (docs/model.md, run 3)."""
    init_weights_(model, seed, std=std, scan_init=scan_init)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.embed.weight.normal_(0.0, embed_std, generator=embed_generator)


def start_from_(model: DiffusionLM, path: str | Path | Sequence[str | Path]) -> None:
    """Copies a checkpoint's weights into ``model`` (or the mean of several checkpoints' weights), or says which part
    of the shape differs."""
    from acache.models.loader import load_model

    paths = [path] if isinstance(path, str | Path) else list(path)
    for p in paths:
        if not (Path(p) / "config.json").is_file():  # checked when training starts: an earlier run writes it
            raise FileNotFoundError(f"init_from: no checkpoint at {p} (no config.json)")
    if len(paths) == 1:
        source = load_model(paths[0])
    else:
        try:
            source = average_models(paths, warn_records=False)  # the run writes its own record
        except ValueError as e:
            raise ValueError(f"init_from: {e}") from None
        path = f"the mean of {', '.join(str(p) for p in paths)}"
    diff = shape_differences(model.config, source.config)
    if diff:
        raise ValueError(f"init_from {path}: the checkpoint's shape differs: " + ", ".join(diff))
    theirs_by_name = dict(source.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in theirs_by_name:
                if theirs_by_name[name].shape != p.shape:
                    raise ValueError(f"init_from {path}: {name} has shape {tuple(theirs_by_name[name].shape)}, "
                                     f"the config implies {tuple(p.shape)}")
                p.copy_(theirs_by_name[name].to(p.dtype))
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):  # from a family without them
                p.zero_()
            elif "sidecar" in name or "mixer" in name:  # a scan the parent lacks: starts silent
                if name.endswith("out_proj.weight"):
                    p.zero_()
            else:
                raise ValueError(f"init_from {path}: the checkpoint has no {name}")


def refuse_own_out(config: TrainConfig) -> None:
    """A mean that names the run's own ``out`` would average the run's earlier result into it, and compound at every
    repeat: refused (a single ``init_from`` may be ``out``, to continue a checkpoint in place)."""
    paths = config.init_paths()
    if len(paths) > 1 and Path(config.out).resolve() in {Path(p).resolve() for p in paths}:
        raise ValueError(f"init_from lists {config.out}, the run's own out: a mean cannot hold what the run writes")


RESUME_FILE = "resume_state.pt"
#: ``save_every``'s folders, ``out/step-N``, each with the step and the run's config in this file
SNAPSHOT_PREFIX = "step-"
SNAPSHOT_FILE = "training_step.json"


def param_groups(model: DiffusionLM, weight_decay: float, layer_lr_scale: dict[str, float]) -> list[dict]:
    """The optimiser's groups: matrices with ``weight_decay``, the rest without, each split by the learning-rate
    multiplier of its layer (``lr_scale``, 1 outside ``layer_lr_scale``'s layers)."""
    scaled = {f"layers.{index}.": scale for index, scale in layer_lr_scale.items()}
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        scale = next((v for prefix, v in scaled.items() if name.startswith(prefix)), 1.0)
        groups.setdefault((param.dim() >= 2, float(scale)), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0, "lr_scale": scale}
            for (decays, scale), params in groups.items()]


def with_defaults(config: dict) -> dict:
    """A logged config as JSON holds it, every option added since it was written (the model shape's too) at its
    default, which trains as the code did before the option existed."""
    defaults = json.loads(json.dumps(asdict(TrainConfig())))
    return {**defaults, **config, "model": {**defaults["model"], **config.get("model", {})}}


def finished_as(logged: dict, config: TrainConfig) -> bool:
    """``logged`` (a finished run's ``training_log.json`` config) is ``config``'s run: all but what
    :func:`_resumable` leaves out, which a finished run's weights do not depend on (raising a chain's time limits
    retrained its finished runs)."""
    return _resumable(logged) == _resumable(asdict(config))


def _resumable(config: dict) -> dict:
    """What a resumed run must share with the run it continues: everything but the time limit (a guard of the
    machine's budget that decides where a run stops) and ``save_every`` (what is written along the way), never
    what a step computes."""
    return {k: v for k, v in with_defaults(json.loads(json.dumps(config))).items()
            if k not in ("time_limit_minutes", "save_every")}


def train(config: TrainConfig, progress: bool = True, resume: bool = False) -> dict:
    """Trains, writing the checkpoint, its log and loss curve to ``config.out`` (and the ``step-N`` folders of
    ``save_every``, those an earlier run left there removed first). Ctrl-C stops at the step under way and saves
    everything so far, plus the optimizer and data state; ``resume=True`` continues such a run from there, as if
    it had never stopped."""
    writable_out(config.out)
    torch.manual_seed(config.seed)
    tokenizer = build_word_tokenizer()
    spec = SPECIAL_TOKENS["llada"]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    shape = config.model
    # max_seq_len bounds a transformer's rows and RoPE; a state-cache family's config keeps its own serving limit
    positions = None if getattr(family_class(config.family), "state_cache", False) else shape.max_seq_len
    model = family_model(config.family, vocab, tokenizer.token_to_id(spec["mask"]), tokenizer.token_to_id(spec["eos"]),
                         layers=shape.layers, hidden_size=shape.hidden_size, heads=shape.heads,
                         intermediate_size=shape.intermediate_size, max_seq_len=positions,
                         rope_theta=shape.rope_theta, block_size=shape.block_size, **shape.scan_options())
    init_for_training_(model, config.seed, config.init_std, config.embed_init_std,
                       torch.Generator().manual_seed(config.seed), config.scan_init)
    refuse_own_out(config)
    if config.init_from and not resume:  # a resumed run loads its own weights below
        start_from_(model, config.init_from)
    model.train()
    teacher = load_teacher(config.affix_teacher, model) if config.affix_teacher else None
    groups = param_groups(model, config.weight_decay, config.layer_lr_scale)
    heads = None
    if config.affix_neighbours > 0:  # training-only maps, in the optimiser and the resume state, never the checkpoint
        heads = NeighbourHeads(shape.hidden_size, config.affix_neighbour_span).to(next(model.parameters()).device)
        groups.append({"params": list(heads.parameters()), "weight_decay": 0.0, "lr_scale": 1.0})  # discarded after
    hop = None
    if config.affix_bridge > 0:  # the bridge term's map: training-only too
        hop = bridge_head(shape.hidden_size).to(next(model.parameters()).device)
        groups.append({"params": list(hop.parameters()), "weight_decay": 0.0, "lr_scale": 1.0})
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98), eps=config.adam_eps)

    batcher = Batcher(config, tokenizer)
    batcher.check_lengths()  # before any step: a row too long for the model was found only when drawn, hours in
    probe = Probe(config, batcher) if config.eval_every else None
    gen = torch.Generator().manual_seed(config.seed + 1)
    log: list[dict] = []
    probes: list[dict] = []
    window: list[float] = []
    steps_done, spent = 0, 0.0
    if resume:
        state_file = Path(config.out) / RESUME_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"nothing to resume in {config.out}: no {RESUME_FILE} (only a run stopped "
                                    "by Ctrl-C or its time limit leaves one)")
        try:
            state = torch.load(state_file, weights_only=False)
        except Exception as exc:  # cut short by a kill: the run cannot be resumed, and says so
            raise ValueError(f"{state_file} cannot be read ({type(exc).__name__}: {exc}); start the run again "
                             "with --restart") from None
        if _resumable(state["config"]) != _resumable(asdict(config)):
            raise ValueError(f"{state_file} was written by another config; resume with the one that started it "
                             "(only time_limit_minutes and save_every may change)")
        start_from_(model, config.out)
        if heads is not None:
            heads.load_state_dict(state["neighbour_heads"])
        if hop is not None:
            hop.load_state_dict(state["bridge_head"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        batcher.restore(state["batcher"])
        steps_done, spent, log, probes, window = (state["steps_done"], state["train_time_s"], state["log"],
                                                  state["probes"], state["window"])
    tok_config = {**tokenizer_config("llada", tokenizer), "chat_template": TASK_CHAT_TEMPLATE}

    def write(where: Path, steps: int) -> None:
        save_checkpoint(model, where, tokenizer, tok_config)
        if config.affix_isolation > 0:
            record_affix_training(where, config, steps)

    def snapshot(steps: int) -> None:  # whole or absent: a step folder appears only once its files are written
        final = Path(config.out) / f"{SNAPSHOT_PREFIX}{steps}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write(partial, steps)
        (partial / SNAPSHOT_FILE).write_text(json.dumps({"step": steps, "config": asdict(config)}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)

    _clear_snapshots(config, keep_whole=resume)

    started = time.perf_counter() - spent
    bar = tqdm(range(steps_done, config.steps), desc="train", unit="step", disable=not progress,
               initial=steps_done, total=config.steps)
    with stop_requests(bar.write, "Ctrl-C: stopping after this step and saving a resumable run (Ctrl-C again quits "
                       "at once)", "saving the run: wait a moment (a kill now leaves it unresumable, never resumed "
                       "wrong)") as stop:
        steps_done = _train_steps(config, model, opt, batcher, probe, gen, config.lr_at, bar, log, probes, window,
                                  started, steps_done, stop, heads, teacher, hop, snapshot)
        stop["saving"] = True  # the save below is whole or not resumable: Ctrl-C no longer cuts it
        target = config.stop_after or config.steps
        interrupted = steps_done < target  # Ctrl-C, or the time limit: resumable either way
        if stop["asked"] and interrupted:
            reason = stop["asked"]
        elif interrupted:
            reason = f"the time limit of {config.time_limit_minutes} min"
            bar.write(f"stopped by {reason} after {steps_done} of {target} steps: the run is saved resumable")
        else:
            reason = None
            if window:  # a run ending at stop_after logs its last, shorter window
                log.append({"step": steps_done, "loss": sum(window) / len(window), "lr": config.lr_at(steps_done - 1),
                            "elapsed_s": time.perf_counter() - started})
                window.clear()
        bar.close()
        model.eval()
        out = Path(config.out)
        (out / RESUME_FILE).unlink(missing_ok=True)  # before the weights: an older state never meets newer weights
        write(out, steps_done)
        summary = {"config": asdict(config), "steps_done": steps_done, "train_time_s": time.perf_counter() - started,
                   "parameters": sum(p.numel() for p in model.parameters()), "answer_lengths": dict(ANSWER_LENGTHS),
                   "log": log, "probes": probes, "interrupted": interrupted, "stopped_by": reason}
        curve = out / "loss_curve.png"
        summary["loss_curve"] = str(curve) if plot_loss(log, curve, probes) else None  # None: no matplotlib
        (out / "training_log.json").write_text(json.dumps(summary, indent=2) + "\n")
        if interrupted:  # last, and whole or absent: its presence says everything before it was written
            partial = out / f".{RESUME_FILE}.partial"
            torch.save({"config": asdict(config), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                        "batcher": batcher.state(),
                        "steps_done": steps_done, "train_time_s": summary["train_time_s"], "log": log,
                        "probes": probes, "window": window,
                        **({"neighbour_heads": heads.state_dict()} if heads is not None else {}),
                        **({"bridge_head": hop.state_dict()} if hop is not None else {})}, partial)
            os.replace(partial, out / RESUME_FILE)
    return summary


def shape_differences(mine: Any, theirs: Any) -> list[str]:
    """What ``init_from``'s checkpoint (``theirs``) computes otherwise than the config's model (``mine``): its sizes,
    and, where both have attention, its heads, which change no tensor's shape (a 2-head checkpoint copied into a
    4-head model trained from a loss of 60.9 where its parent ended at 6.8). A RoPE base that differs is a choice
    (the block-diffusion recipe moves its LLaDA parent to Qwen's base): the run logs it, and goes on."""
    fields = ["num_layers", "hidden_size", "intermediate_size", "vocab_size"]
    if hasattr(mine, "num_kv_heads") and hasattr(theirs, "num_kv_heads"):
        fields += ["num_heads", "num_kv_heads"]
        if mine.rope_theta != theirs.rope_theta:
            logging.getLogger("acache.train").warning(
                "init_from: the checkpoint's rope_theta is %g, the config's %g: its attention starts from positions "
                "it was not trained at", theirs.rope_theta, mine.rope_theta)
    return [f"{f} {getattr(theirs, f)} (config: {getattr(mine, f)})" for f in fields
            if getattr(mine, f) != getattr(theirs, f)]


def writable_out(out: str | Path) -> None:
    """Says why the run's output folder cannot be written, before any weight loads or step trains (a run that
    finds out at its end loses what it trained); creates nothing."""
    root = Path(out)
    there = root
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise ValueError(f"cannot write the run's output to {root}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write the run's output to {root}: {there} is not writable")


def _clear_snapshots(config: TrainConfig, keep_whole: bool) -> None:
    """Removes the ``step-N`` folders in ``config.out`` that are not this run's: on a fresh start every one (an
    earlier run left them, and averaging them with this run's would mix two runs), on a resume only the
    ``.partial`` ones a second Ctrl-C cut short. A folder the run reads (``init_from``, the teacher) is refused
    rather than removed; links are left alone."""
    pattern = re.compile(rf"{SNAPSHOT_PREFIX}\d+(\.partial)?")
    read = {Path(p).resolve() for p in (*config.init_paths(), config.affix_teacher) if p}
    for old in sorted(Path(config.out).glob(f"{SNAPSHOT_PREFIX}*")):
        if old.is_symlink() or not old.is_dir() or not pattern.fullmatch(old.name):
            continue
        if keep_whole and not old.name.endswith(".partial"):
            continue
        if any(r.is_relative_to(old.resolve()) for r in read):
            raise ValueError(f"{old} is a step folder an earlier run left in out, which a fresh run clears, and this "
                             "run reads it (init_from or affix_teacher): copy it elsewhere first")
        shutil.rmtree(old)


def record_affix_training(out: Path, config: TrainConfig, steps: int) -> None:
    """Notes in the checkpoint's config.json that its affixes were trained to be reused as computed alone, so
    that the engine's front ends serve them by direct reuse by default (``ModelConfig.affix_training``)."""
    anchored = {"affix_anchored": config.affix_anchored, "affix_anchor_ratio": config.affix_anchor_ratio,
                "affix_anchor_pass": config.affix_anchor_pass} if config.affix_anchored > 0 else {}
    distilled = {"affix_distill": config.affix_distill} if config.affix_distill > 0 else {}
    neighbours = neighbour_record(config.affix_neighbours, config.affix_neighbour_layer, config.affix_neighbour_span) \
        if config.affix_neighbours > 0 else {}
    taught = teacher_record(config.affix_teacher, config.affix_teacher_weight) if config.affix_teacher else {}
    bridged = {"affix_bridge": config.affix_bridge, "affix_bridge_layer": config.affix_bridge_layer} \
        if config.affix_bridge > 0 else {}
    write_affix_training(out, {"affix_isolation": config.affix_isolation, "steps": steps,
                               "init_from": config.init_from if isinstance(config.init_from, str | None)
                               else list(config.init_from), "layouts": list(config.layouts), **anchored,
                               **distilled, **neighbours, **taught, **bridged})


def write_affix_training(out: str | Path, record: dict) -> None:
    """Writes an affix-training ``record`` (at least ``affix_isolation``, ``steps``, ``init_from`` and
    ``layouts``) into the checkpoint's config.json: shared by the task-suite trainer and LoRA fine-tuning."""
    path = Path(out) / CONFIG_FILE
    hf = json.loads(path.read_text())
    hf[AFFIX_TRAINING_KEY] = record
    path.write_text(json.dumps(hf, indent=2) + "\n")


def _train_steps(config: TrainConfig, model, opt, batcher, probe, gen, lr_at, bar, log: list, probes: list,
                 window: list, started: float, steps_done: int, stop: dict,
                 heads: NeighbourHeads | None = None, teacher: DiffusionLM | None = None,
                 hop: torch.nn.Module | None = None, snapshot: Callable[[int], None] | None = None) -> int:
    """The training loop from ``steps_done``; returns the steps done. A step under way when Ctrl-C comes
    (``stop["asked"]``) finishes first, so the saved state is a whole step's. ``heads`` are the neighbour term's
    maps when ``config.affix_neighbours`` trains one; ``teacher`` the frozen model of ``config.affix_teacher``;
    ``hop`` the bridge term's map when ``config.affix_bridge`` trains one; ``snapshot(n)`` writes the weights after
    step ``n`` every ``config.save_every`` steps."""
    for step in bar:
        if stop["asked"] or time.perf_counter() - started > 60 * config.time_limit_minutes \
                or step == config.stop_after:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step) * group.get("lr_scale", 1.0)
        batch = batcher.batch(step)
        ids, answer, positions, valid = batch.ids, batch.answer, batch.positions, batch.valid
        isolated = anchored = None
        if config.affix_isolation > 0:  # these rows train as direct reuse serves them
            isolated = torch.rand(len(ids), generator=gen) < config.affix_isolation
        if config.affix_anchored > 0:  # and of those, these as ACache's refresh with random anchors serves them
            anchored = isolated & (torch.rand(len(ids), generator=gen) < config.affix_anchored)
        if anchored is not None and bool(anchored.any()):
            batch, attention = batch.with_anchors(isolated, anchored, config.affix_anchor_ratio, gen,
                                                  config.affix_anchor_pass)
            ids, answer, positions, valid = batch.ids, batch.answer, batch.positions, batch.valid
        elif isolated is not None:  # a shifted family's column before the answer refreshed, as the engine does
            batch, attention = batch.reused(isolated, model.shifted_logits)
            ids, answer, positions, valid = batch.ids, batch.answer, batch.positions, batch.valid
        else:
            attention = batch.valid
        distill = neighbours = taught = bridge = None
        if hop is not None:  # its rows: the isolated ones with a first hop
            bridge = Bridge(config.affix_bridge, hop, config.affix_bridge_layer,
                            torch.where(isolated, batch.bridge, -1).to(ids.device))
        if teacher is not None:  # the rows attending in context (every row when none is isolated), but those with
            # room: the teacher never learnt to end an answer in more columns than its region, so it cannot teach it
            rows = ~isolated if isolated is not None else torch.ones(len(ids), dtype=torch.bool)
            if batch.room is not None:
                rows = rows & (batch.room == 0)
            taught = Teacher(config.affix_teacher_weight, frozen_predictions(teacher), rows)
        if config.affix_distill > 0:
            distill = (config.affix_distill, batch.outside_affixes(isolated))
        if heads is not None:
            neighbours = Neighbours(config.affix_neighbours, heads, config.affix_neighbour_layer,
                                    span_owners(batch.valid, batch.isolated_spans(isolated)))
        # the math kernel: at these sequence lengths it trains ~25% faster on CPU than the fused one
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16), sdpa_kernel(SDPBackend.MATH):
            loss = masked_diffusion_loss(model, ids, answer, positions, valid, batcher.mask, gen,
                                         config.context_mask_rate, config.loss_weighting,
                                         config.answer_reduction,
                                         config.stage_at(step).answer_masking or config.answer_masking, batcher.eos,
                                         config.eos_weight, attention, distill, neighbours, taught, bridge,
                                         room=batch.room if config.answer_room_loss == "region" else None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)  # the model's; the maps are discarded
        opt.step()
        steps_done = step + 1
        window.append(loss.item())
        if len(window) == config.log_every or step == config.steps - 1:
            mean = sum(window) / len(window)
            log.append({"step": steps_done, "loss": mean, "lr": lr_at(step),
                        "elapsed_s": time.perf_counter() - started})
            bar.set_postfix(loss=f"{mean:.3f}")
            window.clear()
        if snapshot is not None and config.save_every and steps_done % config.save_every == 0:
            snapshot(steps_done)
        if probe is not None and (steps_done % config.eval_every == 0 or steps_done == config.steps):
            accuracy = probe(model, config.bf16)
            probes.append({"step": steps_done, "accuracy": accuracy, "elapsed_s": time.perf_counter() - started})
            bar.write(f"step {steps_done}: held-out one-shot exact match "
                      + ", ".join(f"{t} {100 * a:.0f}%" for t, a in accuracy.items()))
    return steps_done


def plot_loss(log: list[dict], path: Path, probes: list[dict] | None = None) -> bool:
    """The loss curve, and beside it the probe's held-out accuracy per task when there is one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = 2 if probes else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.5), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in log], [r["loss"] for r in log])
    ax.set_xlabel("step")
    ax.set_ylabel("masked-diffusion loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if probes:
        ax = axes[0][1]
        for task in probes[0]["accuracy"]:
            ax.plot([r["step"] for r in probes], [100 * r["accuracy"][task] for r in probes], marker=".", label=task)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out exact match, one-shot (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
