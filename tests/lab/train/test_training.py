"""A short training run from scratch lowers the loss; the shipped checkpoint answers held-out questions."""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from acache.models.config import AFFIX_TRAINING_KEY
from acache.paths import SHIPPED_MODEL
from acache_lab.tasks.generators import TRAIN_GENERATORS
from acache_lab.tasks.render import build_word_tokenizer
from acache_lab.train.isolation import LayeredMask
from acache_lab.train.trainer import (
    Batcher,
    ModelShape,
    Probe,
    Stage,
    Teacher,
    TrainConfig,
    finished_as,
    frozen_predictions,
    layer_states,
    loss_weights,
    masked_diffusion_loss,
    reuse_distillation,
    teacher_divergence,
    train,
    training_logits,
)


def test_short_training_run_lowers_the_loss(tmp_path):
    config = TrainConfig(out=str(tmp_path / "m"), steps=120, batch_size=16, lr=3e-3, warmup=10, log_every=20,
                         model=ModelShape(layers=2, hidden_size=64, heads=4, intermediate_size=128),
                         tasks=("qa1",), min_sentences=2, max_sentences=2, bf16=False, eval_every=60,
                         eval_examples=12, loss_weighting="masked_count")
    summary = train(config, progress=False)
    losses = [r["loss"] for r in summary["log"]]
    assert losses[-1] < 0.6 * losses[0], losses
    written = json.loads((tmp_path / "m" / "training_log.json").read_text())
    assert written["steps_done"] == 120 and (tmp_path / "m" / "loss_curve.png").exists()
    assert written["answer_lengths"]["qa1"] == 2 and written["answer_lengths"]["arith"] == 6
    assert [r["step"] for r in written["probes"]] == [60, 120]
    assert all(0.0 <= r["accuracy"]["qa1"] <= 1.0 for r in written["probes"])
    from acache.models.loader import load_model

    assert load_model(tmp_path / "m").config.num_layers == 2


class _Oracle(torch.nn.Module):
    """Predicts the clean sequence it was built with, except where told to be wrong."""

    def __init__(self, clean: torch.Tensor, answer: torch.Tensor, wrong_rows: list[int], vocab: int) -> None:
        super().__init__()
        self.clean, self.answer, self.wrong_rows, self.vocab = clean, answer, wrong_rows, vocab

    def forward(self, ids, positions, valid):
        assert (ids != self.clean).any()  # the probe hides the answers from the model
        return SimpleNamespace(hidden=self.clean)

    def logits(self, hidden):
        target = hidden.clone()
        for row in self.wrong_rows:  # wrong in the last answer column only: EOS padding counts too
            last = int(self.answer[row].nonzero().max())
            target[row, last] = (target[row, last] + 1) % self.vocab
        return torch.nn.functional.one_hot(target, self.vocab).float()


def test_probe_scores_whole_answers_with_the_answer_hidden():
    tok = build_word_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for task, wrong, expected in (("qa1", [], 1.0), ("arith", [0, 3, 5], 0.5)):
        config = TrainConfig(tasks=(task,), eval_every=1, eval_examples=6)
        probe = Probe(config, Batcher(config, tok))
        ids, answer = probe.batches[task].ids, probe.batches[task].answer
        oracle = _Oracle(ids, answer, wrong, vocab)
        assert probe(oracle, bf16=False) == {task: expected}


def test_affix_isolated_rows_train_and_are_probed_under_direct_reuse(tmp_path):
    """A share of rows attends as direct reuse serves them; the probe scores the held-out questions both ways."""
    from acache_lab.train.isolation import isolation_mask

    config = TrainConfig(out=str(tmp_path / "m"), steps=40, batch_size=8, lr=3e-3, warmup=5, log_every=10,
                         model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("qa1",), min_sentences=2, max_sentences=3, bf16=False, eval_every=20,
                         eval_examples=6, affix_isolation=0.5)
    batch = Batcher(config, build_word_tokenizer()).batch(0)
    assert all(len(spans) == 1 for spans in batch.spans)  # one story a row, wherever its layout put it
    for row, spans in enumerate(batch.spans):
        (start, end), = spans
        assert batch.valid[row, start:end].all() and not batch.answer[row, start:end].any()
    chosen = torch.tensor([True, False] * 4)
    mask = batch.attention(chosen)
    assert torch.equal(mask[0], isolation_mask(batch.valid[:1], batch.spans[:1])[0])
    assert torch.equal(mask[1], batch.valid[1].expand(mask.shape[1], -1))  # a row not chosen attends as usual
    assert batch.attention(torch.zeros(8, dtype=torch.bool)) is batch.valid
    summary = train(config, progress=False)
    assert all(set(p["accuracy"]) == {"qa1", "qa1@reuse"} for p in summary["probes"])
    from acache.models.loader import read_config

    record = read_config(tmp_path / "m")[1].affix_training  # what the front ends read to serve by direct reuse
    assert record == {"affix_isolation": 0.5, "steps": 40, "init_from": None, "layouts": list(config.layouts)}
    losses = [r["loss"] for r in summary["log"]]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


def test_anchored_rows_train_and_are_probed_with_anchors(tmp_path):
    """Among the isolated rows a share also refreshes random anchors (a copy of each after the row's columns,
    ``ceil(ratio * n)`` of its affix); the probe scores the questions three ways, and config.json records it."""
    config = TrainConfig(out=str(tmp_path / "m"), steps=30, batch_size=8, lr=3e-3, warmup=5, log_every=10,
                         model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("qa1",), min_sentences=2, max_sentences=3, bf16=False, eval_every=15,
                         eval_examples=6, affix_isolation=0.5, affix_anchored=0.5, affix_anchor_ratio=0.3)
    batch = Batcher(config, build_word_tokenizer()).batch(0)
    isolated, anchored = torch.tensor([True, True, False, True] * 2), torch.tensor([True, False, False, False] * 2)
    ext, mask = batch.with_anchors(isolated, anchored, 0.3, torch.Generator().manual_seed(0))
    t = batch.ids.shape[1]
    counts = [math.ceil(0.3 * (e - s) - 1e-9) for (s, e), in batch.spans]
    assert ext.ids.shape[1] == t + max(counts[0], counts[4]) and not ext.answer[:, t:].any()
    assert ext.valid[:, t:].sum(-1).tolist() == [counts[0], 0, 0, 0, counts[4], 0, 0, 0]
    (start, end), = batch.spans[0]
    copies = ext.positions[0, t:t + counts[0]]
    assert bool(((copies >= start) & (copies < end)).all()) and torch.equal(ext.ids[0, t:t + counts[0]],
                                                                           batch.ids[0, copies])
    assert torch.equal(mask[3, :t, :t], batch.attention(isolated)[3])  # isolated, no anchors: direct reuse
    assert torch.equal(mask[2, :t, :t], batch.valid[2].expand(t, -1))  # neither: full attention
    summary = train(config, progress=False)
    assert all(set(p["accuracy"]) == {"qa1", "qa1@reuse", "qa1@anchors"} for p in summary["probes"])
    from acache.models.loader import read_config

    record = read_config(tmp_path / "m")[1].affix_training
    assert record["affix_anchored"] == 0.5 and record["affix_anchor_ratio"] == 0.3
    assert record["affix_anchor_pass"] == "two"
    losses = [r["loss"] for r in summary["log"]]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


def test_one_pass_anchored_rows_copy_their_affixes_and_train(tmp_path):
    """``affix_anchor_pass="one"``: an anchored row copies every affix token after its columns (the affix computed
    alone) and attends under a mask that changes after the first stale layer; the other rows keep theirs. A
    4-layer model trains on it, the probe scores the questions that way, and config.json records the pass."""
    config = TrainConfig(out=str(tmp_path / "m"), steps=30, batch_size=8, lr=3e-3, warmup=5, log_every=10,
                         model=ModelShape(layers=4, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("qa1",), min_sentences=2, max_sentences=3, bf16=False, eval_every=15,
                         eval_examples=6, affix_isolation=0.5, affix_anchored=0.5, affix_anchor_ratio=0.3,
                         affix_anchor_pass="one")
    batch = Batcher(config, build_word_tokenizer()).batch(0)
    isolated, anchored = torch.tensor([True, True, False, True] * 2), torch.tensor([True, False, False, False] * 2)
    ext, mask = batch.with_anchors(isolated, anchored, 0.3, torch.Generator().manual_seed(0), "one")
    t = batch.ids.shape[1]
    sizes = [e - s for (s, e), in batch.spans]
    assert isinstance(mask, LayeredMask) and ext.ids.shape[1] == t + max(sizes[0], sizes[4])
    assert ext.valid[:, t:].sum(-1).tolist() == [sizes[0], 0, 0, 0, sizes[4], 0, 0, 0] and not ext.answer[:, t:].any()
    (start, end), = batch.spans[0]
    assert ext.positions[0, t:t + sizes[0]].tolist() == list(range(start, end))
    for row_mask in (mask.early, mask.late):
        assert torch.equal(row_mask[3, :t, :t], batch.attention(isolated)[3])  # isolated, no anchors: direct reuse
        assert torch.equal(row_mask[2, :t, :t], batch.valid[2].expand(t, -1))  # neither: full attention
    assert torch.equal(mask.early[0, :t, :t], batch.valid[0].expand(t, -1))  # anchored: in context first
    own = int(batch.answer[0].nonzero()[0])  # then an own column reads the anchors' originals and the others' copies
    read, copies = mask.late[0, own, start:end], mask.late[0, own, t:t + sizes[0]]
    assert int(read.sum()) == math.ceil(0.3 * sizes[0] - 1e-9) and torch.equal(copies, ~read)
    summary = train(config, progress=False)
    assert all(set(p["accuracy"]) == {"qa1", "qa1@reuse", "qa1@anchors"} for p in summary["probes"])
    from acache.models.loader import read_config

    assert read_config(tmp_path / "m")[1].affix_training["affix_anchor_pass"] == "one"
    losses = [r["loss"] for r in summary["log"]]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


def test_reuse_distillation_is_the_relative_error_at_the_given_columns():
    """Per column and layer ``||s - t||^2 / ||t||^2``, averaged over the columns, then over the layers."""
    student = [torch.tensor([[[1.0, 0.0], [3.0, 4.0]]]), torch.tensor([[[0.0, 2.0], [1.0, 1.0]]])]
    teacher = [torch.tensor([[[1.0, 1.0], [3.0, 4.0]]]), torch.tensor([[[0.0, 1.0], [2.0, 2.0]]])]
    first = torch.tensor([[True, False]])
    assert float(reuse_distillation(student, teacher, first)) == pytest.approx((1 / 2 + 1 / 1) / 2)
    both = torch.ones(1, 2, dtype=torch.bool)
    assert float(reuse_distillation(student, teacher, both)) == pytest.approx(((0.5 + 0) / 2 + (1 + 2 / 8) / 2) / 2)
    assert float(reuse_distillation(student, teacher, torch.zeros(1, 2, dtype=torch.bool))) == 0.0
    assert float(reuse_distillation(teacher, teacher, both)) == 0.0


def _distill_setup(layers: int = 3):
    config = TrainConfig(model=ModelShape(layers=layers, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("qa1",), min_sentences=2, max_sentences=3, batch_size=6, bf16=False,
                         affix_isolation=0.5, affix_distill=1.0)
    tok = build_word_tokenizer()
    batcher = Batcher(config, tok)
    from acache.models.checkpoint import family_model
    from acache_lab.train.trainer import init_for_training_

    model = family_model("llada", tok.get_vocab_size(with_added_tokens=True), batcher.mask, batcher.eos, layers=layers,
                         hidden_size=32, heads=2, intermediate_size=64, max_seq_len=256)
    init_for_training_(model, 0, 0.2, 1.0, torch.Generator().manual_seed(0))
    return config, batcher, model, batcher.batch(0)


def test_distillation_adds_its_term_on_the_isolated_rows_only():
    """With ``distill`` the loss is the masked-diffusion loss plus the weight times the isolated forward's distance
    from the in-context one at the given columns; rows attending in context add nothing, and the columns outside
    the affixes agree after layer 0 (its keys are context-free) but not after the later layers."""
    from acache_lab.train.isolation import span_owners

    _, batcher, model, batch = _distill_setup()
    isolated = torch.tensor([True, False] * 3)
    attention = batch.attention(isolated)
    spans = [row if keep else () for row, keep in zip(batch.spans, isolated.tolist(), strict=True)]
    outside = batch.valid & (span_owners(batch.valid, spans) == 0)
    columns = outside & isolated[:, None]

    def loss(distill):  # every answer column masked: the noisy rows are known
        return masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                     torch.Generator().manual_seed(3), masking="all", attention=attention,
                                     distill=distill)

    noisy = torch.where(batch.answer, torch.full_like(batch.ids, batcher.mask), batch.ids)
    with torch.no_grad():
        plain = loss(None)
        noisy_term = loss((2.5, columns)) - plain
        assert float(loss((2.5, outside & ~isolated[:, None]))) == pytest.approx(float(plain), abs=1e-6)
        want = reuse_distillation(layer_states(model, noisy, batch.positions, attention),
                                  layer_states(model, noisy, batch.positions, batch.valid), columns)
        student = layer_states(model, batch.ids, batch.positions, attention)
        teacher = layer_states(model, batch.ids, batch.positions, batch.valid)
    assert float(want) > 1e-4 and float(noisy_term) == pytest.approx(2.5 * float(want), rel=1e-4)
    assert torch.allclose(student[0][columns], teacher[0][columns], atol=1e-5)
    assert all(float(reuse_distillation([s], [t], columns)) > 1e-4 for s, t in zip(student[1:], teacher[1:],
                                                                                    strict=True))
    assert float(reuse_distillation(student, teacher, outside & ~isolated[:, None])) < 1e-10


def test_distillation_trains_the_isolated_forward_towards_the_in_context_one():
    """The term's gradient reaches the isolated forward (the in-context one is the fixed target): minimising it alone
    on one batch brings the isolated states at the question's columns halfway to the in-context ones or nearer."""
    from acache_lab.train.isolation import span_owners

    _, _, model, batch = _distill_setup()
    every = torch.ones(len(batch.ids), dtype=torch.bool)
    attention = batch.attention(every)
    columns = batch.valid & (span_owners(batch.valid, list(batch.spans)) == 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    terms = []
    for _ in range(40):
        with torch.no_grad():
            teacher = layer_states(model, batch.ids, batch.positions, batch.valid)
        term = reuse_distillation(layer_states(model, batch.ids, batch.positions, attention), teacher, columns)
        opt.zero_grad()
        term.backward()
        opt.step()
        terms.append(term.item())
    assert terms[-1] < 0.5 * terms[0], terms


def test_distillation_differentiates_the_isolated_forward_only():
    """Through ``masked_diffusion_loss`` the term's gradient is that of the isolated states against a fixed
    in-context target: the gradient of the loss with it equals the plain loss's plus the weight times the gradient
    of :func:`reuse_distillation` with the target detached (a target left in the graph, or a detached isolated
    forward, gives another gradient)."""
    from acache_lab.train.isolation import span_owners

    _, batcher, model, batch = _distill_setup()
    isolated = torch.tensor([True, True, False] * 2)
    attention = batch.attention(isolated)
    spans = [row if keep else () for row, keep in zip(batch.spans, isolated.tolist(), strict=True)]
    columns = batch.valid & (span_owners(batch.valid, spans) == 0) & isolated[:, None]
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(distill):
        loss = masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                     torch.Generator().manual_seed(1), masking="all", attention=attention,
                                     distill=distill)
        return torch.autograd.grad(loss, params, allow_unused=True)

    noisy = torch.where(batch.answer, torch.full_like(batch.ids, batcher.mask), batch.ids)
    target = [x.detach() for x in layer_states(model, noisy, batch.positions, batch.valid)]
    term = reuse_distillation(layer_states(model, noisy, batch.positions, attention), target, columns)
    term_grads = torch.autograd.grad(term, params, allow_unused=True)
    got, plain = grads((0.7, columns)), grads(None)
    checked = 0
    for g, p0, t in zip(got, plain, term_grads, strict=True):
        if g is None:
            continue
        want = (p0 if p0 is not None else 0) + 0.7 * (t if t is not None else 0)
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-7)
        checked += 1
    assert checked > 0 and any(t is not None and bool(t.abs().sum() > 0) for t in term_grads)


