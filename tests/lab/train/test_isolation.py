"""Affix-isolated training forwards compute what direct reuse serves: logit for logit against the reference
path's direct reuse (the affixes' K/V computed alone, attended from every other token), for every layout and
two affixes a prompt, and token for token against ``reference_generate`` with ``selector="none"``; the anchored
rows against the refreshes they train, the two-pass one (anchors fixed) and the one-pass one (anchors chosen inside
the first refresh)."""

from __future__ import annotations

import pytest
import torch

import acache.reference
from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import anchor_count
from acache.affix.store import AffixStore
from acache.models.kv import KVCache
from acache.models.loader import load_model
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from acache_lab.train.isolation import (
    ONE_PASS_SPLIT,
    LayeredMask,
    isolation_mask,
    with_anchors,
    with_fresh_columns,
    with_one_pass_anchors,
)
from acache_lab.train.trainer import Row, collate_rows, training_logits
from tests.affix.helpers import layouts
from tests.conftest import tiny_checkpoint

GEN = 4


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, llada_dir, dream_dir):
    return load_model(llada_dir if request.param == "llada" else dream_dir)


def canvas(model, prompt):
    """The prompt with its generation region of masks in place, and its affix spans on that canvas."""
    ids = list(prompt.token_ids)
    tokens = ids[:prompt.gen_at] + [model.config.mask_token_id] * GEN + ids[prompt.gen_at:]
    spans = [(a.start + GEN * (a.start >= prompt.gen_at), a.end + GEN * (a.start >= prompt.gen_at))
             for a in prompt.affixes]
    return torch.tensor(tokens), spans


def direct_reuse_states(model, prompt, tokens, spans, anchors=()):
    """What direct reuse computes: every other column fed, each affix's K/V computed alone sitting in ``past``;
    with ``anchors`` (canvas columns), what a refresh with those anchors fixed computes: they are fed too, and
    their alone K/V left out of ``past``."""
    store = AffixStore(model)
    t = len(tokens)
    shared = torch.zeros(t, dtype=torch.bool)
    cfg = model.config
    keys = [torch.zeros(t, cfg.num_kv_heads, cfg.head_dim) for _ in model.layers]
    values = [torch.zeros(t, cfg.num_kv_heads, cfg.head_dim) for _ in model.layers]
    for (c0, c1), span in zip(spans, prompt.affixes, strict=True):
        entry, _ = store.acquire(prompt.affix_ids(span))
        shared[c0:c1] = True
        for layer in range(len(keys)):
            keys[layer][c0:c1], values[layer][c0:c1] = entry.keys[layer], entry.values[layer]
    pos = torch.arange(t)
    shared[list(anchors)] = False
    past = KVCache([k[shared][None] for k in keys], [v[shared][None] for v in values], pos[shared][None],
                   torch.ones(1, int(shared.sum()), dtype=torch.bool))
    fed = ~shared
    return model(tokens[fed][None], pos[fed][None], None, past=past).hidden[0], fed


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix"])
@torch.inference_mode()
def test_an_isolated_forward_is_direct_reuse_logit_for_logit(model, layout):
    """The final states of every column direct reuse feeds, and so the logits read from them (Dream reads a
    column's logits from the state before it, which an isolated forward also has: the affix's own)."""
    prompt = layouts(seed=3)[layout]
    tokens, spans = canvas(model, prompt)
    want, fed = direct_reuse_states(model, prompt, tokens, spans)
    mask = isolation_mask(torch.ones(1, len(tokens), dtype=torch.bool), [spans])
    got = model(tokens[None], torch.arange(len(tokens))[None], mask).hidden[0][fed]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(got[None]), model.logits(want[None]), rtol=1e-4, atol=1e-4)
    full = model(tokens[None], torch.arange(len(tokens))[None]).hidden[0][fed]
    assert (full - want).abs().max() > 1e-3  # the mask matters: full attention is not direct reuse


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix"])
def test_one_shot_decoding_under_the_mask_is_reference_direct_reuse(llada_dir, layout):
    """One forward, the first refresh, commits the whole answer (steps 1): the tokens are the isolated
    forward's argmax."""
    model = load_model(llada_dir)
    prompt = layouts(seed=5)[layout]
    params = SamplingParams(gen_length=GEN, block_length=GEN, steps=1, cache="dual", selector="none",
                            remasking="low_confidence")
    ref = reference_generate(model, prompt, params, stop_token_ids=())
    tokens, spans = canvas(model, prompt)
    mask = isolation_mask(torch.ones(1, len(tokens), dtype=torch.bool), [spans])
    with torch.inference_mode():
        logits = model.logits(model(tokens[None], torch.arange(len(tokens))[None], mask).hidden)[0]
    answer = logits[prompt.gen_at:prompt.gen_at + GEN].argmax(-1).tolist()
    eos = model.config.eos_token_id
    assert ref.token_ids == (answer[:answer.index(eos)] if eos in answer else answer)


