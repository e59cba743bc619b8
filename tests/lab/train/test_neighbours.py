"""The neighbour term: which affix columns predict which tokens, what it adds to the loss, that it trains, and that
its maps stay out of the checkpoint but in a resumed run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from acache.models.checkpoint import family_model
from acache_lab.tasks.render import build_word_tokenizer
from acache_lab.train.isolation import LayeredMask, span_owners
from acache_lab.train.neighbours import NeighbourHeads, neighbour_loss
from acache_lab.train.trainer import (
    Batcher,
    ModelShape,
    Neighbours,
    TrainConfig,
    init_for_training_,
    layer_states,
    masked_diffusion_loss,
    reuse_distillation,
    train,
)


def _model(family: str = "llada", layers: int = 3):
    tok = build_word_tokenizer()
    config = TrainConfig(model=ModelShape(layers=layers, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("grab", "qa1"), min_sentences=2, max_sentences=4, batch_size=6, bf16=False,
                         affix_isolation=0.5, affix_neighbours=1.0)
    batcher = Batcher(config, tok)
    model = family_model(family, tok.get_vocab_size(with_added_tokens=True), batcher.mask, batcher.eos, layers=layers,
                         hidden_size=32, heads=2, intermediate_size=64, max_seq_len=256)
    init_for_training_(model, 0, 0.2, 1.0, torch.Generator().manual_seed(0))
    return batcher, model


def _by_hand(model, heads: NeighbourHeads, states, ids, owner) -> float:
    """The term written out pair by pair: for each offset, the mean cross-entropy over the columns whose
    neighbour there lies in the same span; then the mean over the offsets that have a pair."""
    per_offset = []
    b, t = ids.shape
    for offset, lin in zip(heads.offsets, heads.maps, strict=True):
        losses = []
        for row in range(b):
            for col in range(t):
                there = col + offset
                if 0 <= there < t and owner[row, col] > 0 and owner[row, there] == owner[row, col]:
                    scores = model.unembed(model.norm(lin(states[row, col])))
                    losses.append(float(F.cross_entropy(scores[None], ids[row, there][None])))
        if losses:
            per_offset.append(sum(losses) / len(losses))
    return sum(per_offset) / len(per_offset) if per_offset else 0.0


def test_heads_cover_the_offsets_either_side_and_refuse_a_bad_span():
    heads = NeighbourHeads(16, 3)
    assert heads.offsets == (-3, -2, -1, 1, 2, 3) and len(heads.maps) == 6
    assert all(m.weight.shape == (16, 16) and m.bias is None for m in heads.maps)
    for span in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="span is a positive number of tokens"):
            NeighbourHeads(16, span)


def test_low_rank_heads_factor_each_map_and_refuse_a_bad_rank():
    heads = NeighbourHeads(16, 2, rank=4)
    assert len(heads.maps) == 4
    for m in heads.maps:
        assert [f.weight.shape for f in m] == [(4, 16), (16, 4)]
    assert sum(p.numel() for p in heads.parameters()) == 4 * 2 * 16 * 4
    for rank in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="rank is a positive number of dimensions or None"):
            NeighbourHeads(16, 2, rank=rank)


def test_sampled_pairs_bound_each_offsets_rows_and_estimate_the_same_term():
    """With ``pairs``, each offset predicts at most that many of its pairs, a draw that the generator's seed fixes;
    with ``pairs`` at least an offset's count, nothing is drawn and the term is the whole one; the draws average to
    the whole term."""
    _, model = _model()
    model.requires_grad_(False)
    torch.manual_seed(1)
    heads = NeighbourHeads(32, 2, rank=8).requires_grad_(False)
    ids = torch.randint(0, 60, (2, 12))
    owner = span_owners(torch.ones(2, 12, dtype=torch.bool), [((0, 10),), ((1, 12),)])
    states = torch.randn(2, 12, 32)
    whole = float(neighbour_loss(model, heads, states, ids, owner))
    assert whole == pytest.approx(_by_hand(model, heads, states, ids, owner), rel=1e-5)
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    # offset +-1 has the most pairs, 9 + 10: as many pairs as that draw nothing, one fewer draws
    assert float(neighbour_loss(model, heads, states, ids, owner, pairs=19, gen=gen)) == pytest.approx(whole, rel=1e-6)
    assert torch.equal(gen.get_state(), state)
    neighbour_loss(model, heads, states, ids, owner, pairs=18, gen=gen)
    assert not torch.equal(gen.get_state(), state)

    rows_seen = []
    unembed = model.unembed
    model.unembed = lambda h: (rows_seen.append(h.shape[0]), unembed(h))[1]
    try:
        one = float(neighbour_loss(model, heads, states, ids, owner, pairs=3, gen=torch.Generator().manual_seed(7)))
    finally:
        del model.unembed
    assert rows_seen == [3, 3, 3, 3]
    again = float(neighbour_loss(model, heads, states, ids, owner, pairs=3, gen=torch.Generator().manual_seed(7)))
    other = float(neighbour_loss(model, heads, states, ids, owner, pairs=3, gen=torch.Generator().manual_seed(8)))
    assert again == one and other != one
    gen = torch.Generator().manual_seed(0)
    draws = [float(neighbour_loss(model, heads, states, ids, owner, pairs=3, gen=gen)) for _ in range(400)]
    assert sum(draws) / len(draws) == pytest.approx(whole, rel=0.02)


@pytest.mark.parametrize("pairs, gen", [(0, torch.Generator()), (2.5, torch.Generator()), (True, torch.Generator()),
                                        (4, None)])
def test_bad_pairs_are_refused(pairs, gen):
    _, model = _model()
    owner = span_owners(torch.ones(1, 4, dtype=torch.bool), [((0, 4),)])
    with pytest.raises(ValueError, match="pairs is a positive number of pairs an offset, drawn with a generator"):
        neighbour_loss(model, NeighbourHeads(32, 1), torch.randn(1, 4, 32), torch.zeros(1, 4, dtype=torch.long),
                       owner, pairs=pairs, gen=gen)


def test_float32_maps_beside_a_bfloat16_model_outside_autocast():
    """A released checkpoint loads in bfloat16 while the maps train in float32: outside autocast the term takes
    the states in the maps' dtype and gives the model's norm its own back."""
    _, model = _model()
    model = model.to(torch.bfloat16).requires_grad_(False)
    heads = NeighbourHeads(32, 1, rank=4)
    owner = span_owners(torch.ones(1, 5, dtype=torch.bool), [((0, 5),)])
    states = torch.randn(1, 5, 32, dtype=torch.bfloat16)
    seen = []
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    term = neighbour_loss(model, heads, states, torch.randint(0, 60, (1, 5)), owner)
    assert term.isfinite() and term > 0 and seen == [torch.bfloat16, torch.bfloat16]
    term.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in heads.parameters())


def test_each_affix_column_predicts_its_neighbours_inside_the_same_span_only():
    """Two adjacent spans on one row, one span and some outside columns on another, nothing on a third: only pairs
    inside one span count (not across the two spans' border, not outside), and the term matches a pair-by-pair
    computation."""
    _, model = _model()
    model.requires_grad_(False)
    torch.manual_seed(0)
    heads = NeighbourHeads(32, 2).requires_grad_(False)
    ids = torch.randint(0, 60, (3, 9))
    valid = torch.ones(3, 9, dtype=torch.bool)
    owner = span_owners(valid, [((0, 3), (3, 7)), ((2, 6),), ()])
    states = torch.randn(3, 9, 32)
    got = neighbour_loss(model, heads, states, ids, owner)
    assert float(got) == pytest.approx(_by_hand(model, heads, states, ids, owner), rel=1e-5)
    # the border between the two spans: moving it changes which pairs count, so the term changes
    moved = span_owners(valid, [((0, 4), (4, 7)), ((2, 6),), ()])
    assert float(neighbour_loss(model, heads, states, ids, moved)) != pytest.approx(float(got), rel=1e-4)
    # a token outside every span changes nothing
    outside = ids.clone()
    outside[1, 7], outside[2, 4] = (outside[1, 7] + 1) % 60, (outside[2, 4] + 1) % 60
    assert float(neighbour_loss(model, heads, states, outside, owner)) == pytest.approx(float(got), rel=1e-6)
    # a token inside one does
    inside = ids.clone()
    inside[0, 4] = (inside[0, 4] + 1) % 60
    assert float(neighbour_loss(model, heads, states, inside, owner)) != pytest.approx(float(got), rel=1e-4)


def test_no_span_or_one_token_spans_give_zero():
    _, model = _model()
    heads = NeighbourHeads(32, 2)
    ids, states = torch.randint(0, 60, (2, 5)), torch.randn(2, 5, 32)
    valid = torch.ones(2, 5, dtype=torch.bool)
    assert float(neighbour_loss(model, heads, states, ids, span_owners(valid, [(), ()]))) == 0.0
    assert float(neighbour_loss(model, heads, states, ids, span_owners(valid, [((1, 2),), ((4, 5),)]))) == 0.0


def test_a_shifted_family_predicts_each_neighbour_from_the_columns_own_state():
    """``unembed`` is the output embedding alone: on Dream, whose ``logits`` predict column ``c`` from column
    ``c - 1``, the term still reads each column's own state."""
    _, model = _model("dream")
    model.requires_grad_(False)
    hidden = torch.randn(2, 6, 32)
    shifted = model.logits(hidden)
    assert torch.allclose(shifted[:, 1:], model.unembed(hidden[:, :-1]), atol=1e-5)
    heads = NeighbourHeads(32, 1).requires_grad_(False)
    ids = torch.randint(0, 60, (2, 6))
    owner = span_owners(torch.ones(2, 6, dtype=torch.bool), [((0, 6),), ((1, 4),)])
    assert float(neighbour_loss(model, heads, hidden, ids, owner)) == pytest.approx(
        _by_hand(model, heads, hidden, ids, owner), rel=1e-5)


def test_the_loss_adds_the_weighted_term_of_the_chosen_layer_beside_distillation():
    """Through ``masked_diffusion_loss``: the plain loss plus the weight times the term of the chosen layer's output
    states on the clean ids; with distillation as well, both terms are added."""
    batcher, model = _model()
    batch = batcher.batch(0)
    isolated = torch.tensor([True, False] * 3)
    attention = batch.attention(isolated)
    owner = span_owners(batch.valid, batch.isolated_spans(isolated))
    heads = NeighbourHeads(32, 3)

    def loss(neighbours, distill=None):  # every answer column masked: the noisy rows are known
        return masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                                     torch.Generator().manual_seed(3), masking="all", attention=attention,
                                     distill=distill, neighbours=neighbours)

    noisy = torch.where(batch.answer, torch.full_like(batch.ids, batcher.mask), batch.ids)
    with torch.no_grad():
        states = layer_states(model, noisy, batch.positions, attention)
        plain = float(loss(None))
        for layer in (0, 2):
            want = float(neighbour_loss(model, heads, states[layer], batch.ids, owner))
            assert want > 1.0
            got = float(loss(Neighbours(0.5, heads, layer, owner))) - plain
            assert got == pytest.approx(0.5 * want, rel=1e-4)
        columns = batch.outside_affixes(isolated)
        distilled = float(loss(None, (2.0, columns)))
        both = float(loss(Neighbours(0.5, heads, 1, owner), (2.0, columns)))
        term = float(neighbour_loss(model, heads, states[1], batch.ids, owner))
        assert distilled > plain and both == pytest.approx(distilled + 0.5 * term, rel=1e-4)
        teacher = layer_states(model, noisy, batch.positions, batch.valid)
        assert distilled - plain == pytest.approx(2.0 * float(reuse_distillation(states, teacher, columns)), rel=1e-4)