def test_distilled_rows_train_and_the_checkpoint_records_it(tmp_path):
    config = TrainConfig(out=str(tmp_path / "m"), steps=30, batch_size=8, lr=3e-3, warmup=5, log_every=10,
                         model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("qa1",), min_sentences=2, max_sentences=3, bf16=False, eval_every=15,
                         eval_examples=6, affix_isolation=0.5, affix_distill=2.0)
    summary = train(config, progress=False)
    from acache.models.loader import read_config

    record = read_config(tmp_path / "m")[1].affix_training
    assert record == {"affix_isolation": 0.5, "steps": 30, "init_from": None, "layouts": list(config.layouts),
                      "affix_distill": 2.0}
    losses = [r["loss"] for r in summary["log"]]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


def test_distillation_refuses_a_one_pass_mask():
    _, batcher, model, batch = _distill_setup()
    mask = LayeredMask(batch.valid[:, None, :].expand(-1, batch.ids.shape[1], -1), batch.attention(None)[:, None, :]
                       .expand(-1, batch.ids.shape[1], -1), 1)
    with pytest.raises(ValueError, match="distill, neighbours and bridge read an attention family's isolated rows"):
        masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                              torch.Generator().manual_seed(0), attention=mask, distill=(1.0, batch.valid))


def test_teacher_divergence_is_the_kl_from_the_teacher_at_the_given_columns():
    student = torch.tensor([[[0.0, 0.0], [1.0, -1.0]]])
    teacher = torch.tensor([[[math.log(3.0), 0.0], [1.0, -1.0]]])
    first = torch.tensor([[True, False]])
    # teacher (3/4, 1/4) against student (1/2, 1/2)
    want = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert float(teacher_divergence(student, teacher, first)) == pytest.approx(want)
    assert float(teacher_divergence(student, teacher, torch.ones(1, 2, dtype=torch.bool))) == pytest.approx(want / 2)
    assert float(teacher_divergence(student, teacher, torch.tensor([[False, True]]))) == 0.0
    assert float(teacher_divergence(student, teacher, torch.zeros(1, 2, dtype=torch.bool))) == 0.0
    assert float(teacher_divergence(teacher, student, first)) != pytest.approx(want)  # not symmetric: the order counts


def test_the_teacher_term_reads_its_rows_masked_answers_and_trains_the_student_only():
    """The loss with a teacher is the plain loss plus the weight times the divergence at its rows' masked answer
    columns, the teacher reading the same noisy rows in context; a teacher equal to the model adds nothing, rows it
    does not read add nothing, and the gradient reaches the model, never the teacher."""
    import copy

    _, batcher, model, batch = _distill_setup()
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    isolated = torch.tensor([True, False] * 3)
    attention = batch.attention(isolated)

    def loss(teacher):  # every answer column masked: the noisy rows are known
        return masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                     torch.Generator().manual_seed(3), masking="all", attention=attention,
                                     teacher=teacher)

    noisy = torch.where(batch.answer, torch.full_like(batch.ids, batcher.mask), batch.ids)
    rows = ~isolated
    with torch.no_grad():
        plain = float(loss(None))
        want = teacher_divergence(training_logits(model, noisy, batch.positions, attention)[rows],
                                  training_logits(other, noisy[rows], batch.positions[rows], batch.valid[rows]),
                                  batch.answer[rows])
        assert float(want) > 1e-4
        taught = Teacher(2.5, frozen_predictions(other), rows)
        assert float(loss(taught)) - plain == pytest.approx(2.5 * float(want), rel=1e-4)
        itself = frozen_predictions(copy.deepcopy(model))
        assert float(loss(taught._replace(predict=itself))) == pytest.approx(plain, abs=1e-6)
        assert float(loss(taught._replace(rows=torch.zeros_like(rows)))) == pytest.approx(plain, abs=1e-6)
    loss(taught).backward()
    assert all(p.grad is None for p in other.parameters())
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def test_a_run_with_a_teacher_stays_nearer_it_and_records_it(tmp_path):
    """Started from the teacher itself, a run with the term ends nearer the teacher's in-context predictions on a
    held-out batch than the same run without it, and its checkpoint records the teacher."""
    from acache.models.loader import load_model, read_config

    shape = ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64)
    base = dict(steps=30, batch_size=8, lr=1e-2, warmup=1, log_every=10, bf16=False, tasks=("qa1", "arith"),
                model=shape, min_sentences=2, max_sentences=3)
    train(TrainConfig(out=str(tmp_path / "a"), **{**base, "steps": 20, "lr": 3e-3}), progress=False)
    start = {"init_from": str(tmp_path / "a"), "affix_isolation": 0.5, "seed": 9}
    train(TrainConfig(out=str(tmp_path / "free"), **base, **start), progress=False)
    summary = train(TrainConfig(out=str(tmp_path / "held"), **base, **start, affix_teacher=str(tmp_path / "a"),
                                affix_teacher_weight=5.0), progress=False)
    assert all(r["loss"] == r["loss"] for r in summary["log"])
    assert read_config(tmp_path / "held")[1].affix_training == {
        "affix_isolation": 0.5, "steps": 30, "init_from": str(tmp_path / "a"), "layouts": ["prefix", "infix", "suffix"],
        "affix_teacher": str(tmp_path / "a"), "affix_teacher_weight": 5.0}
    config = TrainConfig(**base, seed=123)
    batch = Batcher(config, build_word_tokenizer()).batch(0)
    noisy = torch.where(batch.answer, torch.full_like(batch.ids, Batcher(config, build_word_tokenizer()).mask),
                        batch.ids)

    def distance(name):
        with torch.no_grad():
            logits = {n: training_logits(load_model(tmp_path / n), noisy, batch.positions, batch.valid)
                      for n in ("a", name)}
        return float(teacher_divergence(logits[name], logits["a"], batch.answer))

    held, free = distance("held"), distance("free")
    assert held < 0.5 * free, (held, free)


def test_the_training_loop_gives_the_teacher_the_rows_in_context(tmp_path, monkeypatch):
    """The teacher reads the rows not isolated, and every row when none is."""
    import acache_lab.train.trainer as trainer

    rows = []
    real = trainer.teacher_divergence

    def spy(student, teacher, columns):
        rows.append(len(student))
        return real(student, teacher, columns)

    monkeypatch.setattr(trainer, "teacher_divergence", spy)
    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = dict(steps=3, batch_size=8, warmup=1, bf16=False, model=shape, tasks=("qa1",), min_sentences=2,
                  max_sentences=2)
    train(TrainConfig(out=str(tmp_path / "t"), **common), progress=False)
    train(TrainConfig(out=str(tmp_path / "all"), affix_teacher=str(tmp_path / "t"), **common), progress=False)
    assert rows == [8, 8, 8]
    rows.clear()
    isolated = []
    real_attention = trainer.Batch.attention

    def attention(self, chosen):
        isolated.append(chosen.clone())
        return real_attention(self, chosen)

    monkeypatch.setattr(trainer.Batch, "attention", attention)
    train(TrainConfig(out=str(tmp_path / "some"), affix_teacher=str(tmp_path / "t"), affix_isolation=0.5, **common),
          progress=False)
    in_context = [int((~chosen).sum()) for chosen in isolated]
    assert rows == [n for n in in_context if n > 0] and 0 < sum(rows) < 24