def test_the_mask_row_by_row():
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    mask = isolation_mask(valid, [[(0, 2), (3, 5)], []])
    assert mask.shape == (2, 6, 6)
    assert mask[0, 0].tolist() == [True, True, False, False, False, False]  # a span sees itself only
    assert mask[0, 3].tolist() == [False, False, False, True, True, False]
    assert mask[0, 2].all() and mask[0, 5].all()  # the other columns see everything
    assert mask[1].tolist() == [[True] * 4 + [False] * 2] * 6  # no spans: padding is still never attended


@pytest.mark.parametrize("spans, message", [([[(0, 2)]], "spans are given for 1 rows of a batch of 2"),
                                            ([[(3, 3)]], "empty or outside"), ([[(4, 9)]], "empty or outside"),
                                            ([[(0, 3), (2, 4)]], "overlaps another")])
def test_bad_spans_are_named(spans, message):
    valid = torch.ones(2 if "rows" in message else 1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        isolation_mask(valid, spans)


def test_a_per_query_mask_is_refused_with_a_past_or_block_causal_attention(blockdiff_dir, llada_dir):
    mask = torch.ones(1, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="per-query attention_mask"):
        load_model(blockdiff_dir)(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], mask)
    llada = load_model(llada_dir)
    past = llada(torch.tensor([[4, 5]]), torch.arange(2)[None], return_kv=True).kv
    with pytest.raises(ValueError, match="per-query attention_mask"):
        llada(torch.tensor([[1, 2, 3]]), torch.arange(2, 5)[None], mask, past=past)


def first_anchors(spans, ratio):
    """EPIC's anchors (``first-k``): the first ``anchor_count`` columns of each affix span."""
    return [c for c0, c1 in spans for c in range(c0, c0 + anchor_count(ratio, c1 - c0))]


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix"])
@torch.inference_mode()
def test_an_anchored_forward_is_the_refresh_with_those_anchors_logit_for_logit(model, layout):
    """The own columns' final states, and each anchor's at its copy, are those of a refresh that feeds the own
    columns and the anchors against the other affix tokens' alone-computed K/V."""
    prompt = layouts(seed=3)[layout]
    tokens, spans = canvas(model, prompt)
    anchors = first_anchors(spans, 0.3)
    want, fed = direct_reuse_states(model, prompt, tokens, spans, anchors)
    t = len(tokens)
    ids, positions, valid, mask = with_anchors(tokens[None], torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool),
                                               [spans], [anchors])
    assert ids.shape == (1, t + len(anchors)) and ids[0, t:].tolist() == tokens[anchors].tolist()
    assert positions[0, t:].tolist() == anchors and bool(valid.all())
    hidden = model(ids, positions, mask).hidden[0]
    order = fed.nonzero()[:, 0].tolist()  # the refresh's fed columns, in canvas order
    got = torch.stack([hidden[t + anchors.index(c)] if c in anchors else hidden[c] for c in order])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    isolated = model(tokens[None], torch.arange(t)[None], isolation_mask(valid[:, :t], [spans])).hidden[0]
    own = [i for i, c in enumerate(order) if c not in anchors]
    assert (isolated[[order[i] for i in own]] - want[own]).abs().max() > 1e-3  # the anchors change the answer's states


