"""Anchor selectors: ACache's score against a naive loop of DESIGN §4.3, baselines on hand-built inputs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from acache.affix.context import CanvasKV, SelectionContext, request_seed, shallow_layers
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import (
    SELECTORS,
    admission_anchors,
    anchor_count,
    drop_uncounted,
    make_selector,
    placed_anchor_counts,
    request_anchor_counts,
)
from acache.decoding.canvas import Layout, build_canvas
from acache.decoding.request_state import RequestState
from acache.models.base import ForwardOutput
from acache.models.config import ModelConfig
from acache.models.kv import KVCache
from acache.models.layers import rope_tables
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts, selection_context
from tests.conftest import DEVICE


def _rot(vec, pos, theta):
    d = len(vec)
    out = list(vec)
    for i in range(d // 2):
        a = pos * theta ** (-2 * i / d)
        c, s = math.cos(a), math.sin(a)
        out[i] = vec[i] * c - vec[i + d // 2] * s
        out[i + d // 2] = vec[i + d // 2] * c + vec[i] * s
    return out


def naive_attention_scores(model, prompt, gen_length, query_source):
    """I(j) = sum_{l,h,i in masks} softmax_{j in affix}(q.k/sqrt(d)) with explicit loops; ``shallow``: over the
    first ``shallow_layers`` of the probe only. On a block-causal model each mask's softmax runs over the affix keys
    it attends to (a key's block not after its own), and a mask that sees none adds nothing."""
    cfg = model.config
    span = prompt.affixes[0]
    ids = list(prompt.token_ids[:prompt.gen_at]) + [cfg.mask_token_id] * gen_length + list(
        prompt.token_ids[prompt.gen_at:])
    t = len(ids)
    shift = gen_length if span.start >= prompt.gen_at else 0
    affix_cols = list(range(span.start + shift, span.end + shift))
    gen_cols = list(range(prompt.gen_at, prompt.gen_at + gen_length))
    alone = model(torch.tensor([prompt.affix_ids(span)]), torch.arange(span.length)[None], return_kv=True).kv
    x = torch.tensor([ids])
    if query_source in ("probe", "shallow"):
        fed = [c for c in range(t) if c not in affix_cols]
        past = KVCache(alone.keys, alone.values, torch.tensor([affix_cols]), torch.ones(1, len(affix_cols)).bool())
        out = model.run_layers(model.embed(x[:, fed]), torch.tensor([fed]), None, past, range(cfg.num_layers),
                               capture_inputs=True)
    else:
        fed = list(range(t))
        out = model.run_layers(model.embed(x), torch.arange(t)[None], None, None, range(cfg.num_layers),
                               capture_inputs=True)
    d, rep = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    scores = {j: 0.0 for j in affix_cols}
    depth = shallow_layers(cfg.num_layers) if query_source == "shallow" else cfg.num_layers
    for layer_i, layer in enumerate(model.layers[:depth]):
        q = layer.q_proj(layer.attn_norm(out.layer_inputs[layer_i]))[0].view(len(fed), cfg.num_heads, d)
        keys = alone.keys[layer_i][0]
        for h in range(cfg.num_heads):
            rotated_keys = [_rot(keys[n, h // rep].tolist(), affix_cols[n], cfg.rope_theta)
                            for n in range(span.length)]
            for i in gen_cols:
                seen = [n for n in range(span.length) if not cfg.block_size or
                        affix_cols[n] // cfg.block_size <= i // cfg.block_size]
                if not seen:
                    continue
                qi = _rot(q[fed.index(i), h].tolist(), i, cfg.rope_theta)
                logits = [sum(a * b for a, b in zip(qi, rotated_keys[n], strict=True)) / math.sqrt(d) for n in seen]
                top = max(logits)
                exps = [math.exp(v - top) for v in logits]
                for n, e in zip(seen, exps, strict=True):
                    scores[affix_cols[n]] += e / sum(exps)
    return scores


@pytest.mark.parametrize("query", ["probe", "full", "shallow"])
@pytest.mark.parametrize("position", ["prefix", "suffix"])
def test_attention_score_matches_naive_formula(family_model, query, position):
    model = family_model
    prompt = layouts(affix_len=10, question_len=4)[position]
    gen_length = 8
    with torch.inference_mode():
        ctx = selection_context(model, prompt, gen_length)
        got = make_selector("attention", query).scores(ctx)
    slot = ctx.affix_slot
    want = naive_attention_scores(model, prompt, gen_length, query)
    for col, value in want.items():
        assert got[0, col].item() == pytest.approx(value, rel=1e-4, abs=1e-4)
    assert got[0][slot[0] < 0].abs().max() == 0
    depth = shallow_layers(model.config.num_layers) if query == "shallow" else model.config.num_layers
    # softmax rows sum to one, each mask's that sees the affix (on a block-causal model no mask before a suffix one)
    block = model.config.block_size
    span = prompt.affixes[0]
    first = span.start + (gen_length if span.start >= prompt.gen_at else 0)
    seeing = sum(not block or first // block <= i // block for i in range(prompt.gen_at, prompt.gen_at + gen_length))
    total = depth * model.config.num_heads * seeing
    assert got.sum().item() == pytest.approx(total, rel=1e-4, abs=1e-6)
    assert (seeing == 0) == (block is not None and position == "suffix")


def _mass_every_step(ctx, queries, q_cols, q_valid):
    """The attention mass as DESIGN §4.3 writes it, in float64, one query head at a time against its key head
    copied out, with every mask, guard and weight applied whether it changes anything or not."""
    from acache.affix.context import compact_index
    from acache.models.layers import apply_rope

    c, cfg = ctx.canvas, ctx.model.config
    t, d, rep = c.total, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    scores = torch.zeros(c.tokens.shape, dtype=torch.float64)
    pick, pick_valid = compact_index(q_valid, fill=q_valid.shape[1])
    pick = pick.clamp_max(q_valid.shape[1] - 1)
    cols = q_cols.gather(1, pick)
    keys_at, keys_valid = compact_index(ctx.affix_mask, fill=t)
    keys_at = keys_at.clamp_max(t - 1)
    slot = torch.where(keys_valid, ctx.affix_slot.gather(1, keys_at), -1)
    q_rope = rope_tables(ctx.kv.positions.gather(1, cols), d, cfg.rope_theta)
    k_rope = rope_tables(c.positions.gather(1, keys_at), d, cfg.rope_theta)
    weight = pick_valid[:, None, :, None].double()
    for layer, q in enumerate(queries):
        q = q.gather(1, pick[:, :, None, None].expand(-1, -1, *q.shape[2:]))
        qr = apply_rope(q, *q_rope).double()
        k = ctx.kv.keys[layer].gather(1, keys_at[:, :, None, None].expand(-1, -1, *ctx.kv.keys[layer].shape[2:]))
        kr = apply_rope(k, *k_rope).double().repeat_interleave(rep, dim=2)
        logits = torch.einsum("bmhd,bthd->bhmt", qr, kr) / math.sqrt(d)
        for affix in range(int(ctx.affix_slot.max()) + 1):
            member = (slot == affix)[:, None, None, :]
            probs = torch.softmax(logits.masked_fill(~member, float("-inf")), dim=-1)
            mass = (torch.nan_to_num(probs, nan=0.0) * weight).sum(dim=(1, 2))
            scores.scatter_add_(1, keys_at, mass * keys_valid)
    return scores.float()


@pytest.mark.parametrize("layout", [["prefix"], ["infix", "two-affix", "suffix"]])
def test_attention_mass_leaves_out_only_steps_that_change_nothing(llada_model, layout):
    """One prompt, one affix, every query counted (each step left out), and a padded batch of different
    layouts with two affixes in one row (each step kept): the scores equal the every-step formula in float64
    (to float32's rounding: the score sums in another order, query heads stacked against their key head)."""
    prompts = [layouts(affix_len=9 + 3 * i, question_len=4 + i)[k] for i, k in enumerate(layout)]
    with torch.inference_mode():
        ctx = selection_context(llada_model, prompts, 8)
        cols = torch.arange(ctx.canvas.total).expand(len(prompts), -1)
        valid = ctx.gen_mask & ctx.canvas.valid
        if len(prompts) > 1:  # rows count different numbers of queries: the weight is kept
            valid[0, valid[0].nonzero()[:3, 0]] = False
        queries = ctx.full().queries
        want = _mass_every_step(ctx, queries, cols, valid)
        got = ctx.attention_mass(queries, cols, valid)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.sum() > 0


def test_attention_mass_scored_one_block_at_a_time_is_the_same(llada_model, monkeypatch):
    """On CPU the score blocks of a layer are taken a few at a time (so each stays in cache); one block at a time
    gives the same scores to the bit, on a padded batch with two affixes in a row and rows of unequal counts."""
    import acache.affix.context as context

    prompts = [layouts(affix_len=9 + 3 * i, question_len=4 + i)[k]
               for i, k in enumerate(["infix", "two-affix", "suffix"])]
    with torch.inference_mode():
        ctx = selection_context(llada_model, prompts, 8)
        cols = torch.arange(ctx.canvas.total).expand(len(prompts), -1)
        valid = ctx.gen_mask & ctx.canvas.valid
        valid[0, valid[0].nonzero()[:3, 0]] = False
        queries = ctx.full().queries
        whole = ctx.attention_mass(queries, cols, valid)
        monkeypatch.setattr(context, "_CPU_SCORE_BYTES", 1)
        blocks = ctx.attention_mass(queries, cols, valid)
    assert torch.equal(blocks, whole) and whole.sum() > 0


def test_attention_mass_with_no_query_that_counts_is_zero(llada_model):
    """A batch where no row has a query that counts (question attention over prompts with no question) scores
    every column zero, on CPU too, where the score's block size is taken from the query count."""
    prompts = [layouts(affix_len=9, question_len=4)[k] for k in ("prefix", "suffix")]
    with torch.inference_mode():
        ctx = selection_context(llada_model, prompts, 8)
        cols = torch.arange(ctx.canvas.total).expand(len(prompts), -1)
        none = torch.zeros_like(ctx.canvas.valid)
        got = ctx.attention_mass(ctx.full().queries, cols, none)
    assert got.shape == ctx.canvas.valid.shape and not bool(got.any())


@pytest.mark.parametrize("own_affix_column", [False, True])
def test_the_probe_attends_to_placed_keys_rotated_once(llada_model, own_affix_column):
    """The probe reads the placed affix keys rotated once a selection (``affix_keys``, which the attention mass
    reads too) instead of rotating them at every layer: its states and queries are those of the same forward on
    the pre-RoPE keys, to the bit, and each layer is rotated once however often it is read. When the probe feeds
    an affix column itself (one its request recomputes at every refresh), the keys it reads are another set and
    it takes them pre-RoPE, as before."""
    from acache.affix.context import compact_index

    prompts = [layouts(affix_len=9 + 3 * i, question_len=4 + i)[k] for i, k in enumerate(["infix", "two-affix"])]
    with torch.inference_mode():
        ctx = selection_context(llada_model, prompts, 8)
        ctx.own = ~ctx.affix_mask
        if own_affix_column:
            ctx.own[1, ctx.affix_mask[1].nonzero()[0, 0]] = True
        out, fed, fed_valid = ctx.probe()
        assert len(ctx._affix_keys) == (0 if own_affix_column else llada_model.config.num_layers)
        assert all(ctx.affix_keys(i) is ctx.affix_keys(i) for i in range(llada_model.config.num_layers))
        c, t = ctx.canvas, ctx.canvas.total
        cached, cached_valid = compact_index(ctx.affix_mask & ~ctx.own, fill=t)
        at = fed.clamp_max(t - 1)
        want = llada_model.run_layers(llada_model.embed(c.tokens.gather(1, at)), c.positions.gather(1, at),
                                      fed_valid, ctx.kv.gather(cached, cached_valid),
                                      range(llada_model.config.num_layers), capture_queries=True)
    assert torch.equal(out.hidden, llada_model.norm(want.hidden))
    assert all(torch.equal(a, b) for a, b in zip(out.queries, want.queries, strict=True))


@pytest.mark.parametrize("layers, shallow", [(1, 1), (2, 1), (3, 1), (4, 1), (10, 3), (30, 9), (32, 9), (80, 24)])
def test_shallow_probe_runs_three_tenths_of_the_layers(layers, shallow):
    assert shallow_layers(layers) == shallow


def test_shallow_layers_refuses_a_model_without_layers():
    with pytest.raises(ValueError, match="at least one layer, not 0"):
        shallow_layers(0)


def test_shallow_probe_is_the_probe_cut_short(family_model):
    """The shallow probe's queries equal the whole probe's first layers, whichever runs first; selecting with it
    runs those layers only, and a whole probe asked afterwards (a probe step) runs the rest, once each."""
    prompt = layouts(affix_len=12, question_len=4)["infix"]
    model, k = family_model, shallow_layers(family_model.config.num_layers)
    calls = []
    hooks = [layer.register_forward_hook(lambda *_, i=i: calls.append(i)) for i, layer in enumerate(model.layers)]
    try:
        with torch.inference_mode():
            whole = selection_context(model, prompt, 6)
            out, fed, _ = whole.probe()
            assert [q.data_ptr() for q in whole.shallow_probe()[0]] == [q.data_ptr() for q in out.queries[:k]]
            alone = selection_context(model, prompt, 6)
            calls.clear()
            make_selector("attention", "shallow").select(alone, 0.3)
            assert calls == list(range(k)) and alone._probe is None
            queries, fed2, fed_valid = alone.shallow_probe()
            assert len(queries) == k < len(out.queries)
            assert torch.equal(fed, fed2) and bool(fed_valid.all())
            for mine, theirs in zip(queries, out.queries[:k], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
            continued, _, _ = alone.probe()
            assert calls == list(range(model.config.num_layers))
            for mine, theirs in zip(continued.queries, out.queries, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(continued.hidden, out.hidden, rtol=1e-5, atol=1e-5)
    finally:
        for hook in hooks:
            hook.remove()


def test_a_probe_after_a_shallow_probe_of_every_layer_is_normed_once(tmp_path):
    """On a 1-layer model the shallow probe is the whole probe, its states normed; a probe asked afterwards (a
    probe step) normed them again, and its logits were another probe's."""
    from acache.models.checkpoint import make_random_checkpoint
    from acache.models.loader import load_model

    model = load_model(make_random_checkpoint("llada", tmp_path / "one", layers=1, hidden_size=64, heads=4,
                                              kv_heads=2, seed=1, std=0.15, max_seq_len=512))
    prompt = layouts()["infix"]
    with torch.inference_mode():
        after = selection_context(model, prompt, 8)
        after.shallow_probe()
        direct = selection_context(model, prompt, 8)
        torch.testing.assert_close(after.probe_logits(8), direct.probe_logits(8), rtol=1e-5, atol=1e-5)


# -- hand-built contexts: one layer, one head, d = 8, RoPE that barely turns dims 1..3 --------------------
def hand_context(prompt_ids=(1, 2, 3, 4, 5), affixes=((0, 3),), gen_length=2, heads=1, layers=1):
    cfg = ModelConfig(family="llada", vocab_size=16, hidden_size=8 * heads, num_layers=layers, num_heads=heads,
                      num_kv_heads=heads, intermediate_size=8, rope_theta=1e16, rms_norm_eps=1e-5,
                      max_position_embeddings=64, mask_token_id=15, eos_token_id=14, pad_token_id=14)
    model = SimpleNamespace(config=cfg, dtype=torch.float32, device=torch.device("cpu"), shifted_logits=False,
                            reduce_heads=lambda t: t,  # one process: the heads' sum is complete
                            rope=lambda positions: rope_tables(positions, cfg.head_dim, cfg.rope_theta))
    canvas = build_canvas([Layout(tuple(prompt_ids), len(prompt_ids))], gen_length, 15, 14, torch.device("cpu"))
    slot = torch.full(canvas.tokens.shape, -1)
    for a, (s, e) in enumerate(affixes):
        slot[0, s:e] = a
    return SelectionContext(model, canvas, slot, CanvasKV.empty(model, canvas), [0])


def unit(dim, scale=60.0, d=8):
    v = torch.zeros(d)
    v[dim] = scale
    return v


def test_attention_vs_query_attention_on_hand_built_queries():
    """Masks attend to affix column 0, the question to column 2: each selector follows its own queries."""
    ctx = hand_context()  # canvas: affix 0-2, question 3-4, masks 5-6
    for col, dim in ((0, 1), (1, 2), (2, 3)):
        ctx.kv.keys[0][0, col, 0] = unit(dim, 1.0)
    fed = torch.tensor([[3, 4, 5, 6]])
    q = torch.stack([unit(3), unit(3), unit(1), unit(1)])[None, :, None, :]  # [1, 4, 1, 8]
    ctx._probe = (ForwardOutput(hidden=torch.zeros(1, 4, 8), queries=[q]), fed, torch.ones(1, 4, dtype=torch.bool))
    acache = make_selector("attention").scores(ctx)[0]
    prophet = make_selector("query-attention").scores(ctx)[0]
    assert acache[0] == pytest.approx(2.0, abs=1e-3) and acache[2] == pytest.approx(0.0, abs=1e-3)
    assert prophet[2] == pytest.approx(2.0, abs=1e-3) and prophet[0] == pytest.approx(0.0, abs=1e-3)
    assert make_selector("attention").select(ctx, 0.3)[0].nonzero().flatten().tolist() == [0]
    assert make_selector("query-attention").select(ctx, 0.3)[0].nonzero().flatten().tolist() == [2]


def test_kv_deviation_definition():
    ctx = hand_context(layers=2)
    t = ctx.canvas.total
    full_k = [torch.zeros(1, t, 1, 8) for _ in range(2)]
    full_v = [torch.zeros(1, t, 1, 8) for _ in range(2)]
    full_k[0][0, 1, 0, :2] = torch.tensor([3.0, 4.0])  # ||dK|| = 5 at column 1, layer 0
    full_v[1][0, 2, 0, 0] = 2.0  # ||dV|| = 2 at column 2, layer 1
    full_k[1][0, 2, 0, 0] = 2.5  # + ||dK|| = 2.5 at column 2, layer 1
    ctx.kv.keys[0][0, 0, 0, 0] = 1.0  # cached differs from a zero full K by 1 at column 0
    ctx._full = ForwardOutput(hidden=torch.zeros(1, t, 8),
                              kv=KVCache(full_k, full_v, ctx.canvas.positions, ctx.canvas.valid))
    scores = make_selector("kv-deviation").scores(ctx)[0]
    assert scores[:3].tolist() == pytest.approx([1.0, 5.0, 4.5])
    assert make_selector("kv-deviation").select(ctx, 0.5)[0, :3].tolist() == [False, True, True]


def test_first_k_and_counts_per_affix():
    ctx = hand_context(prompt_ids=tuple(range(1, 11)), affixes=((0, 3), (4, 9)))
    anchors = make_selector("first-k").select(ctx, 0.4)[0]
    # ceil(0.4 * 3) = 2 of the first affix, ceil(0.4 * 5) = 2 of the second
    assert anchors.nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert anchor_count(0.3, 10) == 3 and anchor_count(0.2, 7) == 2 and anchor_count(1.0, 5) == 5
    assert anchor_count(0.0, 9) == 0


def test_an_exact_affix_takes_no_anchors_short_of_the_whole_affix():
    """placed_anchor_counts: anchor_count for each placed affix, zero for an exact one unless the whole of it is
    recomputed (`all`, ratio 1: the reference decoding); drop_uncounted clears what a selection of its own chose
    in the affixes counted zero and nothing else."""
    spans, exact = [(0, 10), (12, 17)], [True, False]
    assert placed_anchor_counts(0.2, "attention", spans, exact) == [0, 1]
    assert placed_anchor_counts(0.2, "attention", spans, [False, False]) == [2, 1]
    assert placed_anchor_counts(1.0, "attention", spans, exact) == [10, 5]
    assert placed_anchor_counts(0.0, "all", spans, exact) == [10, 5]
    assert placed_anchor_counts(0.9, "none", spans, exact) == [0, 0]
    # a ratio under 1 whose count rounds up to the whole affix still takes none there: the count rises with the
    # ratio, 0 below 1 (it read [10, 5] at 0.95, and 0 again at 0.85)
    assert [placed_anchor_counts(r, "attention", spans, exact)[0] for r in (0.85, 0.95, 0.999, 1.0)] == [0, 0, 0, 10]
    with pytest.raises(ValueError):
        placed_anchor_counts(0.2, "attention", spans, [True])
    chosen = torch.zeros(20, dtype=torch.bool)
    chosen[[1, 4, 13]] = True
    kept = drop_uncounted(chosen, spans, [0, 1])
    assert kept.nonzero().flatten().tolist() == [13] and chosen.sum() == 3  # the caller's mask is left alone
    assert torch.equal(drop_uncounted(chosen, spans, [2, 1]), chosen)


def test_random_none_all():
    ctx = hand_context(prompt_ids=tuple(range(1, 11)), affixes=((0, 3), (4, 9)))
    first = make_selector("random").select(ctx, 0.4)[0]
    assert first[:3].sum() == 2 and first[4:9].sum() == 2 and not first[ctx.affix_slot[0] < 0].any()
    assert torch.equal(make_selector("random").select(ctx, 0.4)[0], first)
    draws = set()
    for seed in range(6):
        ctx.row_seeds = [seed]
        draws.add(tuple(make_selector("random").select(ctx, 0.4)[0].tolist()))
    assert len(draws) > 1
    assert not make_selector("none").select(ctx, 0.9).any()
    assert torch.equal(make_selector("all").select(ctx, 0.0), ctx.affix_mask)


@pytest.mark.parametrize("name", ["random", "first-k", "all"])
def test_layout_only_selectors_choose_at_admission_what_a_canvas_chooses(name):
    """A selector that scores from the layout alone is chosen when the request is admitted (admission_anchors),
    with no canvas: the same anchors as select() on a padded canvas of requests of other lengths, layouts (prefix,
    infix, suffix, two affixes), ratios, seeds and far-mask windows, read row by row; on a block-causal model an
    exact affix at column 0 takes none, as select() then drop_uncounted leave it."""
    ids = list(range(1, 41))
    cases = [(AffixPrompt.from_spans(ids[:20], None, [(0, 12)]), dict(anchor_ratio=0.25, seed=1), None),
             (AffixPrompt.from_spans(ids[:30], 26, [(3, 17), (19, 26)]), dict(anchor_ratio=0.4, seed=2), None),
             (AffixPrompt.from_spans(ids[:24], 4, [(6, 24)]), dict(anchor_ratio=0.2, far_mask_window=1), None),
             (AffixPrompt.from_spans(ids[:15], None, [(2, 11)]), dict(anchor_ratio=0.5, seed=9), None),
             (AffixPrompt.from_spans(ids[5:27], None, [(0, 8), (10, 19)]), dict(anchor_ratio=0.5, seed=4), 4)]
    chosen, on_canvas, spans, states = canvas_and_admission(make_selector(name), cases)
    for row, (state, row_spans) in enumerate(zip(states, spans, strict=True)):
        assert torch.equal(chosen[row], on_canvas[row]), (name, row)
        counts = [int(chosen[row][c0:c1].sum()) for c0, c1 in row_spans]
        assert counts == request_anchor_counts(state, row_spans)
    # the prefix is exact; of the second affix (columns 10-18, blocks of 4), 10-11 and 16-18 share a block with the
    # request's own columns: recomputed anyway, never anchors, so at most 4 of them (ceil(0.5 * 9) = 5 capped)
    assert request_anchor_counts(states[4], spans[4]) == ([0, 4] if name != "all" else [8, 4])
    assert chosen[4][10:12].sum() + chosen[4][16:19].sum() == 0
    if name == "first-k":
        assert chosen[1].nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8, 19, 20, 21]  # ceil(0.4 * 14), ceil(0.4 * 7)
    if name == "random":  # each request's own draw: other token ids, other anchors
        prompt = AffixPrompt.from_spans([7] + list(cases[0][0].token_ids[1:]), None, [(0, 12)])
        other = admission_anchors(make_selector(name), states[0], spans[0],
                                  request_anchor_counts(states[0], spans[0]), prompt.token_ids)
        assert not torch.equal(other, chosen[0]) and int(other.sum()) == int(chosen[0].sum())


class TiedScores(SELECTORS["first-k"]):
    """Every column scored alike: which of the tied columns a selection keeps is the rule under test."""

    name = "tied"

    def row_scores(self, valid, seed):
        return torch.zeros(valid.shape)


def test_tied_scores_go_to_the_earlier_columns_on_a_canvas_and_at_admission():
    """topk leaves ties to the layout of its input, so a padded canvas row and a request's own columns could keep
    different tied columns; both keep the earliest (top_columns)."""
    ids = list(range(1, 41))
    cases = [(AffixPrompt.from_spans(ids[:30], 26, [(3, 17), (19, 26)]), dict(anchor_ratio=0.5), None),
             (AffixPrompt.from_spans(ids[:12], None, [(2, 9)]), dict(anchor_ratio=0.3), None)]
    chosen, on_canvas, _, _ = canvas_and_admission(TiedScores(), cases)
    assert [torch.equal(a, b) for a, b in zip(chosen, on_canvas, strict=True)] == [True, True]
    assert chosen[0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8, 9, 19, 20, 21, 22]
    assert chosen[1].nonzero().flatten().tolist() == [2, 3, 4]


def canvas_and_admission(selector, cases):
    """Each case's anchors chosen at admission and by select() on one padded canvas of them all (far masks out),
    the canvas rows cut to each request's columns; and each request's affix spans and state. ``cases``: (prompt,
    SamplingParams fields, block-causal block or None)."""
    cfg = hand_context().model.config
    states, spans, seeds = [], [], []
    for prompt, kw, block in cases:
        name = selector.name if selector.name in SELECTORS else "first-k"  # a test-only selector counts as first-k
        params = SamplingParams(gen_length=8, block_length=2, selector=name, **kw)
        state = RequestState(prompt.layout, params, cfg.mask_token_id, cfg.pad_token_id, False, torch.device("cpu"),
                             attention_block=block)
        states.append(state)
        spans.append([(state.canvas.column(0, a.start), state.canvas.column(0, a.start) + a.length)
                      for a in prompt.affixes])
        seeds.append(request_seed(params.seed, prompt.token_ids))
    counts = [request_anchor_counts(st, sp) for st, sp in zip(states, spans, strict=True)]
    chosen = [admission_anchors(selector, st, sp, c, prompt.token_ids)
              for st, sp, c, (prompt, _, _) in zip(states, spans, counts, cases, strict=True)]
    canvas = build_canvas([prompt.layout for prompt, _, _ in cases], 8, cfg.mask_token_id, cfg.pad_token_id,
                          torch.device("cpu"))
    slot = torch.full(canvas.tokens.shape, -1)
    own = torch.zeros_like(canvas.valid)  # as the engine's selection step builds it
    for row, (state, row_spans) in enumerate(zip(states, spans, strict=True)):
        pad = canvas.pad_left[row]
        canvas.valid[row, pad:pad + state.length] &= ~state.far_columns()
        shared = torch.zeros(state.length, dtype=torch.bool)
        for a, (c0, c1) in enumerate(row_spans):
            slot[row, pad + c0:pad + c1] = a
            shared[c0:c1] = True
        own[row, pad:pad + state.length] = state.base_recompute(shared)
    ctx = SelectionContext(hand_context().model, canvas, slot, None, seeds, own)
    picked = selector.select(ctx, [kw.get("anchor_ratio", 0.2) for _, kw, _ in cases])
    on_canvas = [drop_uncounted(picked[row, canvas.pad_left[row]:canvas.pad_left[row] + state.length],
                                spans[row], counts[row]) for row, state in enumerate(states)]
    return chosen, on_canvas, spans, states


def test_admission_leaves_to_a_forward_what_needs_one():
    """admission_anchors: no anchors where no affix takes any (whatever the selector), None (a forward chooses)
    for a selector that scores with one, and for a probe_step request of any selector (its probe decodes)."""
    cfg = hand_context().model.config
    prompt = AffixPrompt.from_spans(list(range(1, 21)), None, [(0, 12)])

    def admitted(selector, **kw):
        params = SamplingParams(gen_length=4, block_length=2, selector=selector, **kw)
        state = RequestState(prompt.layout, params, cfg.mask_token_id, cfg.pad_token_id, False, torch.device("cpu"))
        return admission_anchors(make_selector(selector), state, [(0, 12)],
                                 request_anchor_counts(state, [(0, 12)]), prompt.token_ids)

    for selector in ("attention", "kv-deviation", "random", "none"):
        none = admitted(selector, anchor_ratio=0.0)
        assert none is not None and none.shape == (24,) and not none.any()
    assert admitted("attention", anchor_ratio=0.2) is None and admitted("cacheblend", anchor_ratio=0.2) is None
    assert admitted("random", anchor_ratio=0.2, probe_step=True) is None
    assert int(admitted("random", anchor_ratio=0.2).sum()) == 3 and int(admitted("all").sum()) == 12


def test_selector_registry():
    assert {"attention", "kv-deviation", "query-attention", "first-k", "random", "none", "all"} <= set(SELECTORS)
    with pytest.raises(ValueError, match="unknown anchor selector 'best'"):
        make_selector("best")
    with pytest.raises(ValueError, match="query source"):
        make_selector("attention", query="oracle")


def test_attention_deviation_reads_what_is_both_read_and_stale():
    """Mask 5 reads affix column 0, mask 6 column 1; column 2 is the stalest but unread. With k = 1 the
    candidates are the 2 most attended (columns 0 and 1); the product of their attention mass (1, 1) and
    layer-1 deviation (1, 3) keeps column 1: attention alone ties 0 and 1, deviation alone would keep 2."""
    ctx = hand_context(layers=2)  # canvas: affix 0-2, question 3-4, masks 5-6
    for col, dim in ((0, 1), (1, 2), (2, 3)):
        ctx.kv.keys[0][0, col, 0] = unit(dim, 1.0)
    fed = torch.tensor([[3, 4, 5, 6]])
    q = torch.stack([unit(5), unit(5), unit(1), unit(2)])[None, :, None, :]
    ctx._probe = (ForwardOutput(hidden=torch.zeros(1, 4, 8), queries=[q]), fed, torch.ones(1, 4, dtype=torch.bool))
    t = ctx.canvas.total
    keys = [torch.zeros(1, t, 1, 8) for _ in range(2)]
    values = [torch.zeros(1, t, 1, 8) for _ in range(2)]
    keys[1][0, :3, 0, 0] = torch.tensor([1.0, 3.0, 6.0])
    values[1][0, 2, 0, 0] = 4.0  # column 2: ||dK|| + ||dV|| = 10
    ctx._first_layers = ForwardOutput(hidden=torch.zeros(1, t, 8),
                                      kv=KVCache(keys, values, ctx.canvas.positions, ctx.canvas.valid))
    assert ctx.first_stale_deviation()[0, :3].tolist() == pytest.approx([1.0, 3.0, 10.0])
    assert make_selector("attention-deviation").select(ctx, 0.3)[0].nonzero().flatten().tolist() == [1]
    # at k = 2 every column is a candidate, and the two largest products (3 and 1) win over the unread one
    assert make_selector("attention-deviation").select(ctx, 0.6)[0].nonzero().flatten().tolist() == [0, 1]


def test_candidate_deviation_equals_the_full_pass_there(family_model):
    """Layers 0-1 of the candidates and non-affix tokens alone give the candidates' exact layer-1 deviation."""
    prompts = list(layouts(affix_len=12, question_len=4).values())
    with torch.inference_mode():
        ctx = selection_context(family_model, prompts, 4)
        gen = torch.Generator().manual_seed(3)
        candidates = ctx.affix_mask & (torch.rand(ctx.affix_mask.shape, generator=gen) < 0.4)
        got = ctx.stale_deviation(candidates)
        dense = selection_context(family_model, prompts, 4).first_stale_deviation()
    assert candidates.any() and not got[~candidates].any()
    assert torch.allclose(got[candidates], dense[candidates], rtol=1e-4, atol=1e-4)


def naive_influence(model, prompt, gen_length):
    """DESIGN of ``influence`` with explicit loops over layers, affix tokens, heads and keys: the affixes' own
    queries from each affix run alone, the request's K/V from its own tokens run against the cached affixes."""
    cfg = model.config
    ids = list(prompt.token_ids[:prompt.gen_at]) + [cfg.mask_token_id] * gen_length + list(
        prompt.token_ids[prompt.gen_at:])
    t = len(ids)
    spans = [list(range(s.start + (gen_length if s.start >= prompt.gen_at else 0),
                        s.end + (gen_length if s.start >= prompt.gen_at else 0))) for s in prompt.affixes]
    slot_of = {c: a for a, cols in enumerate(spans) for c in cols}
    alone = [model(torch.tensor([prompt.affix_ids(s)]), torch.arange(s.length)[None], return_kv=True,
                   capture_queries=True) for s in prompt.affixes]
    affix_cols = [c for cols in spans for c in cols]
    fed = [c for c in range(t) if c not in slot_of]
    past = KVCache([torch.cat([a.kv.keys[layer] for a in alone], 1) for layer in range(cfg.num_layers)],
                   [torch.cat([a.kv.values[layer] for a in alone], 1) for layer in range(cfg.num_layers)],
                   torch.tensor([affix_cols]), torch.ones(1, len(affix_cols), dtype=torch.bool))
    own = model(torch.tensor([ids])[:, fed], torch.tensor([fed]), None, past=past, return_kv=True).kv
    d, rep = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads

    def kv_at(layer, col):
        if col in slot_of:
            a = slot_of[col]
            n = spans[a].index(col)
            return alone[a].kv.keys[layer][0, n], alone[a].kv.values[layer][0, n]
        return own.keys[layer][0, fed.index(col)], own.values[layer][0, fed.index(col)]

    def sees(j, i):
        return cfg.block_size is None or i // cfg.block_size <= j // cfg.block_size

    dev = {j: 0.0 for j in affix_cols}
    total = {j: 0.0 for j in affix_cols}
    for layer in range(cfg.num_layers):
        for j in affix_cols:
            total[j] += dev[j]
        new = {}
        for j in affix_cols:
            a = slot_of[j]
            q_all = alone[a].queries[layer][0, spans[a].index(j)]
            moved, spread = 0.0, 0.0
            for h in range(cfg.num_heads):
                qj = _rot(q_all[h].tolist(), j, cfg.rope_theta)
                keys = [i for i in range(t) if sees(j, i)]
                logit = {i: sum(x * y for x, y in zip(qj, _rot(kv_at(layer, i)[0][h // rep].tolist(), i,
                                                                 cfg.rope_theta), strict=True)) / math.sqrt(d)
                         for i in range(t)}
                ctx_w = torch.softmax(torch.tensor([logit[i] for i in keys], dtype=torch.float64), 0)
                # cached alone: its own affix at positions 0..n-1, so block-causal by its place in the affix
                same = [i for i in spans[a] if cfg.block_size is None
                        or spans[a].index(i) // cfg.block_size <= spans[a].index(j) // cfg.block_size]
                alone_w = torch.softmax(torch.tensor([logit[i] for i in same], dtype=torch.float64), 0)
                o_ctx = sum(w * kv_at(layer, i)[1][h // rep].double() for w, i in zip(ctx_w, keys, strict=True))
                o_alone = sum(w * kv_at(layer, i)[1][h // rep].double() for w, i in zip(alone_w, same, strict=True))
                moved += float((o_ctx - o_alone).norm())
                spread += sum(float(w) * dev[i] for w, i in zip(ctx_w, keys, strict=True) if i in slot_of)
            new[j] = dev[j] + moved + spread / cfg.num_heads
        dev = new
    return total


def test_influence_matches_naive_loop_batched(family_model):
    """Every layout in one batch, rows of different lengths and affix counts: each row's scores equal the
    naive loop's for that request alone."""
    prompts = list(layouts(affix_len=9, question_len=4).values())
    with torch.inference_mode():
        ctx = selection_context(family_model, prompts, 4)
        got = make_selector("influence").scores(ctx)
        want = [naive_influence(family_model, p, 4) for p in prompts]
    for row, scores in enumerate(want):
        pad = ctx.canvas.pad_left[row]
        for col, value in scores.items():
            assert got[row, pad + col].item() == pytest.approx(value, rel=1e-3, abs=1e-3), (row, col)
        assert got[row][ctx.affix_slot[row] < 0].abs().max() == 0
        assert max(scores.values()) > 0


def test_influence_definition_on_a_hand_built_case():
    """Three layers, one head. Affix column 0 reads the question's column 3 (value 5) at every layer; column 1
    reads column 0; column 2 reads itself. So column 0 moves by 5 at each layer (d = 5, then 10), column 1
    only through column 0 (0, then 5), column 2 never: scores d_1 + d_2 = 15, 5, 0."""
    ctx = hand_context(layers=3)  # canvas: affix 0-2, question 3-4, masks 5-6
    t = ctx.canvas.total
    fed = torch.tensor([[3, 4, 5, 6]])
    own_k, own_v = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)
    own_k[0, 0, 0] = unit(2, 1.0)
    own_v[0, 0, 0] = unit(0, 5.0)
    queries = torch.zeros(1, t, 1, 8)
    queries[0, :3, 0] = torch.stack([unit(2), unit(1), unit(3)])
    ctx._affix_queries = [queries] * 3
    for layer in range(3):
        ctx.kv.keys[layer][0, 0, 0] = unit(1, 1.0)
        ctx.kv.keys[layer][0, 2, 0] = unit(3, 1.0)
    ctx._probe = (ForwardOutput(hidden=torch.zeros(1, 4, 8), kv=KVCache([own_k] * 3, [own_v] * 3, fed,
                                                                         torch.ones(1, 4, dtype=torch.bool))),
                  fed, torch.ones(1, 4, dtype=torch.bool))
    scores = make_selector("influence").scores(ctx)[0]
    assert scores.tolist() == pytest.approx([15.0, 5.0, 0.0, 0, 0, 0, 0], abs=1e-3)
    assert make_selector("influence").select(ctx, 0.3)[0].nonzero().flatten().tolist() == [0]
    assert make_selector("influence").select(ctx, 0.6)[0].nonzero().flatten().tolist() == [0, 1]
    # an affix column every refresh recomputes anyway (Dream's column before the answer, a block-causal model's
    # mixed block) is not worth an anchor: it is never one, and the count stops at the other columns
    ctx.own = torch.tensor([[True, False, False, True, True, True, True]])
    assert make_selector("influence").select(ctx, 0.6)[0].nonzero().flatten().tolist() == [1, 2]
    assert make_selector("influence").select(ctx, 1.0)[0].nonzero().flatten().tolist() == [1, 2]


def _ranks_by_hand(slot_row, score_row, cand_row):
    """Each candidate's rank among its affix's candidates, by a sort of that affix alone (ties: earlier column)."""
    ranks = [-1] * len(slot_row)
    for s in set(slot_row) - {-1}:
        members = [c for c in range(len(slot_row)) if slot_row[c] == s and cand_row[c]]
        for rank, c in enumerate(sorted(members, key=lambda c: (-score_row[c], c))):
            ranks[c] = rank
    return ranks


@pytest.mark.parametrize("seed", range(4))
def test_per_affix_ranks_and_keeps_equal_a_sort_of_each_affix(seed):
    """Rows with zero, one, two and three affixes, scores with ties, candidates a random subset: the batched ranks
    equal each affix ranked alone (the earlier per-row loop overwrote a two-affix row's ranks with its last
    affix's), and keep_per_affix keeps each affix's top counts[r][s], fewer where it has fewer candidates."""
    from acache.affix.selectors.base import keep_per_affix, ranks_per_affix

    gen = torch.Generator().manual_seed(seed)
    t = 24
    slot = torch.full((4, t), -1)
    slot[1, 3:11] = 0
    slot[2, 0:5], slot[2, 9:20] = 0, 1
    slot[3, 2:6], slot[3, 8:14], slot[3, 16:23] = 0, 1, 2
    scores = torch.randint(0, 5, (4, t), generator=gen).float()  # few values: many ties
    cand = (torch.rand(4, t, generator=gen) < 0.7) & (slot >= 0)
    slot, scores, cand = slot.to(DEVICE), scores.to(DEVICE), cand.to(DEVICE)
    ranks = ranks_per_affix(slot, scores, cand, 3).cpu()
    slot, scores, cand = slot.cpu(), scores.cpu(), cand.cpu()
    for r in range(4):
        assert ranks[r].tolist() == _ranks_by_hand(slot[r].tolist(), scores[r].tolist(), cand[r].tolist())
    counts = [[], [3], [2, 20], [1, 0, 4]]
    kept = keep_per_affix(slot.to(DEVICE), scores.to(DEVICE), cand.to(DEVICE), counts).cpu()
    for r, row in enumerate(counts):
        for s, k in enumerate(row):
            members = cand[r] & (slot[r] == s)
            want = members & (ranks[r] < k)
            assert torch.equal(kept[r] & (slot[r] == s), want)
            assert int(want.sum()) == min(k, int(members.sum()))
        assert not (kept[r] & (slot[r] >= len(row))).any()
    assert torch.equal(keep_per_affix(slot, scores, cand, torch.tensor([[0, 0, 0], [3, 0, 0], [2, 20, 0],
                                                                         [1, 0, 4]])), kept)


def test_per_affix_ranks_never_take_a_column_of_no_affix_or_of_an_affix_past_the_counts():
    """A candidate column outside every affix (slot -1) or in an affix the counts do not cover is neither ranked
    nor kept, and reading it does not index past the counts."""
    from acache.affix.selectors.base import keep_per_affix, ranks_per_affix

    slot = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 2, 2]], device=DEVICE)
    scores = torch.tensor([[9.0, 8.0, 1.0, 3.0, 2.0, 7.0, 6.0, 5.0, 4.0]], device=DEVICE)
    cand = torch.ones_like(slot, dtype=torch.bool)
    assert ranks_per_affix(slot, scores, cand, 2).tolist() == [[-1, -1, 2, 0, 1, 0, 1, -1, -1]]
    kept = keep_per_affix(slot, scores, cand, [[2, 1]])
    assert kept.tolist() == [[False, False, False, True, True, True, False, False, False]]


def test_a_query_that_cannot_see_an_affix_adds_no_attention_mass(blockdiff_dir):
    """On a block-causal model the question's head, in a block before an infix affix, never attends to it: the mass
    is each query's softmax over the affix keys it attends to, so adding the head's queries changes nothing (they
    added a whole unit a head each, and moved query-attention's anchors)."""
    from acache.affix.context import AffixMass, visible_keys
    from acache.models.loader import load_model

    model = load_model(blockdiff_dir)
    gen = torch.Generator().manual_seed(4)
    head, affix, tail = (torch.randint(0, 200, (n,), generator=gen).tolist() for n in (8, 16, 8))
    prompt = AffixPrompt.from_spans(head + affix + tail, None, [(8, 24)])
    with torch.inference_mode():
        ctx = selection_context(model, prompt, 16)
        out, fed, fed_valid = ctx.probe()
        at = fed.clamp_max(ctx.canvas.total - 1)
        question = (~ctx.gen_mask & ~ctx.affix_mask).gather(1, at) & fed_valid
        every = ctx.attention_mass(out.queries, at, question)
        seeing = ctx.attention_mass(out.queries, at, question & (at >= 24))  # the tail's queries, after the affix
    torch.testing.assert_close(every, seeing, rtol=1e-5, atol=1e-6)
    assert seeing.sum() > 0
    # AffixMass itself: a query that sees no key of an affix adds nothing; one that sees part of it, a unit there
    cfg = SimpleNamespace(num_kv_heads=1, num_heads=1, head_dim=2, block_size=2)
    q, k = torch.randn(1, 2, 1, 2), torch.randn(1, 4, 1, 2)
    seen = visible_keys(cfg, torch.tensor([[1, 5]]), torch.tensor([[2, 3, 4, 5]]))
    assert seen.tolist() == [[[False] * 4, [True] * 4]]
    mass = AffixMass(cfg, torch.tensor([[True, True]]), torch.zeros(1, 4, dtype=torch.long), seen)(q, k)
    alone = AffixMass(cfg, torch.tensor([[False, True]]), torch.zeros(1, 4, dtype=torch.long))(q, k)
    torch.testing.assert_close(mass, alone)
    assert visible_keys(SimpleNamespace(block_size=None), torch.zeros(1, 1), torch.zeros(1, 1)) is None