def test_answer_room_puts_eos_columns_after_a_share_of_answers_within_max_seq_len(tmp_path):
    """``answer_room`` gives a share of rows 1..answer_room EOS columns after the task's answer region, flagged,
    and never past the model's max_seq_len."""
    tok = build_word_tokenizer()
    common = dict(out=str(tmp_path / "m"), batch_size=16, tasks=("qa1",), min_sentences=2, max_sentences=3)
    batcher = Batcher(TrainConfig(**common, answer_room=6, answer_room_share=0.5), tok)
    eos = batcher.eos
    counts = []
    for step in range(4):
        batch = batcher.batch(step)
        widths = batch.answer.sum(1)
        assert torch.equal(batch.room, widths - 2)  # qa1's region is 2 columns: its word and an EOS
        assert bool(((widths >= 2) & (widths <= 8)).all())
        for row in range(16):
            columns = batch.ids[row][batch.answer[row]]
            assert bool((columns[1:] == eos).all()) and columns[0] != eos
        counts.append(int((batch.room > 0).sum()))
    assert 0 < sum(counts) < 64, counts
    tight = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64, max_seq_len=40)
    batch = Batcher(TrainConfig(**common, model=tight, answer_room=30, answer_room_share=1.0), tok).batch(0)
    assert int(batch.valid.sum(1).max()) <= 40 and bool((batch.room > 0).any())
    plain = Batcher(TrainConfig(**common), tok).batch(0)
    assert int(plain.answer.sum()) == 2 * 16 and not bool(plain.room.any())
    for bad in ({"answer_room": -1}, {"answer_room": 1.5}, {"answer_room": True}, {"answer_room_share": 0},
                {"answer_room_share": 1.5}, {"answer_room_share": "half"}):
        with pytest.raises(ValueError, match="answer_room"):
            TrainConfig(**common, **bad)
    with pytest.raises(ValueError, match="answer_room_share 1 in every layout there are none, so the teacher"):
        TrainConfig(**common, affix_teacher=str(tmp_path / "t"), answer_room=4, answer_room_share=1.0)


def test_answer_room_layouts_gives_room_to_the_rows_rendered_in_those_layouts_only(tmp_path):
    """With ``answer_room_layouts`` only rows rendered in the layouts named get room: a two-affix row (two affix
    spans) gets none, while a task without demonstrations drawn in two-affix takes its plain layout's rule."""
    tok = build_word_tokenizer()
    common = dict(out=str(tmp_path / "m"), batch_size=32, tasks=("codes", "qa1"), min_sentences=2, max_sentences=3,
                  layouts=("prefix", "two-affix"), answer_room=6, answer_room_share=1.0)
    batch = Batcher(TrainConfig(**common, answer_room_layouts=["prefix"]), tok).batch(0)
    two = torch.tensor([len(s) == 2 for s in batch.spans])
    assert bool(two.any()) and bool((~two).any())
    assert torch.equal(batch.room > 0, ~two)
    every = Batcher(TrainConfig(**common), tok).batch(0)
    assert bool((every.room > 0).all())
    rng = random.Random(1)
    batcher = Batcher(TrainConfig(**common, answer_room_layouts=["prefix"]), tok)
    for task, room in (("qa1", 6), ("codes", 0)):  # qa1 has no demonstrations: its two-affix draw renders in prefix
        example = TRAIN_GENERATORS[task](rng, 3)[0]
        assert batcher.row(example, "two-affix", room=6).room == room
        assert batcher.row(example, "prefix", room=6).room == 6
    # one spelling of a set: the config's order, each once; every layout is None
    assert TrainConfig(**common, answer_room_layouts=["prefix", "prefix"]).answer_room_layouts == ("prefix",)
    assert TrainConfig(**common, answer_room_layouts=("two-affix", "prefix")).answer_room_layouts is None
    # a teacher with every row of the layouts named given room still has the others
    TrainConfig(**common, answer_room_layouts=["prefix"], affix_teacher=str(tmp_path / "t"))
    for bad in (["suffix"], [], "prefix", ["prefix", "nowhere"]):
        with pytest.raises(ValueError, match="answer_room_layouts must list one or more of the layouts trained"):
            TrainConfig(**common, answer_room_layouts=bad)
    with pytest.raises(ValueError, match="answer_room_layouts says which rows get answer room: set answer_room"):
        TrainConfig(**{**common, "answer_room": 0}, answer_room_layouts=["prefix"])


def test_answer_room_loss_region_weighs_a_row_with_room_as_its_region_alone(tmp_path):
    """Under "region" a row with room has each answer column's weight scaled by region / (region + room), so the
    row weighs what its region alone would; rows without room and the default "columns" are unchanged."""
    from acache.models.checkpoint import family_model
    from acache_lab.train.trainer import init_for_training_

    tok = build_word_tokenizer()
    common = dict(out=str(tmp_path / "m"), batch_size=8, tasks=("qa1",), min_sentences=2, max_sentences=2,
                  answer_room=6, answer_room_share=0.5, answer_reduction="sum", loss_weighting="masked_count")
    batcher = Batcher(TrainConfig(**common, answer_room_loss="region"), tok)
    batch = batcher.batch(0)
    assert bool((batch.room > 0).any()) and bool((batch.room == 0).any())
    model = family_model("llada", tok.get_vocab_size(with_added_tokens=True), batcher.mask, batcher.eos, layers=1,
                         hidden_size=32, heads=2, intermediate_size=64, max_seq_len=256)
    init_for_training_(model, 0, 0.2, 1.0, torch.Generator().manual_seed(0))

    def loss(row, room):
        one = slice(row, row + 1)
        return float(masked_diffusion_loss(model, batch.ids[one], batch.answer[one], batch.positions[one],
                                           batch.valid[one], batcher.mask, torch.Generator().manual_seed(5),
                                           weighting="masked_count", reduction="sum", masking="all",
                                           room=None if room is None else room[one]))

    with torch.no_grad():
        want = []
        for row in range(8):
            width, extra = int(batch.answer[row].sum()), int(batch.room[row])
            want.append(loss(row, None) * (width - extra) / width)
            assert loss(row, batch.room) == pytest.approx(want[-1], rel=1e-5)
        whole = masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                      torch.Generator().manual_seed(5), weighting="masked_count", reduction="sum",
                                      masking="all", room=batch.room)
        assert float(whole) == pytest.approx(sum(want) / 8, rel=1e-4)
        for bad in ({"reduction": "mean"}, {"eos_weight": 0.5, "eos_id": batcher.eos}):
            with pytest.raises(ValueError, match="room scales a row by its columns"):
                masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                      torch.Generator().manual_seed(5), room=batch.room, **bad)
    for bad, why in (({"answer_room_loss": "rows"}, "must be one of columns, region"),
                     ({"answer_room": 0}, "set answer_room too"),
                     ({"answer_reduction": "mean"}, "with 'mean' every row already weighs one row"),
                     ({"eos_weight": 0.5}, "leave eos_weight at 1")):
        with pytest.raises(ValueError, match=why):
            TrainConfig(**{**common, "answer_room_loss": "region", **bad})


def test_the_trainer_passes_the_room_to_the_loss_under_region_only(tmp_path, monkeypatch):
    """``answer_room_loss`` reaches the loss: each batch's room counts under "region", none under "columns"."""
    import acache_lab.train.trainer as trainer

    seen, batches = [], []
    real_loss, real_batch = trainer.masked_diffusion_loss, trainer.Batcher.batch
    monkeypatch.setattr(trainer, "masked_diffusion_loss", lambda *a, **k: seen.append(k["room"]) or real_loss(*a, **k))
    monkeypatch.setattr(trainer.Batcher, "batch", lambda self, step: batches.append(real_batch(self, step))
                        or batches[-1])
    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = dict(steps=2, batch_size=8, warmup=1, bf16=False, model=shape, tasks=("qa1",), min_sentences=2,
                  max_sentences=2, answer_room=6, answer_reduction="sum", loss_weighting="masked_count")
    train(TrainConfig(out=str(tmp_path / "r"), answer_room_loss="region", **common), progress=False)
    assert len(seen) == 2 and all(torch.equal(r, b.room) for r, b in zip(seen, batches, strict=True))
    assert any(bool((r > 0).any()) for r in seen)
    seen.clear()
    train(TrainConfig(out=str(tmp_path / "c"), **common), progress=False)
    assert seen == [None, None]


def test_the_teacher_is_not_given_the_rows_with_room(tmp_path, monkeypatch):
    """The teacher never learnt to end an answer in more room than its region, so rows with room are not its."""
    import acache_lab.train.trainer as trainer

    taught, roomy = [], []
    real, real_batch = trainer.teacher_divergence, trainer.Batcher.batch
    monkeypatch.setattr(trainer, "teacher_divergence", lambda s, t, c: taught.append(len(s)) or real(s, t, c))

    def batch(self, step):
        out = real_batch(self, step)
        roomy.append(int((out.room > 0).sum()))
        return out

    monkeypatch.setattr(trainer.Batcher, "batch", batch)
    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = dict(steps=4, batch_size=8, warmup=1, bf16=False, model=shape, tasks=("qa1",), min_sentences=2,
                  max_sentences=2)
    train(TrainConfig(out=str(tmp_path / "t"), **common), progress=False)
    roomy.clear()
    train(TrainConfig(out=str(tmp_path / "s"), affix_teacher=str(tmp_path / "t"), answer_room=4, **common),
          progress=False)
    assert taught == [8 - n for n in roomy if n < 8] and 0 < sum(roomy) < 32, (taught, roomy)


def test_a_teacher_is_refused_when_it_cannot_teach(tmp_path, llada_dir):
    for weight in (0.0, -1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="affix_teacher_weight is a positive loss weight"):
            TrainConfig(affix_teacher="m", affix_teacher_weight=weight)
    for path in ("", 3):
        with pytest.raises(ValueError, match="affix_teacher is a checkpoint directory"):
            TrainConfig(affix_teacher=path)
    with pytest.raises(ValueError, match="with affix_isolation 1 there are none"):
        TrainConfig(affix_teacher="m", affix_isolation=1.0)
    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    with pytest.raises(FileNotFoundError, match="affix_teacher: no checkpoint at"):
        train(TrainConfig(out=str(tmp_path / "x"), steps=1, model=shape, affix_teacher=str(tmp_path / "missing")),
              progress=False)
    with pytest.raises(ValueError, match="its vocabulary has .* tokens, the model's"):
        train(TrainConfig(out=str(tmp_path / "y"), steps=1, model=shape, affix_teacher=str(llada_dir)),
              progress=False)
    train(TrainConfig(out=str(tmp_path / "t"), steps=1, batch_size=2, warmup=1, bf16=False, model=shape),
          progress=False)
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps({**hf, "mask_token_id": hf["mask_token_id"] - 1}))
    with pytest.raises(ValueError, match="its mask token is .*: another tokenizer"):
        train(TrainConfig(out=str(tmp_path / "z"), steps=1, model=shape, affix_teacher=str(tmp_path / "t")),
              progress=False)


def test_stages_run_in_order_and_every_trained_task_is_probed(tmp_path):
    stages = [{"steps": 3, "tasks": ["bind"], "min_sentences": 2, "max_sentences": 4, "answer_masking": "all"},
              {"steps": 5, "tasks": ["qa1", "arith"], "min_sentences": 6, "max_sentences": 6}]
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 8, "stages": stages}))
    config = TrainConfig.from_file(path)
    assert [config.stage_at(s).tasks for s in (0, 2, 3, 7, 8)] == [("bind",)] * 2 + [("qa1", "arith")] * 3
    assert config.eval_tasks == ("qa1", "arith", "bind")
    assert [config.stage_at(s).answer_masking for s in (2, 3)] == ["all", None]  # None: the config's
    batcher = Batcher(config, build_word_tokenizer())
    sizes = {int(batcher.batch(step)[3].sum(-1).max()) for step in (0, 1, 2)}
    assert max(sizes) < min(int(batcher.batch(step)[3].sum(-1).min()) for step in (3, 4))  # longer contexts
    ramp = TrainConfig(steps=100, min_sentences=2, max_sentences=8, curriculum_steps=50)
    assert [ramp.stage_at(s).max_sentences for s in (0, 25, 50, 99)] == [2, 5, 8, 8]
    assert ramp.stage_at(0) == Stage(100, ramp.tasks, 2, 2)