@pytest.mark.parametrize("layout", ["prefix", "suffix", "two-affix"])
def test_one_shot_decoding_of_an_anchored_row_is_reference_first_k(llada_dir, layout):
    """With ``first-k``'s anchors, one forward of the anchored row commits what ``reference_generate`` decodes
    with ``selector="first-k"`` in one step, token for token."""
    model = load_model(llada_dir)
    prompt = layouts(seed=5)[layout]
    params = SamplingParams(gen_length=GEN, block_length=GEN, steps=1, cache="dual", selector="first-k",
                            anchor_ratio=0.3, remasking="low_confidence")
    ref = reference_generate(model, prompt, params, stop_token_ids=())
    tokens, spans = canvas(model, prompt)
    anchors = first_anchors(spans, 0.3)
    assert sorted(ref.anchors) == anchors
    t = len(tokens)
    ext = with_anchors(tokens[None], torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool), [spans], [anchors])
    with torch.inference_mode():
        logits = model.logits(model(ext[0], ext[1], ext[3]).hidden)[0]
    answer = logits[prompt.gen_at:prompt.gen_at + GEN].argmax(-1).tolist()
    eos = model.config.eos_token_id
    assert ref.token_ids == (answer[:answer.index(eos)] if eos in answer else answer)


def test_the_anchored_mask_row_by_row():
    """Two rows of different lengths and anchor counts: the originals of the anchors are read by their own span
    only, the copies by the request's own columns and each other; padding is read by nothing."""
    valid = torch.tensor([[True] * 6, [True] * 5 + [False]])
    ids = torch.arange(12).view(2, 6)
    ext_ids, positions, ext_valid, mask = with_anchors(ids, torch.arange(6).expand(2, -1), valid,
                                                       [[(0, 3)], [(1, 4)]], [[2, 0], [3]])
    assert ext_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 2], [6, 7, 8, 9, 10, 11, 9, 0]]
    assert positions[:, 6:].tolist() == [[0, 2], [3, 0]] and ext_valid[:, 6:].tolist() == [[True, True], [True, False]]
    assert mask[0, 1].tolist() == [True, True, True] + [False] * 5  # an affix token: its span, anchors' alone K/V
    assert mask[0, 4].tolist() == [False, True, False, True, True, True, True, True]  # own: no anchor original
    assert mask[0, 6].tolist() == mask[0, 4].tolist()  # a copy reads what the own columns read
    assert mask[1, 0].tolist() == [True, True, True, False, True, False, True, False]
    assert not mask[:, :, 7][1].any() and not mask[1, :, 5].any()  # an unused copy slot, padding: never read
    assert mask.any(-1).all()  # every query attends something


@pytest.mark.parametrize("build", [with_anchors, with_one_pass_anchors])
@pytest.mark.parametrize("anchors, message", [([[0], [1]], "anchors are given for 2 rows of a batch of 1"),
                                              ([[4]], "distinct columns of its affix spans"),
                                              ([[1, 1]], "distinct columns")])
def test_bad_anchors_are_named(build, anchors, message):
    valid = torch.ones(1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        build(torch.zeros(1, 6, dtype=torch.long), torch.arange(6)[None], valid, [[(0, 3)]], anchors)


def test_a_one_pass_row_anchors_every_affix():
    """The engine reads an affix that takes no anchors from the cache at every layer, which a row that runs its
    first layers in context cannot train: such a row is refused, by name."""
    valid = torch.ones(1, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"affix spans \[\(4, 7\)\] take no anchor"):
        with_one_pass_anchors(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], valid,
                              [[(0, 3), (4, 7)]], [[1]])


@pytest.mark.parametrize("build", [with_anchors, with_one_pass_anchors])
def test_spans_for_another_batch_are_named(build):
    valid = torch.ones(2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="spans are given for 1 rows of a batch of 2"):
        build(torch.zeros(2, 6, dtype=torch.long), torch.arange(6).expand(2, -1), valid, [[(0, 3)]], [[1], []])


