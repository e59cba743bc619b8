"""The bridge term: which rows and columns name the first hop, what it adds to the loss, that it trains, and that its
map stays out of the checkpoint but in a resumed run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from acache.models.checkpoint import family_model
from acache_lab.tasks.generators import codes, examples, held_out
from acache_lab.tasks.render import TWO_AFFIXES, build_word_tokenizer
from acache_lab.train.bridge import Bridge, bridge_head, bridge_loss
from acache_lab.train.trainer import (
    Batcher,
    ModelShape,
    Stage,
    TrainConfig,
    init_for_training_,
    layer_states,
    masked_diffusion_loss,
    train,
)

LAYOUTS = ("prefix", TWO_AFFIXES)


def _setup(layers: int = 3):
    tok = build_word_tokenizer()
    config = TrainConfig(model=ModelShape(layers=layers, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("codes", "qa1"), min_sentences=2, max_sentences=4, batch_size=8, bf16=False,
                         layouts=LAYOUTS, affix_isolation=0.5, affix_bridge=1.0, affix_bridge_layer=1)
    batcher = Batcher(config, tok)
    model = family_model("llada", tok.get_vocab_size(with_added_tokens=True), batcher.mask, batcher.eos, layers=layers,
                         hidden_size=32, heads=2, intermediate_size=64, max_seq_len=256)
    init_for_training_(model, 0, 0.2, 1.0, torch.Generator().manual_seed(0))
    return tok, batcher, model


def test_a_codes_example_names_the_holder_it_asks_about():
    import random

    for ex in codes(random.Random(3), sentences=5, questions=6):
        held = dict(zip(ex.context[0::5], ex.context[3::5], strict=True))  # "OBJECT went to NAME ." a pickup
        assert ex.bridge == (held[ex.question[0]],)
        assert ex.bridge[0] not in ex.question and ex.bridge[0] not in ex.answer
    assert all(not e.bridge for e in examples("qa1", 0, 5))


def test_only_two_affix_rows_of_a_task_with_a_first_hop_carry_it():
    tok, batcher, _ = _setup()
    ex = held_out("codes", 1, 4)[0]
    assert batcher.row(ex, TWO_AFFIXES).bridge == tok.token_to_id(ex.bridge[0])
    assert batcher.row(ex, "prefix").bridge == -1
    assert batcher.row(held_out("qa1", 1, 4)[0], TWO_AFFIXES).bridge == -1  # qa1 falls back to a plain layout
    rows = [batcher.row(ex, TWO_AFFIXES), batcher.row(ex, "prefix")]
    batch = batcher.collate(rows)
    assert batch.bridge.tolist() == [rows[0].bridge, -1]
    assert batch.to("cpu").bridge.tolist() == batch.bridge.tolist()


def test_the_term_is_the_cross_entropy_at_masked_first_answer_columns_of_rows_with_a_target():
    _, _, model = _setup()
    states = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    head = bridge_head(32)
    targets = torch.tensor([7, -1, 9])
    columns = torch.tensor([2, 2, 3])
    masked = torch.zeros(3, 5, dtype=torch.bool)
    masked[0, 2] = masked[1, 2] = masked[2, 3] = True
    with torch.no_grad():
        want = F.cross_entropy(model.unembed(model.norm(states[[0, 2], [2, 3]])), targets[[0, 2]])
        assert float(bridge_loss(model, head, states, targets, columns, masked)) == pytest.approx(float(want))
        masked[2, 3] = False  # a visible answer gives the hop away: that row drops out
        want = F.cross_entropy(model.unembed(model.norm(states[[0], [2]])), targets[[0]])
        assert float(bridge_loss(model, head, states, targets, columns, masked)) == pytest.approx(float(want))
        assert float(bridge_loss(model, head, states, torch.full((3,), -1), columns, masked)) == 0.0


def test_the_loss_adds_the_weighted_term_of_the_chosen_layer():
    _, batcher, model = _setup()
    batch = batcher.collate([batcher.row(e, layout) for e, layout in
                             zip(held_out("codes", 4, 4), (TWO_AFFIXES, "prefix") * 2, strict=True)])
    isolated = torch.ones(4, dtype=torch.bool)
    attention = batch.attention(isolated)
    head = bridge_head(32)

    def loss(bridge):  # every answer column masked
        return masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                     torch.Generator().manual_seed(2), masking="all", attention=attention,
                                     bridge=bridge)

    noisy = torch.where(batch.answer, torch.full_like(batch.ids, batcher.mask), batch.ids)
    first = batch.answer.float().argmax(-1)
    with torch.no_grad():
        plain = float(loss(None))
        states = layer_states(model, noisy, batch.positions, attention)
        for layer in (0, 1):
            want = bridge_loss(model, head, states[layer], batch.bridge, first, batch.answer)
            got = float(loss(Bridge(0.5, head, layer, batch.bridge))) - plain
            assert float(want) > 0 and got == pytest.approx(0.5 * float(want), rel=1e-4)
        assert float(loss(Bridge(0.5, head, 1, torch.full((4,), -1)))) == pytest.approx(plain, abs=1e-6)


def test_the_term_trains_the_answer_column_to_name_the_first_hop():
    """Minimised alone on one batch, the term's cross-entropy falls well below its start: its gradient reaches the
    layers up to its own (and the map)."""
    _, batcher, model = _setup()
    batch = batcher.collate([batcher.row(e, TWO_AFFIXES) for e in held_out("codes", 8, 4)])
    attention = batch.attention(torch.ones(8, dtype=torch.bool))
    head = bridge_head(32)
    opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=3e-3)
    noisy = torch.where(batch.answer, torch.full_like(batch.ids, batcher.mask), batch.ids)
    first = batch.answer.float().argmax(-1)
    terms = []
    for _ in range(40):
        term = bridge_loss(model, head, layer_states(model, noisy, batch.positions, attention)[1], batch.bridge,
                           first, batch.answer)
        opt.zero_grad()
        term.backward()
        opt.step()
        terms.append(term.item())
    assert terms[-1] < 0.3 * terms[0], terms


def test_a_run_trains_with_the_term_records_it_and_ships_no_map(tmp_path):
    """The run with the term moves the weights away from the same run without it, and writes the same tensors."""
    from safetensors.torch import load_file

    from acache.models.loader import read_config

    def run(out, **extra):
        config = TrainConfig(out=str(tmp_path / out), steps=12, batch_size=6, lr=3e-3, warmup=2, log_every=4,
                             model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64),
                             tasks=("codes",), min_sentences=2, max_sentences=3, bf16=False, layouts=LAYOUTS,
                             affix_isolation=0.8, **extra)
        summary = train(config, progress=False)
        assert all(r["loss"] == r["loss"] for r in summary["log"])
        return load_file(tmp_path / out / "model.safetensors")

    with_term, without = run("m", affix_bridge=1.0, affix_bridge_layer=0), run("plain")
    record = read_config(tmp_path / "m")[1].affix_training
    assert (record["affix_bridge"], record["affix_bridge_layer"]) == (1.0, 0)
    assert "affix_bridge" not in read_config(tmp_path / "plain")[1].affix_training
    assert with_term.keys() == without.keys()
    assert any(not torch.equal(with_term[k], without[k]) for k in without)


def test_a_bridge_word_outside_the_vocabulary_is_named():
    _, batcher, _ = _setup()
    with pytest.raises(ValueError, match="'zebra' is not one word of the task vocabulary"):
        batcher.token("zebra")
    assert batcher.token("mary") == build_word_tokenizer().token_to_id("mary")


@pytest.mark.parametrize("options, message", [
    ({"affix_bridge": -1.0}, "affix_bridge is a loss weight >= 0"),
    ({"affix_bridge": float("nan")}, "affix_bridge is a loss weight >= 0"),
    ({"affix_bridge": True}, "affix_bridge is a loss weight >= 0"),
    ({"affix_bridge": 1.0, "affix_isolation": 0.0}, "affix_bridge trains the isolated rows: it needs affix_isolation"),
    ({"affix_bridge": 1.0, "affix_anchored": 0.5}, r"and no anchored rows \(affix_anchored 0\)"),
    ({"affix_bridge": 1.0, "layouts": ("prefix",)}, "affix_bridge trains the two-affix rows: put two-affix among"),
    ({"affix_bridge": 1.0, "tasks": ("qa1", "arith")}, r"needs a task whose examples carry a first hop \(codes\)"),
    ({"affix_bridge": 1.0, "tasks": ("qa1",), "steps": 2, "stages": (Stage(2, ("qa1", "grab"), 2, 2),)},
     "needs a task whose examples carry a first hop"),
    ({"affix_bridge": 1.0, "affix_bridge_layer": 4}, "affix_bridge_layer is the index of one of the model's 4"),
    ({"affix_bridge": 1.0, "affix_bridge_layer": -1}, "affix_bridge_layer is the index of one of the model's 4"),
    ({"affix_bridge_layer": 1.5}, "affix_bridge_layer is the index of one of the model's 4"),
])
def test_bad_bridge_settings_are_refused_by_name(options, message):
    base = {"affix_isolation": 0.5, "layouts": LAYOUTS, "tasks": ("codes", "qa1")}
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**base, **options})


def test_the_training_loop_gives_the_term_its_targets_on_isolated_two_affix_rows_only(tmp_path, monkeypatch):
    """Inside a run, the rows the term reads are the isolated two-affix codes rows; the others carry no target."""
    import acache_lab.train.trainer as trainer

    seen = []
    real = trainer.bridge_loss

    def spy(model, head, states, targets, columns, masked):
        seen.append(targets.clone())
        return real(model, head, states, targets, columns, masked)

    monkeypatch.setattr(trainer, "bridge_loss", spy)
    spans = []
    real_attention = trainer.Batch.attention

    def attention(self, isolated):
        spans.append((self.bridge.clone(), None if isolated is None else isolated.clone()))
        return real_attention(self, isolated)

    monkeypatch.setattr(trainer.Batch, "attention", attention)
    config = TrainConfig(out=str(tmp_path / "m"), steps=4, batch_size=8, warmup=1, bf16=False, layouts=LAYOUTS,
                         model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("codes", "qa1"), min_sentences=2, max_sentences=3, affix_isolation=0.5,
                         affix_bridge=1.0, affix_bridge_layer=1)
    train(config, progress=False)
    assert len(seen) == 4 == len(spans)
    for targets, (bridge, isolated) in zip(seen, spans, strict=True):
        assert targets.tolist() == torch.where(isolated, bridge, -1).tolist()
    assert any(bool(((b >= 0) & ~i).any()) for b, i in spans)  # a two-affix row left in context: no target
    assert any(bool((t >= 0).any()) for t in seen)