def test_two_affix_rows_carry_two_spans_and_plain_tasks_fall_back():
    """In the two-affix layout a task with demonstrations trains with two isolated spans (demonstrations and
    story), the same tokens as its prefix row; a task without them takes the config's first plain layout."""
    from acache_lab.tasks.generators import held_out

    config = TrainConfig(steps=4, batch_size=4, tasks=("codes", "qa1"), layouts=("two-affix", "infix"))
    batcher = Batcher(config, build_word_tokenizer())
    codes = held_out("codes", 1, 4, seed=3)[0]
    two, prefix = batcher.row(codes, "two-affix"), batcher.row(codes, "prefix")
    assert len(two.spans) == 2 and len(prefix.spans) == 1
    assert two.ids == prefix.ids and two.spans[0] == prefix.spans[0]
    assert two.spans[1][0] >= two.spans[0][1]
    qa = held_out("qa1", 1, 4, seed=3)[0]
    assert batcher.row(qa, "two-affix") == batcher.row(qa, "infix") != batcher.row(qa, "prefix")
    seen = {len(s) for step in range(4) for s in batcher.batch(step).spans}
    assert seen == {1, 2}
    with pytest.raises(ValueError, match="layouts needs a plain layout"):
        TrainConfig(layouts=("two-affix",))


def test_two_affix_fallback_draws_a_plain_layout_when_asked(monkeypatch):
    """With two-affix listed three times in six, a task without demonstrations trains on the first plain layout
    two thirds of the time under "first"; under "draw" each plain layout about a third, while a task with
    demonstrations still takes two-affix. An unknown fallback is refused by name."""
    from acache_lab.train import trainer

    drawn: list[tuple[bool, str]] = []

    def spy(example, layout, *args):
        drawn.append((bool(example.context), layout))
        return render(example, layout, *args)

    render = trainer.render
    monkeypatch.setattr(trainer, "render", spy)
    layouts = ("prefix", "infix", "suffix", "two-affix", "two-affix", "two-affix")
    counts = {}
    for fallback in ("first", "draw"):
        drawn.clear()
        config = TrainConfig(steps=4, batch_size=40, tasks=("qa1", "qa1", "codes"), layouts=layouts,
                             min_sentences=3, max_sentences=4, two_affix_fallback=fallback)
        batcher = Batcher(config, build_word_tokenizer())
        for step in range(4):
            batcher.batch(step)
        plain = [layout for demos, layout in drawn if not demos]
        counts[fallback] = {x: plain.count(x) for x in layouts[:3]}
        assert "two-affix" not in plain and len(plain) > 80
        assert any(layout == "two-affix" for demos, layout in drawn if demos)
    first, draw = counts["first"], counts["draw"]
    assert first["prefix"] > 2 * max(first["infix"], first["suffix"]), first
    assert all(abs(n - sum(draw.values()) / 3) < sum(draw.values()) / 8 for n in draw.values()), draw
    with pytest.raises(ValueError, match="two_affix_fallback must be one of first, draw, not 'random'"):
        TrainConfig(two_affix_fallback="random")
    with pytest.raises(ValueError, match="two_affix_fallback 'draw' picks a plain layout .* put two-affix among"):
        TrainConfig(layouts=("prefix", "infix"), two_affix_fallback="draw")


def test_loss_weights():
    answer = torch.zeros(3, 12, dtype=torch.bool)
    answer[:2, 2:8] = True  # two 6-column answers (a worked sum)
    answer[2, 3:5] = True  # a 2-column one (a place)
    masked = torch.zeros_like(answer)
    masked[0, 2] = True  # one answer token masked
    masked[1] = answer[1]  # all of them
    masked[2, 3] = True  # one of two
    t = torch.tensor([[0.01], [1.0], [0.5]])
    inv = loss_weights(masked, answer, t, "inverse_t")
    assert inv[0, 2] == pytest.approx(100.0) and inv[1, 2:8].eq(1.0).all() and inv[2, 3] == 2.0
    count = loss_weights(masked, answer, t, "masked_count")
    assert count[0, 2] == 6 and count[1].sum() == 6  # bounded by the row's own answer length
    assert count[2, 3] == 2 and count[2].sum() == 2
    assert inv[~masked].eq(0).all() and count[~masked].eq(0).all()


def _mixed_batch():
    from acache.models.checkpoint import random_config
    from acache.models.llada import LLaDAModel

    config = TrainConfig(tasks=("qa1", "arith"), batch_size=8)
    batcher = Batcher(config, build_word_tokenizer())
    model = LLaDAModel(random_config("llada", 160, batcher.mask, batcher.eos, layers=1, hidden_size=32))
    batch = batcher.batch(0)
    ids, answer, positions, valid = batch.ids, batch.answer, batch.positions, batch.valid
    assert set(answer.sum(-1).tolist()) == {2, 6}  # rows of both lengths in one batch
    return batcher, model, ids, answer, positions, valid


def test_each_row_is_normalised_by_its_own_answer_length():
    from acache_lab.train.trainer import masked_diffusion_loss

    batcher, model, ids, answer, positions, valid = _mixed_batch()
    noisy = torch.where(answer, torch.full_like(ids, batcher.mask), ids)
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model.logits(model(noisy, positions, valid).hidden).transpose(1, 2),
                                               ids, reduction="none")
        per_row_sum = (ce * answer).sum(-1)
        losses = {r: masked_diffusion_loss(model, ids, answer, positions, valid, batcher.mask,
                                           torch.Generator().manual_seed(3), reduction=r, masking="all").item()
                  for r in ("mean", "sum")}
    assert losses["sum"] == pytest.approx(per_row_sum.mean().item(), rel=1e-4)
    assert losses["mean"] == pytest.approx((per_row_sum / answer.sum(-1)).mean().item(), rel=1e-4)
    with pytest.raises(ValueError, match="unknown masking 'some'"):
        masked_diffusion_loss(model, ids, answer, positions, valid, batcher.mask, torch.Generator(), masking="some")
    with pytest.raises(ValueError, match="eos_weight needs eos_id"):
        masked_diffusion_loss(model, ids, answer, positions, valid, batcher.mask, torch.Generator(), eos_weight=0.5)


def test_all_answer_masking_and_eos_weight():
    from acache_lab.train.trainer import masked_diffusion_loss

    batcher, model, ids, answer, positions, valid = _mixed_batch()
    words = answer & (ids != batcher.eos)

    def loss(**kw):
        return masked_diffusion_loss(model, ids, answer, positions, valid, batcher.mask,
                                     torch.Generator().manual_seed(3), reduction="sum", masking="all",
                                     eos_id=batcher.eos, **kw)

    # with every answer column hidden the loss is the plain CE summed over them, whatever the draw of t
    noisy = torch.where(answer, torch.full_like(ids, batcher.mask), ids)
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model.logits(model(noisy, positions, valid).hidden).transpose(1, 2),
                                               ids, reduction="none")
        assert loss().item() == pytest.approx(ce[answer].sum().item() / len(ids), rel=1e-4)
        assert loss(eos_weight=0.0).item() == pytest.approx(ce[words].sum().item() / len(ids), rel=1e-4)
        half = (ce[words].sum() + 0.5 * ce[answer & ~words].sum()).item() / len(ids)
        assert loss(eos_weight=0.5).item() == pytest.approx(half, rel=1e-4)


def test_init_from_starts_at_a_checkpoint(tmp_path):
    from acache.models.loader import load_model

    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    first = TrainConfig(out=str(tmp_path / "a"), steps=3, batch_size=2, warmup=1, bf16=False, tasks=("qa1",),
                        model=shape)
    train(first, progress=False)
    # a learning rate of ~0: the continued run's weights are the checkpoint's, not a fresh init
    resumed = TrainConfig(out=str(tmp_path / "b"), steps=1, batch_size=2, lr=1e-12, warmup=1, bf16=False,
                          tasks=("qa1",), model=shape, seed=5, init_from=str(tmp_path / "a"))
    train(resumed, progress=False)
    a, b = load_model(tmp_path / "a"), load_model(tmp_path / "b")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    wider = TrainConfig(out=str(tmp_path / "c"), steps=1, tasks=("qa1",), init_from=str(tmp_path / "a"),
                        model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match=r"shape differs: num_layers 1 \(config: 2\)"):
        train(wider, progress=False)
    # heads change no tensor's shape: the copy went through and trained another model than the checkpoint's
    more_heads = TrainConfig(out=str(tmp_path / "e"), steps=1, tasks=("qa1",), init_from=str(tmp_path / "a"),
                             model=ModelShape(layers=1, hidden_size=32, heads=4, intermediate_size=64))
    with pytest.raises(ValueError, match=r"shape differs: num_heads 2 \(config: 4\), num_kv_heads 2 \(config: 4\)"):
        train(more_heads, progress=False)
    with pytest.raises(FileNotFoundError, match="init_from: no checkpoint at"):
        train(TrainConfig(out=str(tmp_path / "d"), steps=1, init_from=str(tmp_path / "missing")), progress=False)


def test_init_from_a_list_starts_from_the_mean_the_averaging_probe_writes(tmp_path):
    """``init_from`` naming several checkpoints starts from their mean: the run equals, byte for byte, one started from
    the checkpoint ``average_checkpoints`` writes of them, and the record keeps the list."""
    from acache.models.loader import WEIGHTS_FILE
    from acache_lab.probes.average_checkpoints import average_checkpoints

    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = {"batch_size": 2, "warmup": 1, "bf16": False, "tasks": ("qa1",), "model": shape}
    members = [str(tmp_path / name) for name in ("a", "b", "c")]
    for seed, out in enumerate(members):
        train(TrainConfig(out=out, steps=2 + seed, seed=seed, **common), progress=False)
    average_checkpoints(members, tmp_path / "mean")
    later = {"steps": 3, "seed": 7, "affix_isolation": 0.5, **common}
    train(TrainConfig(out=str(tmp_path / "from_list"), init_from=members, **later), progress=False)
    train(TrainConfig(out=str(tmp_path / "from_mean"), init_from=str(tmp_path / "mean"), **later), progress=False)
    weights = [(tmp_path / d / WEIGHTS_FILE).read_bytes() for d in ("from_list", "from_mean", "a")]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    record = json.loads((tmp_path / "from_list" / "config.json").read_text())[AFFIX_TRAINING_KEY]
    assert record["init_from"] == members
    logged = json.loads((tmp_path / "from_list" / "training_log.json").read_text())["config"]
    assert logged["init_from"] == members and finished_as(logged, TrainConfig(init_from=members, out=str(
        tmp_path / "from_list"), **later))


@pytest.mark.parametrize(("init_from", "error"), [
    (["only"], "a list of two or more"),
    ([], "a list of two or more"),
    (["a", ""], "a list of two or more"),
    (["a", 3], "a list of two or more"),
    (["a", "b", "a"], "names a more than once"),
    (["build/a", "build/a/", "b"], r"names build/a more than once \(as build/a/\)"),
    (["a", str(Path("a").resolve())], "names a more than once"),
    ("", "a checkpoint directory, or a list"),
    (7, "a checkpoint directory, or a list"),
])
def test_init_from_a_bad_list_is_refused_by_name(init_from, error):
    with pytest.raises(ValueError, match=error):
        TrainConfig(init_from=init_from)