@pytest.fixture(scope="module", params=["llada", "dream"])
def deep_model(request, tmp_path_factory):
    """Four layers: a one-pass refresh runs layers 0-1 in context and the others as a refresh."""
    return load_model(tiny_checkpoint(tmp_path_factory.mktemp(f"deep-{request.param}"), request.param, layers=4))


def layered_states(model, ids, positions, mask):
    """The final states of a forward under a :class:`LayeredMask`, the two spans of layers run as
    ``training_logits`` runs them."""
    early = model.run_layers(model.embed(ids), positions, mask.early, None, range(mask.split))
    return model.norm(model.run_layers(early.hidden, positions, mask.late, None,
                                       range(mask.split, len(model.layers))).hidden)


def one_pass_reference(model, prompt, monkeypatch, steps=1):
    """``reference_generate`` with ``attention`` choosing its anchors inside the first refresh at a depth that
    filters once (after layer 1, the anchors alone from layer 2 on); returns its result, the anchors' canvas
    columns and that refresh's final states ``[T, hidden]``."""
    seen = {}
    select_refresh = acache.reference._select_refresh

    def spy(model, state, spans, keys, values):
        seen["hidden"] = select_refresh(model, state, spans, keys, values)[0]
        seen["anchors"] = state.anchors.nonzero()[:, 0].tolist()
        return seen["hidden"][None]

    monkeypatch.setattr(acache.reference, "_select_refresh", spy)
    params = SamplingParams(gen_length=GEN, block_length=GEN, steps=steps, cache="dual", selector="attention",
                            anchor_ratio=0.3, anchor_depth=0.3, remasking="low_confidence")
    assert params.resolved_anchor_pass == "one"
    ref = reference_generate(model, prompt, params, stop_token_ids=())
    return ref, seen["anchors"], seen["hidden"]


@pytest.mark.parametrize("layout", ["prefix", "infix", "suffix", "two-affix"])
def test_a_one_pass_anchored_forward_is_the_selecting_refresh_state_for_state(deep_model, layout, monkeypatch):
    """With the anchors the first refresh chose inside it, the training row's own columns and anchors end in
    that refresh's final states: layers 0-1 in context, then the anchors fresh against the rest's alone K/V."""
    model = deep_model
    prompt = layouts(seed=3)[layout]
    tokens, spans = canvas(model, prompt)
    _, anchors, want = one_pass_reference(model, prompt, monkeypatch)
    assert anchors and all(any(c0 <= c < c1 for c0, c1 in spans) for c in anchors)
    t = len(tokens)
    ids, positions, valid, mask = with_one_pass_anchors(tokens[None], torch.arange(t)[None],
                                                        torch.ones(1, t, dtype=torch.bool), [spans], [anchors])
    n = sum(c1 - c0 for c0, c1 in spans)
    assert ids.shape == (1, t + n) and positions[0, t:].tolist() == [c for c0, c1 in spans for c in range(c0, c1)]
    assert bool(valid.all()) and mask.split == ONE_PASS_SPLIT == 2
    with torch.inference_mode():
        hidden = layered_states(model, ids, positions, mask)[0]
        logits = training_logits(model, ids, positions, mask)[0]
        two_pass = with_anchors(tokens[None], torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool), [spans],
                                [anchors])
        refresh = model(two_pass[0], two_pass[1], two_pass[3]).hidden[0]
    fresh = torch.ones(t, dtype=torch.bool)
    for c0, c1 in spans:
        fresh[c0:c1] = False
    own = fresh.clone()
    fresh[anchors] = True
    torch.testing.assert_close(hidden[:t][fresh], want[fresh], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, model.logits(hidden[None])[0])
    # the layers in context matter: the same anchors fixed from the start (the two-pass refresh) end elsewhere
    assert (refresh[:t][own] - want[own]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["prefix", "suffix", "two-affix"])