def test_the_term_trains_the_affix_states_to_name_their_neighbours():
    """Minimised alone on one batch of isolated rows (the model and the maps together), the term falls by half
    within 60 steps; the gradient reaches the layers up to the chosen one and no later."""
    batcher, model = _model()
    batch = batcher.batch(1)
    every = torch.ones(len(batch.ids), dtype=torch.bool)
    attention = batch.attention(every)
    owner = span_owners(batch.valid, batch.isolated_spans(every))
    heads = NeighbourHeads(32, 2)
    opt = torch.optim.Adam([*model.parameters(), *heads.parameters()], lr=3e-3)
    terms = []
    for step in range(60):
        term = neighbour_loss(model, heads, layer_states(model, batch.ids, batch.positions, attention)[1], batch.ids,
                              owner)
        opt.zero_grad()
        term.backward()
        if step == 0:
            reached = {name.split(".")[1] for name, p in model.named_parameters()
                       if name.startswith("layers.") and p.grad is not None and bool(p.grad.abs().sum() > 0)}
            assert reached == {"0", "1"}
        opt.step()
        terms.append(term.item())
    assert terms[-1] < 0.5 * terms[0], terms


def test_owners_of_another_shape_are_refused():
    batcher, model = _model()
    batch = batcher.batch(0)
    owner = span_owners(batch.valid, list(batch.spans))[:, :-1]
    with pytest.raises(ValueError, match=r"neighbours' owner \(6, \d+\) does not match the batch's ids"):
        masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                              torch.Generator().manual_seed(0), attention=batch.attention(None),
                              neighbours=Neighbours(1.0, NeighbourHeads(32, 1), 0, owner))