def test_init_from_a_list_refuses_a_missing_or_foreign_member_before_training(tmp_path):
    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = {"steps": 1, "batch_size": 2, "warmup": 1, "bf16": False, "tasks": ("qa1",)}
    train(TrainConfig(out=str(tmp_path / "a"), model=shape, **common), progress=False)
    train(TrainConfig(out=str(tmp_path / "wide"), model=ModelShape(layers=1, hidden_size=32, heads=2,
                                                                   intermediate_size=96), **common), progress=False)
    with pytest.raises(FileNotFoundError, match=re.escape(f"init_from: no checkpoint at {tmp_path / 'missing'}")):
        train(TrainConfig(out=str(tmp_path / "x"), model=shape, init_from=[str(tmp_path / "a"),
                                                                           str(tmp_path / "missing")], **common),
              progress=False)
    with pytest.raises(ValueError, match=r"init_from: .*wide is not the model of .*intermediate_size 64 != 96"):
        train(TrainConfig(out=str(tmp_path / "y"), model=shape, init_from=[str(tmp_path / "a"),
                                                                           str(tmp_path / "wide")], **common),
              progress=False)
    before = (tmp_path / "a" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="init_from lists .*/a, the run's own out"):
        train(TrainConfig(out=str(tmp_path / "a"), model=shape, init_from=[str(tmp_path / "a"),
                                                                           str(tmp_path / "wide")], **common),
              progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == before
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_soup_stage_resumes_without_its_members(tmp_path, monkeypatch):
    """A resumed run loads its own weights: the members of its ``init_from`` mean are not read again (they may be
    gone), and it ends as the run never stopped."""
    import shutil
    import signal

    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = {"batch_size": 2, "warmup": 1, "bf16": False, "tasks": ("qa1",), "model": shape}
    members = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, out in enumerate(members):
        train(TrainConfig(out=out, steps=2, seed=seed, **common), progress=False)
    soup = {"steps": 5, "init_from": members, **common}
    train(TrainConfig(out=str(tmp_path / "straight"), **soup), progress=False)
    real = Batcher.batch
    signal_at(monkeypatch, 2, signal.SIGINT)
    assert train(TrainConfig(out=str(tmp_path / "stopped"), **soup), progress=False)["interrupted"]
    monkeypatch.setattr(Batcher, "batch", real)
    shutil.rmtree(tmp_path / "b")
    assert not train(TrainConfig(out=str(tmp_path / "stopped"), **soup), progress=False, resume=True)["interrupted"]
    assert (tmp_path / "stopped" / "model.safetensors").read_bytes() == (
        tmp_path / "straight" / "model.safetensors").read_bytes()


def test_a_layers_learning_rate_scale_applies_to_that_layer_only(tmp_path):
    """``layer_lr_scale``: a layer's parameters step at the base rate times its multiplier, every other parameter
    at the base rate, decayed or not as before."""
    from acache.models.loader import load_model

    shape = ModelShape(layers=3, hidden_size=32, heads=2, intermediate_size=64)
    first = TrainConfig(out=str(tmp_path / "a"), steps=2, batch_size=2, warmup=1, bf16=False, tasks=("qa1",),
                        model=shape)
    train(first, progress=False)
    frozen = TrainConfig(out=str(tmp_path / "b"), steps=4, batch_size=2, lr=1e-2, warmup=1, bf16=False,
                         tasks=("qa1",), model=shape, init_from=str(tmp_path / "a"), layer_lr_scale={"1": 1e-9},
                         weight_decay=0.0)
    train(frozen, progress=False)
    a, b = dict(load_model(tmp_path / "a").named_parameters()), dict(load_model(tmp_path / "b").named_parameters())
    moved = {name: float((a[name] - b[name]).abs().max()) for name in a}
    assert all(v < 1e-6 for name, v in moved.items() if name.startswith("layers.1.")), moved
    assert all(moved[f"layers.{i}.q_proj.weight"] > 1e-3 for i in (0, 2)), moved
    from acache_lab.train.trainer import param_groups

    model = load_model(tmp_path / "a")
    groups = param_groups(model, 0.1, {"1": 4.0})
    assert sorted((g["weight_decay"], g["lr_scale"]) for g in groups) == [(0.0, 1.0), (0.0, 4.0), (0.1, 1.0),
                                                                          (0.1, 4.0)]
    scaled = {id(p) for g in groups if g["lr_scale"] == 4.0 for p in g["params"]}
    assert scaled == {id(p) for name, p in model.named_parameters() if name.startswith("layers.1.")}
    assert all((p.dim() >= 2) == (g["weight_decay"] == 0.1) for g in groups for p in g["params"])


def test_stop_after_cuts_a_run_short_on_the_full_runs_schedule(tmp_path):
    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = dict(steps=8, batch_size=2, warmup=2, bf16=False, tasks=("qa1",), model=shape, log_every=1)
    full = train(TrainConfig(out=str(tmp_path / "full"), **common), progress=False)
    cut = train(TrainConfig(out=str(tmp_path / "cut"), stop_after=5, **common), progress=False)
    assert cut["steps_done"] == 5
    # the same steps, losses and learning rates as the first five of the full run: the schedule spans 8
    assert cut["log"] == [{**r, "elapsed_s": c["elapsed_s"]} for r, c in zip(full["log"][:5], cut["log"], strict=True)]
    assert cut["log"][-1]["lr"] > full["log"][-1]["lr"]


def test_save_every_writes_the_weights_along_the_way_without_changing_the_run(tmp_path):
    from acache.models.loader import load_model

    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    common = dict(steps=6, batch_size=2, warmup=2, bf16=False, tasks=("qa1",), model=shape, affix_isolation=0.5)
    train(TrainConfig(out=str(tmp_path / "plain"), **common), progress=False)
    train(TrainConfig(out=str(tmp_path / "saved"), save_every=3, **common), progress=False)
    train(TrainConfig(out=str(tmp_path / "cut"), stop_after=3, **common), progress=False)
    weights = "model.safetensors"
    # the run itself is untouched: the same final weights, byte for byte
    assert (tmp_path / "saved" / weights).read_bytes() == (tmp_path / "plain" / weights).read_bytes()
    assert sorted(p.name for p in (tmp_path / "saved").glob("step-*")) == ["step-3", "step-6"]
    # step 3's weights are those of the same run cut at step 3, step 6's the end's
    assert (tmp_path / "saved" / "step-3" / weights).read_bytes() == (tmp_path / "cut" / weights).read_bytes()
    assert (tmp_path / "saved" / "step-6" / weights).read_bytes() == (tmp_path / "plain" / weights).read_bytes()
    assert (tmp_path / "saved" / "step-3" / weights).read_bytes() != (tmp_path / "plain" / weights).read_bytes()
    # each is a checkpoint that loads, with the affix-training record of the steps it holds and the run's config
    step3 = load_model(tmp_path / "saved" / "step-3")
    assert step3.config.affix_training["steps"] == 3
    assert (tmp_path / "saved" / "step-3" / "tokenizer.json").is_file()
    record = json.loads((tmp_path / "saved" / "step-3" / "training_step.json").read_text())
    assert record["step"] == 3 and record["config"]["save_every"] == 3 and record["config"]["seed"] == 0
    # a fresh run into the same out removes the step folders the earlier one left (only those)
    (tmp_path / "saved" / "step-6.partial").mkdir()
    (tmp_path / "saved" / "step-notes").mkdir()
    (tmp_path / "saved" / "step-7").symlink_to(tmp_path / "plain", target_is_directory=True)  # links are left alone
    train(TrainConfig(out=str(tmp_path / "saved"), save_every=4, **{**common, "steps": 4}), progress=False)
    assert sorted(p.name for p in (tmp_path / "saved").glob("step-*")) == ["step-4", "step-7", "step-notes"]
    assert (tmp_path / "plain" / weights).is_file()
    # a fresh run that starts from one of them is refused rather than left to remove what it reads
    with pytest.raises(ValueError, match="step-4 is a step folder an earlier run left in out"):
        train(TrainConfig(out=str(tmp_path / "saved"), init_from=str(tmp_path / "saved" / "step-4"), **common),
              progress=False)
    with pytest.raises(ValueError, match="step-4 is a step folder an earlier run left in out"):  # one of a mean's
        train(TrainConfig(out=str(tmp_path / "saved"), init_from=[str(tmp_path / "plain"),
                                                                  str(tmp_path / "saved" / "step-4")], **common),
              progress=False)
    assert (tmp_path / "saved" / "step-4" / weights).is_file()


def test_decay_steps_keep_the_rate_until_the_last_steps():
    cosine = TrainConfig(steps=100, warmup=10, lr=1e-3)
    late = TrainConfig(steps=100, warmup=10, lr=1e-3, decay_steps=20)
    for config in (cosine, late):  # the same linear warm-up
        assert [config.lr_at(s) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])
        assert config.lr_at(100) == pytest.approx(1e-4)  # both end at a tenth
    assert cosine.lr_at(55) == pytest.approx(5.5e-4)  # halfway through the decay
    assert cosine.lr_at(80) < 3e-4
    assert all(late.lr_at(s) == pytest.approx(1e-3) for s in range(10, 81))  # flat until steps - decay_steps
    assert late.lr_at(90) == pytest.approx(5.5e-4)
    rates = [late.lr_at(s) for s in range(80, 101)]
    assert all(a > b for a, b in pairwise(rates))


def test_a_tasks_own_sentence_range_replaces_the_stages():
    """Long documents for qa1 in the same batches as short stories for the demonstration task."""
    config = TrainConfig(steps=50, batch_size=64, tasks=("qa1", "codes"), min_sentences=3, max_sentences=4,
                         curriculum_steps=1, task_sentences={"qa1": (30, 34)})
    batch = Batcher(config, build_word_tokenizer()).batch(0)
    ids, answer, valid = batch.ids, batch.answer, batch.valid
    lengths = valid.sum(-1)
    tok = build_word_tokenizer()
    demos = torch.tensor([(row == tok.token_to_id("worksheet")).any() for row in ids])
    assert 0 < demos.sum() < len(ids)
    assert lengths[~demos].min() >= 30 * 6  # qa1: 30 to 34 sentences of 6 words
    assert lengths[demos].max() <= 34 + 4 * 5 + 12  # codes: the demonstrations and at most 4 pickups
    assert (answer.sum(-1) == 2).all()


def test_committed_configs_are_valid():
    from acache.paths import REPO_ROOT

    configs = sorted((REPO_ROOT / "configs").glob("*.json"))
    assert configs
    for path in configs:
        config = TrainConfig.from_file(path)
        assert config.eval_tasks and config.steps > 0


def test_shipped_recipe_chains_its_configs_into_the_shipped_model():
    from acache.paths import REPO_ROOT

    names = ("run30-stage1", "run30-stage1-cont", "run30-stage2", "run30-cont")
    recipe = [TrainConfig.from_file(REPO_ROOT / "configs" / f"{n}.json") for n in names]
    assert recipe[0].init_from is None
    for before, after in zip(recipe[:-1], recipe[1:], strict=True):
        assert after.init_from == before.out and after.model == before.model
    assert (REPO_ROOT / recipe[-1].out).resolve() == SHIPPED_MODEL.resolve()
    # the shipped checkpoint was trained by the last config: every option but the paths it ran under
    shipped = json.loads((SHIPPED_MODEL / "training_log.json").read_text())
    assert_logged(recipe[-1], shipped["config"], ignore={"out", "init_from"})
    assert shipped["steps_done"] == recipe[-1].steps


def assert_logged(config: TrainConfig, logged: dict, ignore: set[str] = frozenset()) -> None:
    """``config`` is the one a training log records, but for ``ignore``; an option added after the run is not
    in the log, and the config must leave it at its default (the model shape's fields alike)."""
    expected = json.loads(json.dumps(asdict(config)))
    defaults = json.loads(json.dumps(asdict(TrainConfig())))
    for key in set(expected) - ignore:
        if key not in logged:
            assert expected[key] == defaults[key], key
        elif key == "model":
            for field in expected["model"]:
                assert logged["model"].get(field, defaults["model"][field]) == expected["model"][field], field
        else:
            assert logged[key] == expected[key], key
    assert not set(logged) - set(expected), "the log has options the config does not know"