def test_one_shot_decoding_of_a_one_pass_row_is_reference_one_pass(tmp_path, layout, monkeypatch):
    """One forward of the one-pass row, with the anchors the reference's first refresh chose, commits what
    ``reference_generate`` decodes in one step, token for token. LLaDA only: a shifted (Dream) model commits a
    block's first token alone on its first step, so there one step is not one forward (its states are checked
    above)."""
    model = load_model(tiny_checkpoint(tmp_path, "llada", layers=4))
    prompt = layouts(seed=5)[layout]
    ref, anchors, _ = one_pass_reference(model, prompt, monkeypatch)
    tokens, spans = canvas(model, prompt)
    t = len(tokens)
    ext = with_one_pass_anchors(tokens[None], torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool), [spans],
                                [anchors])
    with torch.inference_mode():
        answer = training_logits(model, ext[0], ext[1], ext[3])[0, prompt.gen_at:prompt.gen_at + GEN].argmax(-1)
    answer = answer.tolist()
    eos = model.config.eos_token_id
    assert ref.token_ids == (answer[:answer.index(eos)] if eos in answer else answer)


def test_the_one_pass_mask_row_by_row():
    """Four rows: one-pass anchored (two affixes), isolated with no anchors, neither (shorter, padded), and anchored
    again but shorter, with fewer copies than the widest row. An anchored row attends in context before the split
    and as a refresh after it; its copies compute each affix alone throughout; the other rows keep one mask;
    padding and unused copy slots are read by nothing."""
    valid = torch.tensor([[True] * 7, [True] * 7, [True] * 5 + [False] * 2, [True] * 5 + [False] * 2])
    ids = torch.arange(28).view(4, 7)
    ext_ids, positions, ext_valid, mask = with_one_pass_anchors(
        ids, torch.arange(7).expand(4, -1), valid, [[(0, 2), (4, 6)], [(1, 4)], [], [(1, 3)]], [[1, 4], [], [], [2]])
    assert isinstance(mask, LayeredMask) and mask.early.shape == mask.late.shape == (4, 11, 11)
    assert ext_ids[0, 7:].tolist() == [0, 1, 4, 5] and positions[0, 7:].tolist() == [0, 1, 4, 5]
    assert ext_ids[3, 7:9].tolist() == [22, 23] and ext_valid[3, 7:].tolist() == [True, True, False, False]
    assert not ext_valid[1:3, 7:].any() and ext_valid[0, 7:].all()
    every = [True] * 7 + [False] * 4
    assert mask.early[0, :7].tolist() == [every] * 7  # in context: the originals, no copies
    assert mask.early[0, 7].tolist() == [False] * 7 + [True, True, False, False]  # a copy: its affix's copies
    assert mask.early[0, 9].tolist() == [False] * 9 + [True, True]
    refresh = [False, True, True, True, True, False, True, True, False, False, True]  # own, anchors, copies not
    assert mask.late[0, :7].tolist() == [refresh] * 7
    assert torch.equal(mask.late[0, 7:], mask.early[0, 7:])
    isolated = isolation_mask(valid[1:2], [[(1, 4)]])[0]
    assert torch.equal(mask.early[1, :7, :7], isolated) and torch.equal(mask.late[1], mask.early[1])
    assert torch.equal(mask.early[2, :7, :7], valid[2].expand(7, -1)) and torch.equal(mask.late[2], mask.early[2])
    short = [True] * 5 + [False] * 6
    assert mask.early[3, :7].tolist() == [short] * 7
    assert mask.late[3, :7].tolist() == [[True, False, True, True, True, False, False, True, False, False, False]] * 7
    assert not mask.early[1:3, :7, 7:].any() and not mask.early[2:, :, 5:7].any()
    assert not mask.early[3, :, 9:].any() and not mask.late[3, :, 9:].any()  # the shorter row's unused copy slots
    assert mask.early.any(-1).all() and mask.late.any(-1).all()  # every query attends something