def test_masked_affix_tokens_are_refused():
    batcher, model = _model()
    batch = batcher.batch(0)
    owner = span_owners(batch.valid, list(batch.spans))
    with pytest.raises(ValueError, match="neighbours trains clean affix tokens, as the cache holds them"):
        masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                              torch.Generator().manual_seed(0), context_mask_rate=0.2,
                              attention=batch.attention(None), neighbours=Neighbours(1.0, NeighbourHeads(32, 1), 0,
                                                                                     owner))


def test_a_one_pass_mask_is_refused():
    batcher, model = _model()
    batch = batcher.batch(0)
    full = batch.valid[:, None, :].expand(-1, batch.ids.shape[1], -1)
    owner = span_owners(batch.valid, list(batch.spans))
    with pytest.raises(ValueError, match="distill, neighbours and bridge read an attention family's isolated rows"):
        masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid, batcher.mask,
                              torch.Generator().manual_seed(0), attention=LayeredMask(full, full, 1),
                              neighbours=Neighbours(1.0, NeighbourHeads(32, 1), 0, owner))


def test_a_run_trains_with_the_term_records_it_and_ships_no_maps(tmp_path):
    config = TrainConfig(out=str(tmp_path / "m"), steps=30, batch_size=8, lr=3e-3, warmup=5, log_every=10,
                         model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64),
                         tasks=("grab",), min_sentences=2, max_sentences=3, bf16=False, eval_every=15,
                         eval_examples=6, affix_isolation=0.5, affix_neighbours=0.5, affix_neighbour_layer=0,
                         affix_neighbour_span=2)
    summary = train(config, progress=False)
    from acache.models.loader import load_model, read_config

    record = read_config(tmp_path / "m")[1].affix_training
    assert record == {"affix_isolation": 0.5, "steps": 30, "init_from": None, "layouts": list(config.layouts),
                      "affix_neighbours": 0.5, "affix_neighbour_layer": 0, "affix_neighbour_span": 2}
    losses = [r["loss"] for r in summary["log"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    plain = TrainConfig(out=str(tmp_path / "p"), steps=1, model=config.model, tasks=("grab",), bf16=False)
    train(plain, progress=False)
    shipped = dict(load_model(tmp_path / "m").named_parameters())
    assert shipped.keys() == dict(load_model(tmp_path / "p").named_parameters()).keys()
    assert not any("maps" in name for name in shipped)


def test_bad_neighbour_settings_are_refused_by_name():
    for weight in (-1.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="affix_neighbours is a loss weight >= 0"):
            TrainConfig(affix_isolation=0.5, affix_neighbours=weight)
    with pytest.raises(ValueError, match="affix_neighbours trains the isolated rows' affix states: it needs "
                                         "affix_isolation > 0"):
        TrainConfig(affix_neighbours=1.0)
    with pytest.raises(ValueError, match="and no anchored rows"):
        TrainConfig(affix_isolation=0.5, affix_anchored=0.5, affix_neighbours=1.0)
    for layer in (4, -1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="affix_neighbour_layer is the index of one of the model's 4 layers"):
            TrainConfig(affix_isolation=0.5, affix_neighbours=1.0, affix_neighbour_layer=layer)
    for span in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="affix_neighbour_span is a positive number of tokens"):
            TrainConfig(affix_isolation=0.5, affix_neighbours=1.0, affix_neighbour_span=span)
    # a setting of the wrong type is refused with the term off too; a layer the model lacks is not (it reads none)
    for bad in ({"affix_neighbour_layer": "1"}, {"affix_neighbour_span": "x"}):
        with pytest.raises(ValueError, match="affix_neighbour_(layer|span) is"):
            TrainConfig(**bad)
    assert TrainConfig(model=ModelShape(layers=1)).affix_neighbour_layer == 1
    with pytest.raises(ValueError, match="their affixes clean as the cache holds them, so context_mask_rate must be 0"):
        TrainConfig(affix_isolation=0.5, affix_neighbours=1.0, context_mask_rate=0.1)
    assert TrainConfig(affix_isolation=0.5, affix_neighbours=2, affix_neighbour_layer=3).affix_neighbour_layer == 3