def test_affix_recipe_chains_nine_configs_from_the_plus_model_into_the_affix_model():
    """configs/affix-bind.json from the plus model, then affix-bind-2, affix-mix, affix-bridge-mix and
    affix-bridge-mix-2 each from the one before; three variants of the fifth stage from the fourth, each one option
    changed (seed, more long qa1, no teacher); and affix-anchored from the mean of the fifth stage and its variants
    into the shipped affix model, whose log and config.json record the last (make model-affix runs them in turn). The
    first five stages and the variants train the neighbour term, the fourth and fifth and the variants the bridge term
    (their other tasks drawn in any plain layout), the fifth, two variants and the last the teacher term with the
    plus model, and the last alone anchored rows (half the isolated ones, a fifth of each affix recomputed in the
    one-pass form). The logs of every stage but the last are kept in docs/study."""
    from acache.models.loader import read_config
    from acache.paths import REPO_ROOT

    stages = ("affix-bind", "affix-bind-2", "affix-mix", "affix-bridge-mix", "affix-bridge-mix-2")
    variants = ("affix-bridge-mix-2-seed93", "affix-bridge-mix-2-longqa", "affix-bridge-mix-2-noteacher")
    names = (*stages, *variants, "affix-anchored")
    recipe = (REPO_ROOT / "Makefile").read_text().split("\nmodel-affix:")[1].split("\n\n")[0]
    assert re.findall(r"--config configs/([\w-]+)\.json", recipe) == list(names)
    chain = [TrainConfig.from_file(REPO_ROOT / "configs" / f"{n}.json") for n in names]
    assert (REPO_ROOT / chain[0].init_from).resolve() == PLUS_MODEL.resolve()
    for before, after in zip(chain[:5], chain[1:5], strict=False):
        assert after.init_from == before.out and after.model == before.model
    fifth = asdict(chain[4])
    changed = []
    for variant in chain[5:8]:
        assert variant.init_from == chain[3].out
        changed.append(sorted(k for k, v in asdict(variant).items() if v != fifth[k] and k != "out"))
    assert changed == [["seed"], ["task_sentences", "tasks"], ["affix_teacher"]]
    assert chain[6].tasks == (*chain[4].tasks, "qa1") and chain[6].task_sentences["qa1"] == (10, 36)
    assert chain[-1].init_from == tuple(c.out for c in chain[4:8]) and chain[-1].model == chain[4].model
    assert all(not c.out.startswith("models/") for c in chain[:-1]), "only the last stage writes into models/"
    assert [c.affix_isolation for c in chain] == [0.9, 0.9, 0.75] + [0.8] * 6
    assert [c.affix_neighbours for c in chain] == [1.0] * 8 + [0.0]
    assert [c.affix_bridge for c in chain] == [0.0] * 3 + [1.0] * 5 + [0.0]
    assert {c.two_affix_fallback for c in chain[3:]} == {"draw"}
    plus = "models/acache-tiny-plus"
    assert [c.affix_teacher for c in chain] == [None] * 4 + [plus, plus, plus, None, plus]
    assert [c.affix_anchored for c in chain] == [0.0] * 8 + [0.5]
    # the last stage trains the fifth's mix: only the anchored rows and the terms they exclude are new
    assert (chain[-1].tasks, chain[-1].layouts, chain[-1].task_sentences) == (
        chain[4].tasks, chain[4].layouts, chain[4].task_sentences)
    for config, name in zip(chain[:-1], names[:-1], strict=True):
        log = json.loads((REPO_ROOT / "docs" / "study" / "affix_training" / name / "training_log.json").read_text())
        assert_logged(config, log["config"])
        assert log["steps_done"] == config.steps
    last = chain[-1]
    shipped = REPO_ROOT / last.out
    assert shipped.resolve() == (SHIPPED_MODEL.parent / "acache-tiny-affix").resolve()
    log = json.loads((shipped / "training_log.json").read_text())
    assert_logged(last, log["config"])
    assert log["steps_done"] == last.steps
    record = read_config(shipped)[1].affix_training
    assert record["steps"] == last.steps and record["affix_isolation"] == 0.8
    assert (record["affix_anchored"], record["affix_anchor_ratio"], record["affix_anchor_pass"]) == (0.5, 0.2, "one")
    assert (record["affix_teacher"], record["affix_teacher_weight"]) == (plus, 1.0)
    assert "affix_neighbours" not in record and "affix_bridge" not in record
    assert record["init_from"] == [c.out for c in chain[4:8]]


def test_plus_recipe_is_the_plus_models_config_from_the_shipped_model():
    from acache.paths import REPO_ROOT

    config = TrainConfig.from_file(REPO_ROOT / "configs" / "plus.json")
    assert (REPO_ROOT / config.init_from).resolve() == SHIPPED_MODEL.resolve()
    log = json.loads((REPO_ROOT / config.out / "training_log.json").read_text())
    assert_logged(config, log["config"])
    assert log["steps_done"] == config.steps


def test_a_block_diffusion_model_trains_from_a_llada_checkpoint(tmp_path):
    """family fast_dllm_v2 writes the Fast-dLLM v2 layout; from a LLaDA checkpoint the weights carry over and
    the q/k/v biases the LLaDA layout lacks start at zero."""
    from acache.models import FastDLLMv2Model
    from acache.models.loader import load_model

    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    train(TrainConfig(out=str(tmp_path / "llada"), steps=2, batch_size=2, warmup=1, bf16=False, tasks=("qa1",),
                      model=shape), progress=False)
    block = TrainConfig(out=str(tmp_path / "bd"), steps=1, batch_size=2, lr=1e-12, warmup=1, bf16=False,
                        tasks=("qa1",), family="fast_dllm_v2", layouts=("prefix", "infix"),
                        model=ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64, block_size=4),
                        init_from=str(tmp_path / "llada"))
    train(block, progress=False)
    source, model = load_model(tmp_path / "llada"), load_model(tmp_path / "bd")
    assert isinstance(model, FastDLLMv2Model) and model.config.block_size == 4
    theirs = dict(source.named_parameters())
    for name, p in model.named_parameters():
        want = theirs[name] if name in theirs else torch.zeros_like(p)
        assert torch.allclose(p, want, atol=1e-6), name
    log = json.loads((tmp_path / "bd" / "training_log.json").read_text())
    assert log["config"]["family"] == "fast_dllm_v2" and log["config"]["layouts"] == ["prefix", "infix"]


@pytest.mark.parametrize("family, new", [("r2lm", "sidecar"), ("blockdiff_ssm", "mixer")])
def test_a_state_cache_family_trains_from_a_llada_checkpoint(tmp_path, family, new):
    """The parent's tensors of the same name carry over; the scan it lacks starts silent (its output
    projection at zero); the model is written in the family's own layout and loads."""
    from acache.models.loader import load_model

    shape = ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64)
    train(TrainConfig(out=str(tmp_path / "llada"), steps=2, batch_size=2, warmup=1, bf16=False, tasks=("qa1",),
                      model=shape), progress=False)
    config = TrainConfig(out=str(tmp_path / family), steps=1, batch_size=2, lr=1e-12, warmup=1, bf16=False,
                         tasks=("qa1",), family=family, layouts=("prefix",), init_from=str(tmp_path / "llada"),
                         model=ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64, block_size=4))
    train(config, progress=False)
    parent, model = load_model(tmp_path / "llada"), load_model(tmp_path / family)
    assert model.family == family and model.config.block_size == 4
    # the rows' max_seq_len (256) is not the served model's context: the family keeps its own, as shipped
    assert model.config.max_position_embeddings == {"r2lm": 4096, "blockdiff_ssm": 65536}[family]
    theirs = dict(parent.named_parameters())
    mine = dict(model.named_parameters())
    for name, p in mine.items():
        if name in theirs:
            assert torch.allclose(p, theirs[name], atol=1e-6), name
        else:
            assert new in name, name
    assert all(float(p.abs().max()) < 1e-6 for n, p in mine.items() if n.endswith(f"{new}.out_proj.weight"))


def test_bad_training_configs(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 10, "learning_rate": 1}))
    with pytest.raises(ValueError, match="unknown training options"):
        TrainConfig.from_file(path)
    with pytest.raises(ValueError, match="unknown task 'qa9'"):
        TrainConfig(tasks=("qa9",))
    with pytest.raises(ValueError, match="embed_init_std must be positive"):
        TrainConfig(embed_init_std=0.0)
    with pytest.raises(ValueError, match="unknown model family 'gpt'"):
        TrainConfig(family="gpt")
    with pytest.raises(ValueError, match="model.block_size is a positive attention block of a block-causal"):
        TrainConfig(model=ModelShape(block_size=8))
    with pytest.raises(ValueError, match="layouts must be some of"):
        TrainConfig(layouts=("prefix", "diagonal"))
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="affix_isolation is a share of rows in"):
            TrainConfig(affix_isolation=share)
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="affix_anchored is a share of the isolated rows"):
            TrainConfig(affix_isolation=0.5, affix_anchored=share)
    for ratio in (0.0, -0.2, 1.2):
        with pytest.raises(ValueError, match="affix_anchor_ratio must be in"):
            TrainConfig(affix_isolation=0.5, affix_anchored=0.5, affix_anchor_ratio=ratio)
    with pytest.raises(ValueError, match="affix_anchored takes its rows among the isolated ones"):
        TrainConfig(affix_anchored=0.5)
    # rows built column for column would miss the column a shifted family refreshes before the answer
    for term in ({"affix_anchored": 0.5}, {"affix_distill": 1.0}, {"affix_neighbours": 1.0}, {"affix_bridge": 1.0}):
        with pytest.raises(ValueError, match=f"{next(iter(term))} train dream rows that would miss the column"):
            TrainConfig(family="dream", affix_isolation=0.5, **term)
    assert TrainConfig(family="dream", affix_isolation=0.5).affix_isolation == 0.5
    with pytest.raises(ValueError, match="affix_anchor_pass must be one of one, two, not 'three'"):
        TrainConfig(affix_isolation=0.5, affix_anchored=0.5, affix_anchor_pass="three")
    for weight in (-1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="affix_distill is a loss weight >= 0"):
            TrainConfig(affix_isolation=0.5, affix_distill=weight)
    with pytest.raises(ValueError, match="affix_distill pulls the isolated rows .* needs affix_isolation > 0"):
        TrainConfig(affix_distill=1.0)
    with pytest.raises(ValueError, match="and no anchored rows"):
        TrainConfig(affix_isolation=0.5, affix_anchored=0.5, affix_distill=1.0)
    for index in ("4", "-1", "one"):
        with pytest.raises(ValueError, match=f"layer_lr_scale: '{index}' is not a layer of a 4-layer model"):
            TrainConfig(layer_lr_scale={index: 2.0})
    for scale in (0.0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match=r"layer_lr_scale\['1'\] must be a positive finite number"):
            TrainConfig(layer_lr_scale={"1": scale})
    with pytest.raises(ValueError, match="layer_lr_scale names layer 1 twice"):
        TrainConfig(layer_lr_scale={"1": 2.0, "01": 3.0})
    with pytest.raises(ValueError, match="layer_lr_scale maps layer indices to multipliers"):
        TrainConfig(layer_lr_scale=[("1", 2.0)])
    assert TrainConfig(layer_lr_scale={"01": 2, 3: 1.5}).layer_lr_scale == {"1": 2.0, "3": 1.5}
    with pytest.raises(ValueError, match="context_mask_rate must be 0"):
        TrainConfig(affix_isolation=0.5, affix_anchored=0.5, context_mask_rate=0.1)
    with pytest.raises(ValueError, match="their affixes clean as the cache holds them, so context_mask_rate must be 0"):
        TrainConfig(affix_isolation=0.5, context_mask_rate=0.3)  # isolated rows would mask affix tokens
    with pytest.raises(ValueError, match="affix_anchored takes its rows among the isolated ones"):
        TrainConfig(affix_anchored=0.5)
    with pytest.raises(ValueError, match="affix_isolation trains bidirectional attention families"):
        TrainConfig(family="fast_dllm_v2", layouts=("prefix", "infix"), affix_isolation=0.5,
                    model=ModelShape(block_size=8))
    with pytest.raises(ValueError, match="stages' steps sum to 5, not to steps=6"):
        TrainConfig(steps=6, stages=(Stage(5, ("qa1",), 2, 2),))
    with pytest.raises(ValueError, match="bad stage"):
        TrainConfig(steps=5, stages=(Stage(5, ("qa1",), 3, 2),))
    path.write_text(json.dumps({"steps": 5, "stages": [{"steps": 5, "tasks": ["qa1"]}]}))
    with pytest.raises(ValueError, match="a stage needs steps, tasks"):
        TrainConfig.from_file(path)
    with pytest.raises(ValueError, match="decay_steps must be between 1 and steps - warmup = 90, not 95"):
        TrainConfig(steps=100, warmup=10, decay_steps=95)
    with pytest.raises(ValueError, match="decay_steps must be between 1 and steps - warmup = 90, not 0"):
        TrainConfig(steps=100, warmup=10, decay_steps=0)
    with pytest.raises(ValueError, match="loss_weighting must be"):
        TrainConfig(loss_weighting="uniform")
    with pytest.raises(ValueError, match="answer_reduction must be"):
        TrainConfig(answer_reduction="max")
    with pytest.raises(ValueError, match="model.conv_kernel is an option of blockdiff_ssm only, not of r2lm"):
        TrainConfig(family="r2lm", model=ModelShape(conv_kernel=8))
    with pytest.raises(ValueError, match="model.n_groups is an option of blockdiff_ssm only, not of r2lm"):
        TrainConfig(family="r2lm", model=ModelShape(n_groups=4))
    with pytest.raises(ValueError, match="model.state_size is an option of blockdiff_ssm and r2lm only, not of llada"):
        TrainConfig(model=ModelShape(state_size=32))
    with pytest.raises(ValueError, match="model.state_size must be a positive integer, got 0"):
        TrainConfig(family="blockdiff_ssm", model=ModelShape(state_size=0))
    with pytest.raises(ValueError, match=r"scan_init must be one of \['long', 'short'\], not 'mamba'"):
        TrainConfig(scan_init="mamba")
    with pytest.raises(ValueError, match="answer_masking must be"):
        TrainConfig(answer_masking="some")
    with pytest.raises(ValueError, match="answer_masking must be one of rate_t, all, count, not 'half'"):
        TrainConfig(steps=5, stages=(Stage(5, ("qa1",), 2, 2, answer_masking="half"),))
    with pytest.raises(ValueError, match="eos_weight must be >= 0"):
        TrainConfig(eos_weight=-1.0)
    with pytest.raises(ValueError, match="grad_clip and adam_eps must be positive"):
        TrainConfig(grad_clip=0.0)
    with pytest.raises(ValueError, match="rope_theta must be positive"):
        TrainConfig(model=ModelShape(rope_theta=-1.0))
    with pytest.raises(ValueError, match="stop_after must be between 1 and steps=6, not 7"):
        TrainConfig(steps=6, stop_after=7)
    for bad in (0, 7, 2.5, True):
        with pytest.raises(ValueError, match=f"save_every must be a whole number of steps between 1 and steps=6, "
                                             f"not {bad!r}"):
            TrainConfig(steps=6, save_every=bad)
    with pytest.raises(ValueError, match="eval_every must be >= 0"):
        TrainConfig(eval_every=-5)
    with pytest.raises(ValueError, match="task_sentences: unknown task 'qa9'"):
        TrainConfig(task_sentences={"qa9": (1, 2)})
    with pytest.raises(ValueError, match=r"task_sentences\['qa1'\] must be \[min, max\] with 1 <= min <= max"):
        TrainConfig(task_sentences={"qa1": (5, 2)})
    with pytest.raises(ValueError, match=r"task_sentences\['qa1'\] must be"):
        TrainConfig(task_sentences={"qa1": (3,)})
    with pytest.raises(FileNotFoundError, match="training config not found"):
        TrainConfig.from_file(tmp_path / "none.json")