@pytest.mark.parametrize("layout", ["prefix", "two-affix"])
def test_a_mixed_one_pass_batch_is_each_row_alone(deep_model, layout):
    """A one-pass anchored row (padded: shorter than the others), an isolated row and a full-attention row batched
    give each row's states run alone, at every column it has."""
    prompts = [layouts(affix_len=12, seed=5)[layout]] + [layouts(seed=s)[layout] for s in (3, 4)]
    rows = [canvas(deep_model, p) for p in prompts]  # the anchored row first, and the shortest
    spans = [rows[0][1], rows[1][1], []]
    anchors = [first_anchors(rows[0][1], 0.3), [], []]
    width = max(len(tokens) for tokens, _ in rows)
    ids = torch.stack([torch.nn.functional.pad(tokens, (0, width - len(tokens))) for tokens, _ in rows])
    valid = torch.stack([torch.arange(width) < len(tokens) for tokens, _ in rows])
    batch = with_one_pass_anchors(ids, torch.arange(width).expand(3, -1), valid, spans, anchors)
    with torch.inference_mode():
        together = layered_states(deep_model, batch[0], batch[1], batch[3])
        for r, (tokens, _) in enumerate(rows):
            t = len(tokens)
            alone = with_one_pass_anchors(tokens[None], torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool),
                                          [spans[r]], [anchors[r]])
            want = layered_states(deep_model, alone[0], alone[1], alone[3])[0]
            torch.testing.assert_close(together[r, :t], want[:t], rtol=1e-4, atol=1e-4)
            copies = alone[0].shape[1] - t
            assert copies == (sum(c1 - c0 for c0, c1 in spans[r]) if anchors[r] else 0)
            torch.testing.assert_close(together[r, width:width + copies], want[t:], rtol=1e-4, atol=1e-4)


def affix_before_the_answer(seed: int) -> dict[str, AffixPrompt]:
    """Prompts whose (last) affix ends where the generation region begins."""
    g = torch.Generator().manual_seed(seed)
    aff, q, sys_aff = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 6, 8))
    return {"question-then-affix": AffixPrompt.from_spans(q + aff, None, [(6, 26)]),
            "two-affix": AffixPrompt.from_spans(sys_aff + q + aff, None, [(0, 8, "system"), (14, 34, "doc")]),
            "affix-only": AffixPrompt.from_spans(aff, None, [(0, 20)])}


@pytest.mark.parametrize("layout", ["question-then-affix", "two-affix", "affix-only"])
@torch.inference_mode()
def test_a_reused_training_row_is_direct_reuse_where_an_affix_ends_at_the_answer(model, layout):
    """A shifted family (Dream) predicts the answer's first token from the column before it, which the engine
    refreshes in context even under direct reuse: the training view recomputes it in place and keeps its alone
    K/V, which the rest of the affix read, in a copy. Its states equal the engine's direct reuse column for column;
    the plain isolated mask (that column computed alone) does not, on Dream."""
    prompt = affix_before_the_answer(seed=11)[layout]
    tokens, spans = canvas(model, prompt)
    shifted = model.shifted_logits
    before = prompt.gen_at - 1
    want, fed = direct_reuse_states(model, prompt, tokens, spans, anchors=[before] if shifted else [])
    batch = collate_rows([Row(tokens.tolist(), prompt.gen_at, GEN, tuple(spans))], model.config.pad_token_id)
    every = torch.ones(1, dtype=torch.bool)
    view, mask = batch.reused(every, shifted)
    assert view.ids.shape[1] == len(tokens) + shifted  # Dream: one copy, the alone K/V of the column before
    got = model(view.ids, view.positions, mask).hidden[0][:len(tokens)][fed]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    logits = model.logits(model(view.ids, view.positions, mask).hidden)[0]
    reference = model.logits(want[None])[0]  # fed columns in order: the answer's predictions read the same states
    answer = fed[:prompt.gen_at + GEN].sum() - GEN
    torch.testing.assert_close(logits[prompt.gen_at:prompt.gen_at + GEN], reference[answer:answer + GEN],
                               rtol=1e-4, atol=1e-4)
    plain = model(tokens[None], torch.arange(len(tokens))[None], batch.attention(every)).hidden[0][fed]
    assert ((plain - want).abs().max() > 1e-3) == shifted


def test_fresh_columns_must_lie_in_the_affixes():
    valid = torch.ones(1, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="distinct columns of its affix spans"):
        with_fresh_columns(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], valid, [[(2, 5)]], [[6]])