@pytest.mark.skipif(not (SHIPPED_MODEL / "config.json").exists(), reason="no shipped model in this checkout yet")
def test_shipped_model_answers_held_out_questions():
    from acache import LLM
    from acache_lab.eval.tasks import evaluate

    llm = LLM(SHIPPED_MODEL)
    scores = evaluate(llm, examples=20, sentences=6, seed=7)
    # at least 18 of the 20 fixed questions right per cell, a worked sum ("4 + 7 = 11") on every token
    assert {(s.task, s.layout): s.accuracy >= 0.9 for s in scores} == {
        (t, lay): True for t in ("qa1", "arith", "twohop") for lay in ("prefix", "infix", "suffix")}


@pytest.mark.parametrize("extra", [{}, {"affix_isolation": 0.5, "affix_neighbours": 1.0, "affix_neighbour_layer": 0},
                                   {"tasks": ("codes",), "layouts": ("prefix", "two-affix"), "affix_isolation": 0.8,
                                    "affix_bridge": 1.0, "affix_bridge_layer": 0}],
                         ids=["plain", "neighbour-term", "bridge-term"])
def test_ctrl_c_saves_a_run_that_resumes_as_if_never_stopped(tmp_path, monkeypatch, extra):
    """The neighbour and bridge terms' maps are trained state too: a resumed run restores them with the optimiser."""
    import os
    import signal

    def config(out):
        opts = {"out": str(tmp_path / out), "steps": 6, "batch_size": 4, "lr": 3e-3, "warmup": 2, "log_every": 2,
                "model": ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64), "tasks": ("qa1",),
                "min_sentences": 2, "max_sentences": 2, "bf16": False}
        return TrainConfig(**{**opts, **extra})

    straight = train(config("straight"), progress=False)
    real = Batcher.batch

    def batch(self, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while step 3 runs: it finishes, then the run stops
        return real(self, step)

    monkeypatch.setattr(Batcher, "batch", batch)
    stopped = train(config("stopped"), progress=False)
    assert stopped["interrupted"] and stopped["steps_done"] == 4
    state_file = tmp_path / "stopped" / "resume_state.pt"
    state = torch.load(state_file, weights_only=False)
    if extra:  # the maps are optimised: their group, the last, has moments
        heads = state["optimizer"]["param_groups"][-1]["params"]
        assert all(bool(state["optimizer"]["state"][i]["exp_avg"].abs().sum() > 0) for i in heads)
        if "affix_neighbours" in extra:
            assert len(heads) == 8 and set(state["neighbour_heads"]) == {f"maps.{i}.weight" for i in range(8)}
        else:
            assert len(heads) == 1 and set(state["bridge_head"]) == {"weight"} and "neighbour_heads" not in state
    else:  # a state written before the neighbour options (or a model shape field) existed resumes with the defaults
        for key in ("affix_neighbours", "affix_neighbour_layer", "affix_neighbour_span", "affix_teacher",
                    "affix_teacher_weight", "affix_bridge", "affix_bridge_layer"):
            del state["config"][key]
        del state["config"]["model"]["rope_theta"]
        torch.save(state, state_file)
    monkeypatch.setattr(Batcher, "batch", real)
    with pytest.raises(ValueError, match="another config"):
        train(TrainConfig(**{**asdict(config("stopped")), "lr": 1e-3, "model": config("stopped").model}),
              progress=False, resume=True)
    (tmp_path / "stopped" / "step-2").mkdir()  # a folder of the run itself, which a resume keeps,
    (tmp_path / "stopped" / "step-4.partial").mkdir()  # and one a second Ctrl-C cut short, which it clears
    longer = TrainConfig(**{**asdict(config("stopped")), "time_limit_minutes": 120.0, "save_every": 3,
                            "model": config("stopped").model})
    resumed = train(longer, progress=False, resume=True)  # a longer time limit resumes: it only says when to stop,
    assert resumed["steps_done"] == 6 and not resumed["interrupted"]  # as save_every says only what is written
    assert sorted(p.name for p in (tmp_path / "stopped").glob("step-*")) == ["step-2", "step-6"]
    assert [r["loss"] for r in resumed["log"]] == [r["loss"] for r in straight["log"]]
    from acache.models.loader import load_model

    a, b = load_model(tmp_path / "straight"), load_model(tmp_path / "stopped")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not (tmp_path / "stopped" / "resume_state.pt").exists()
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(config("straight"), progress=False, resume=True)


PLUS_MODEL = SHIPPED_MODEL.parent / "acache-tiny-plus"


@pytest.mark.skipif(not (PLUS_MODEL / "config.json").exists(), reason="no second shipped model in this checkout")
def test_plus_model_uses_its_demonstrations_and_reads_long_documents():
    """The second shipped model answers codes from its demonstrations (and fails without them) and qa1 from
    stories of 206 tokens, in every layout."""
    from acache import LLM
    from acache_lab.eval.tasks import evaluate, exact_matches, task_params
    from acache_lab.tasks.generators import held_out
    from acache_lab.tasks.render import render_prompts

    llm = LLM(PLUS_MODEL)
    scores = evaluate(llm, examples=20, sentences=6, seed=7, tasks=("codes", "qa1")) + evaluate(
        llm, examples=20, sentences=34, seed=7, tasks=("qa1",))
    assert [s.accuracy >= 0.9 for s in scores] == [True] * 9
    exs = held_out("codes", 20, 6, seed=7)
    bare = render_prompts(llm.tokenizer, exs, "prefix", drop_affix=True)
    assert exact_matches(llm, bare, exs, task_params("codes")) <= 2  # the code is in the demonstrations only


def test_affix_model_answers_its_demonstrations_and_documents_under_direct_reuse():
    """The affix-aware model, reused with no anchors at all, answers where its parent under direct reuse does
    not: the demonstrations (codes), over one affix and beside the request's story cached as a second one, and the
    206-token documents; in context it still answers as the parent."""
    from acache import LLM
    from acache_lab.eval.tasks import exact_matches, task_params
    from acache_lab.tasks.generators import held_out
    from acache_lab.tasks.render import render_prompts

    affix, plus = LLM(SHIPPED_MODEL.parent / "acache-tiny-affix"), LLM(PLUS_MODEL)
    assert affix.default_selector == "none" and plus.default_selector == "attention"
    for task, sentences, layout in (("codes", 6, "infix"), ("qa1", 34, "infix"), ("codes", 6, "two-affix")):
        exs = held_out(task, 20, sentences, seed=7)
        prompts = render_prompts(affix.tokenizer, exs, layout)
        reused = {name: exact_matches(llm, prompts, exs, task_params(task, selector="none"))
                  for name, llm in (("affix", affix), ("plus", plus))}
        assert reused["affix"] >= 18 and reused["plus"] <= 6, (task, layout, reused)
        # full recomputation: the study reads 97.3-100.0 on these cells (seed 7, 300 requests), 18 of these 20 on qa1
        assert exact_matches(affix, prompts, exs, task_params(task)) >= 18


def test_blockdiff_recipe_and_model():
    """The block-diffusion model: one config from the shipped R2LM model (whose causal attention already
    reads a worksheet from the answer's side) into Fast-dLLM v2's layout, and what its log records; it
    answers every task in the prefix and infix layouts."""
    from acache import LLM
    from acache.models import FastDLLMv2Model
    from acache.paths import REPO_ROOT
    from acache_lab.eval.tasks import evaluate

    config = TrainConfig.from_file(REPO_ROOT / "configs" / "blockdiff.json")
    r2lm = TrainConfig.from_file(REPO_ROOT / "configs" / "r2lm.json")
    assert config.init_from == r2lm.out and config.family == "fast_dllm_v2"
    assert config.model.block_size == r2lm.model.block_size == 8
    model_dir = REPO_ROOT / config.out
    log = json.loads((model_dir / "training_log.json").read_text())
    assert_logged(config, log["config"])
    assert log["steps_done"] == config.steps
    llm = LLM(model_dir)
    assert isinstance(llm.model, FastDLLMv2Model) and llm.model.config.block_size == 8
    scores = evaluate(llm, examples=20, sentences=6, seed=7, layouts=("prefix", "infix"))
    assert all(s.accuracy >= 0.9 for s in scores), scores


def test_r2lm_recipe_and_model():
    """The R2LM model: its three configs chain from the shipped model and the last is what its log records;
    served by the engine it answers every task in the prefix and infix layouts."""
    from acache import LLM
    from acache.models.r2lm import R2LM
    from acache.paths import REPO_ROOT
    from acache_lab.eval.tasks import evaluate

    stages = [TrainConfig.from_file(REPO_ROOT / "configs" / f"{n}.json") for n in ("r2lm-stage1", "r2lm-stage2",
                                                                                   "r2lm")]
    assert (REPO_ROOT / stages[0].init_from).resolve() == SHIPPED_MODEL.resolve()
    for before, after in pairwise(stages):
        assert after.init_from == before.out and after.model == before.model and after.family == "r2lm"
    config = stages[-1]
    log = json.loads((REPO_ROOT / config.out / "training_log.json").read_text())
    assert_logged(config, log["config"])
    assert log["steps_done"] == config.steps
    runner = LLM(REPO_ROOT / config.out)
    assert isinstance(runner.model, R2LM) and runner.model.config.block_size == 8
    scores = evaluate(runner, examples=20, sentences=6, seed=7, layouts=("prefix", "infix"))
    assert all(s.accuracy >= 0.9 for s in scores), scores


def test_ssm_recipe_and_model():
    """The state-space model: one config from the shipped model, the config its log records (it was trained into
    build/ and copied to models/), and it answers every task in the prefix layout."""
    from acache import LLM
    from acache.models.ssm import SSMBlockDiffusionLM
    from acache.paths import REPO_ROOT
    from acache_lab.eval.tasks import evaluate

    config = TrainConfig.from_file(REPO_ROOT / "configs" / "ssm-tiny.json")
    assert (REPO_ROOT / config.init_from).resolve() == SHIPPED_MODEL.resolve()
    assert config.family == "blockdiff_ssm" and config.decay_steps is not None
    log = json.loads((REPO_ROOT / config.out / "training_log.json").read_text())
    assert_logged(config, log["config"], ignore={"out"})
    assert log["steps_done"] == config.steps
    llm = LLM(REPO_ROOT / config.out)
    assert isinstance(llm.model, SSMBlockDiffusionLM)
    scores = evaluate(llm, examples=20, sentences=6, seed=7, layouts=("prefix",))
    assert all(s.accuracy >= 0.9 for s in scores), scores


def signal_at(monkeypatch, step: int, signum: int) -> None:
    """Sends this process ``signum`` while the batch of ``step`` is drawn (a Ctrl-C or a kill during that step)."""
    import os

    real = Batcher.batch

    def batch(self, at):
        if at == step:
            os.kill(os.getpid(), signum)
        return real(self, at)

    monkeypatch.setattr(Batcher, "batch", batch)


def small_run(out, **extra) -> TrainConfig:
    opts = {"out": str(out), "steps": 6, "batch_size": 4, "lr": 3e-3, "warmup": 2, "log_every": 2,
            "model": ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64), "tasks": ("qa1",),
            "min_sentences": 2, "max_sentences": 2, "bf16": False}
    return TrainConfig(**{**opts, **extra})


def test_a_run_the_time_limit_stops_is_saved_resumable_and_resumes_as_if_never_stopped(tmp_path, monkeypatch):
    import acache_lab.train.trainer as trainer

    straight = train(small_run(tmp_path / "straight"), progress=False)
    real, clock, passed = Batcher.batch, trainer.time.perf_counter, {"s": 0.0}

    def batch(self, step):
        if step == 3:
            passed["s"] = 2 * 3600.0  # two hours pass while step 3 runs: the 90-minute limit stops the run after it
        return real(self, step)

    monkeypatch.setattr(trainer.time, "perf_counter", lambda: clock() + passed["s"])
    monkeypatch.setattr(Batcher, "batch", batch)
    stopped = train(small_run(tmp_path / "stopped"), progress=False)
    assert stopped["interrupted"] and stopped["steps_done"] == 4 and "time limit" in stopped["stopped_by"]
    assert (tmp_path / "stopped" / "resume_state.pt").is_file()
    monkeypatch.setattr(Batcher, "batch", real)
    resumed = train(small_run(tmp_path / "stopped", time_limit_minutes=600.0), progress=False, resume=True)
    assert resumed["steps_done"] == 6 and not resumed["interrupted"]
    assert [r["loss"] for r in resumed["log"]] == [r["loss"] for r in straight["log"]]


def test_the_command_line_says_a_run_was_cut_short_by_its_time_limit(tmp_path, monkeypatch, capsys):
    import acache_lab.train.trainer as trainer
    from acache.cli import main

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"out": str(tmp_path / "run"), "steps": 6, "batch_size": 4, "log_every": 2,
                                  "model": {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64},
                                  "tasks": ["qa1"], "min_sentences": 2, "max_sentences": 2, "bf16": False,
                                  "time_limit_minutes": 1.0}))
    clock, passed, real = trainer.time.perf_counter, {"s": 0.0}, Batcher.batch

    def batch(self, step):
        passed["s"] += 45.0  # 45 s a step: the one-minute limit stops the run after its second step
        return real(self, step)

    monkeypatch.setattr(trainer.time, "perf_counter", lambda: clock() + passed["s"])
    monkeypatch.setattr(Batcher, "batch", batch)
    assert main(["train", "--config", str(config)]) == 1
    assert "stopped by the time limit of 1.0 min after 2 steps" in capsys.readouterr().err


def test_a_save_cut_short_never_leaves_an_older_resume_state_beside_newer_weights(tmp_path, monkeypatch):
    import os
    import signal

    import acache_lab.train.trainer as trainer

    real = Batcher.batch

    def ctrl_c_at(at):
        def batch(self, step):
            if step == at:
                os.kill(os.getpid(), signal.SIGINT)
            return real(self, step)
        return batch

    monkeypatch.setattr(Batcher, "batch", ctrl_c_at(2))
    train(small_run(tmp_path / "run"), progress=False)
    assert (tmp_path / "run" / "resume_state.pt").is_file()
    monkeypatch.setattr(Batcher, "batch", ctrl_c_at(4))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies while the loss plot is written, after the new weights

    monkeypatch.setattr(trainer, "plot_loss", killed)
    with pytest.raises(KeyboardInterrupt):
        train(small_run(tmp_path / "run"), progress=False, resume=True)
    assert not (tmp_path / "run" / "resume_state.pt").exists()
    (tmp_path / "run" / "resume_state.pt").write_bytes(b"cut")
    with pytest.raises(ValueError, match="resume_state.pt cannot be read .* start the run again with --restart"):
        train(small_run(tmp_path / "run"), progress=False, resume=True)


def test_an_output_that_cannot_be_written_is_named_before_any_step(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(Batcher, "batch", lambda self, step: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match="cannot write the run's output to .*a-file"):
        train(small_run(tmp_path / "a-file" / "run"), progress=False)


def test_a_row_longer_than_the_models_context_is_named(tmp_path):
    config = small_run(tmp_path / "run", model=ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64,
                                                          max_seq_len=32), min_sentences=6, max_sentences=6)
    with pytest.raises(ValueError, match="a qa1 example in the .* layout takes \\d+ tokens, more than the model's "
                                         "max_seq_len of 32"):
        train(config, progress=False)


@pytest.mark.parametrize("field, value, message", [
    ("weight_decay", -1.0, r"weight_decay must be a finite number in \[0, inf\], not -1.0"),  # weights grew
    ("context_mask_rate", 2.0, r"context_mask_rate must be a finite number in \[0, 1\], not 2.0"),
    ("lr", "0.001", "lr must be a finite number in \\(0, inf\\], not '0.001'"),  # a TypeError from inside
    ("lr", float("nan"), "lr must be a finite number"),
    ("time_limit_minutes", 0, r"time_limit_minutes must be a finite number in \(0, inf\], not 0"),
    ("log_every", 0, "log_every is a positive number of steps, not 0"),
])
def test_bad_numbers_are_named_at_construction(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        small_run(tmp_path / "run", **{field: value})


def test_a_sigterm_stops_a_run_as_ctrl_c_does_and_it_is_saved_resumable(tmp_path, monkeypatch):
    """timeout or a scheduler's kill sends SIGTERM: everything after the last save_every folder was lost."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    signal_at(monkeypatch, 3, signal.SIGTERM)
    stopped = train(small_run(tmp_path / "run"), progress=False)
    assert (stopped["interrupted"], stopped["steps_done"], stopped["stopped_by"]) == (True, 4, "SIGTERM")
    assert (tmp_path / "run" / "resume_state.pt").is_file() and signal.getsignal(signal.SIGTERM) == before


def test_a_row_too_long_at_the_curriculums_end_is_named_before_any_step(tmp_path, monkeypatch):
    """The curriculum grows the stories: a row past max_seq_len was drawn (and the run lost) only hours in."""
    config = small_run(tmp_path / "run", model=ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64,
                                                          max_seq_len=64), min_sentences=2, max_sentences=14,
                       curriculum_steps=30, steps=40)
    monkeypatch.setattr(Batcher, "batch", lambda self, step: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match="takes \\d+ tokens, more than the model's max_seq_len of 64"):
        train(config, progress=False)


def test_count_masking_weighs_every_answer_column_alike():
    """``masking="count"`` (LoRA's) masks 1..n of a row's n answer columns and weighs them n / k: every column's
    mean weight is 1, and no row is left with nothing masked. ``rate_t`` forces the first column of a row that drew
    none, so under ``1/t`` that column weighs several times the others (what LoRA trained with before)."""
    from acache_lab.train.trainer import draw_masks, loss_weights

    b, width = 64, 8
    answer = torch.zeros(b, width, dtype=torch.bool)
    answer[:, 2:6] = True
    valid = torch.ones(b, width, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    totals = {"count": torch.zeros(width), "rate_t": torch.zeros(width)}
    rounds = 200
    for _ in range(rounds):
        for masking, weighting in (("count", "masked_count"), ("rate_t", "inverse_t")):
            masked, t = draw_masks(answer, valid, gen, masking)
            assert bool(masked.any(-1).all()) and not bool((masked & ~answer).any())
            totals[masking] += loss_weights(masked, answer, t, weighting).sum(0)
    count = totals["count"] / (b * rounds)
    assert torch.allclose(count[2:6], torch.ones(4), atol=0.08) and count[[0, 1, 6, 7]].sum() == 0
    rate = totals["rate_t"] / (b * rounds)
    assert rate[2] > 3 * rate[3:6].max()


def test_a_stopped_run_is_never_started_over_without_saying_so(tmp_path, monkeypatch, capsys):
    """The same command without --resume deleted a stopped run's snapshots and trained over it from step 0, saying
    nothing; now it is refused, naming --resume and --overwrite; and every config's output is checked for writing
    before the first trains."""
    import acache_lab.train.trainer as trainer
    from acache.cli import main

    def config(name, out):
        path = tmp_path / name
        path.write_text(json.dumps({"out": str(out), "steps": 6, "batch_size": 4, "log_every": 2,
                                    "model": {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64},
                                    "tasks": ["qa1"], "min_sentences": 2, "max_sentences": 2, "bf16": False,
                                    "time_limit_minutes": 1.0}))
        return str(path)

    run = config("run.json", tmp_path / "run")
    clock, passed, real = trainer.time.perf_counter, {"s": 0.0}, Batcher.batch

    def batch(self, step):
        passed["s"] += 45.0  # the one-minute limit stops the run after its second step
        return real(self, step)

    monkeypatch.setattr(trainer.time, "perf_counter", lambda: clock() + passed["s"])
    monkeypatch.setattr(Batcher, "batch", batch)
    assert main(["train", "--config", run]) == 1
    state = (tmp_path / "run" / "resume_state.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", "--config", run]) == 2
    assert "holds a stopped run (resume_state.pt): continue it with --resume, or pass --restart" in \
        capsys.readouterr().err
    assert main(["train", "--config", run, "--overwrite"]) == 2  # for tracked files (make's targets pass it), not this
    assert (tmp_path / "run" / "resume_state.pt").read_bytes() == state  # untouched
    assert main(["train", "--config", run, "--restart", "--resume"]) == 2
    assert "--resume and --restart contradict each other" in capsys.readouterr().err
    assert main(["train", "--config", run, "--restart"]) == 1  # from step 0: the limit stops it after 2 steps again
    assert "stopped by the time limit of 1.0 min after 2 steps" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(Batcher, "batch", lambda self, step: pytest.fail("a step ran"))
    assert main(["train", "--config", run, "--config", config("late.json", tmp_path / "a-file" / "x"),
                 "--resume"]) == 2
    assert "cannot write the run's output to" in capsys.readouterr().err
