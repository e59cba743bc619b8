"""What an anchor selector sees: the request's all-mask canvas with its affix K/V placed, and the
forwards it may ask for (computed once, on demand, and shared between score terms)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from acache.decoding.canvas import Canvas
from acache.models.base import DiffusionLM, ForwardOutput
from acache.models.config import ModelConfig
from acache.models.kv import KVCache, LayerView, LayerwiseKV
from acache.models.layers import apply_rope
from acache.policies import SHALLOW_SHARE

#: bytes of attention-mass scores taken at once on CPU: about a core's L2 cache, where a block is scored faster
#: than the whole layer's [B, H, M, K] at once (3x at batch 16 on the SmolLM2-135M shape)
_CPU_SCORE_BYTES = 2 << 20


def request_seed(seed: int | None, token_ids: Sequence[int]) -> int:
    """A request's own seed: its sampling seed mixed with its token ids, the same in any batch."""
    data = ",".join(map(str, (seed if seed is not None else 0, *token_ids))).encode()
    return zlib.crc32(data)


def kv_deviation(keys: torch.Tensor, values: torch.Tensor, cached_keys: torch.Tensor,
                 cached_values: torch.Tensor) -> torch.Tensor:
    """``sum over heads of ||K - K_cached|| + ||V - V_cached||`` per token, for ``[..., H, D]`` tensors (float32):
    CacheBlend's measure of how stale a cached token is."""
    return ((keys.float() - cached_keys.float()).norm(dim=-1).sum(-1)
            + (values.float() - cached_values.float()).norm(dim=-1).sum(-1))


def shallow_layers(num_layers: int) -> int:
    """How many of a model's first layers the ``shallow`` probe runs: three tenths, at least one (1 of 4, 9 of
    30, 9 of 32), so its selection costs at most that share of the probe's forward once a model has four
    layers."""
    if num_layers < 1:
        raise ValueError(f"a model has at least one layer, not {num_layers}")
    return max(1, math.floor(SHALLOW_SHARE * num_layers + 1e-9))


def compact_index(mask: torch.Tensor, fill: int, width: int | None = None,
                  keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns where ``mask [B, T]`` holds, in order, per row: ``index [B, F]`` padded with ``fill``
    and ``valid [B, F]``; ``F`` is the largest count of any row, read from the device unless the caller passes it
    as ``width`` (having read several such counts at once: each read waits for the device). A caller compacting
    many masks of one shape passes ``keys`` (:func:`compact_keys`), made once instead of at every call."""
    b, t = mask.shape
    cols, past_end = keys if keys is not None else compact_keys(b, t, mask.device)
    keyed = torch.where(mask, cols, past_end)
    if width is None:
        width = int(mask.sum(-1).max()) if b else 0
    index = keyed.sort(-1).values[:, :width]
    valid = index < t
    return torch.where(valid, index, fill), valid


def compact_keys(b: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compact_index`'s sort keys for ``[B, T]`` masks: each column's index, and past the end for a column
    left out (so the kept ones sort first, in order)."""
    cols = torch.arange(t, device=device).expand(b, -1)
    return cols, cols + t


@dataclass
class CanvasKV:
    """Per-layer K/V of every canvas column plus one trash column (``T``) that padded writes land in."""

    keys: list[torch.Tensor]  # [B, T + 1, Hkv, D]
    values: list[torch.Tensor]
    positions: torch.Tensor  # [B, T + 1]
    valid: torch.Tensor  # [B, T + 1]

    @classmethod
    def empty(cls, model: DiffusionLM, canvas: Canvas) -> CanvasKV:
        b, t = canvas.tokens.shape
        cfg = model.config
        shape = (b, t + 1, cfg.num_kv_heads, cfg.head_dim)
        zeros = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.num_layers)]
        zeros_v = [torch.zeros_like(z) for z in zeros]
        pad = torch.zeros((b, 1), dtype=canvas.positions.dtype, device=canvas.positions.device)
        return cls(zeros, zeros_v, torch.cat((canvas.positions, pad), 1),
                   torch.cat((canvas.valid, pad.bool()), 1))

    def gather(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> KVCache:
        kv = KVCache(self.keys, self.values, self.positions, self.valid).gather(index)
        if valid is not None:
            kv.mask = kv.mask & valid
        return kv

    def gather_layer(self, index: torch.Tensor, valid: torch.Tensor, layer: int) -> KVCache:
        """Like :meth:`gather`, for a forward that runs ``layer`` alone: only that layer is gathered (every
        entry of the result is it; a forward reads the entry at its own layer index)."""
        expanded = index[:, :, None, None].expand(-1, -1, *self.keys[layer].shape[2:])
        keys = torch.gather(self.keys[layer], 1, expanded)
        values = torch.gather(self.values[layer], 1, expanded)
        n = len(self.keys)
        return KVCache([keys] * n, [values] * n, torch.gather(self.positions, 1, index),
                       torch.gather(self.valid, 1, index) & valid)

    def scatter(self, index: torch.Tensor, kv: KVCache, layers: range | None = None) -> None:
        """Writes ``kv`` (one entry per layer of ``layers``) into columns ``index [B, F]``."""
        layers = layers if layers is not None else range(len(self.keys))
        for j, layer in enumerate(layers):
            idx = index[:, :, None, None].expand_as(kv.keys[j])
            self.keys[layer].scatter_(1, idx, kv.keys[j].to(self.keys[layer].dtype))
            self.values[layer].scatter_(1, idx, kv.values[j].to(self.values[layer].dtype))

    def outside(self, start: int, end: int) -> KVCache:
        """Every real column but ``[start, end)``, for the steps inside a block."""
        t = self.positions.shape[1] - 1
        cols = torch.cat((torch.arange(0, start), torch.arange(end, t))).to(self.positions.device)
        return KVCache(self.keys, self.values, self.positions, self.valid).columns(cols)


@dataclass
class SelectionContext:
    model: DiffusionLM
    canvas: Canvas  # all-mask canvas of the batch; masks beyond a far window are invalid, read by no forward
    affix_slot: torch.Tensor  # [B, T]: which affix of its row a column belongs to, -1 outside affixes
    kv: CanvasKV  # cached affix K/V placed at the affix columns
    row_seeds: list[int] | None = None  # per request, for selectors that draw at random
    #: [B, T]: the columns every refresh recomputes before any anchor (``RequestState.base_recompute``), which
    #: the probe feeds; None: the non-affix columns
    own: torch.Tensor | None = None
    _probe: tuple[ForwardOutput, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _full: ForwardOutput | None = field(default=None, repr=False)
    _first_layers: ForwardOutput | None = field(default=None, repr=False)
    _affix_queries: list[torch.Tensor] | None = field(default=None, repr=False)
    _shallow: tuple[ForwardOutput, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _affix_columns: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _affix_rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _affix_keys: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def affix_mask(self) -> torch.Tensor:
        return self.affix_slot >= 0

    @property
    def gen_mask(self) -> torch.Tensor:
        """The masked generation region (every mask of the all-mask canvas)."""
        c = self.canvas
        mask = torch.zeros_like(c.valid)
        mask[:, c.gen_start:c.gen_start + c.gen_length] = True
        return mask

    @property
    def affix_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The affix columns of each row in order, ``[B, K]`` padded with the trash column ``T``, and their
        validity."""
        if self._affix_columns is None:
            self._affix_columns = compact_index(self.affix_mask, fill=self.canvas.total)
        return self._affix_columns

    def affix_keys(self, layer: int) -> torch.Tensor:
        """``[B, K, Hkv, D]``: layer ``layer``'s placed keys at :attr:`affix_columns`, rotated to their canvas
        positions once a selection: the probe attends to them and the attention mass scores them (the rotation
        the model applies at attend time, so the values are those it would compute)."""
        if layer not in self._affix_keys:
            cols, _ = self.affix_columns
            if self._affix_rope is None:
                self._affix_rope = self.model.rope(self.kv.positions.gather(1, cols))
            keys = self.kv.keys[layer]
            index = cols[:, :, None, None].expand(-1, -1, *keys.shape[2:])
            self._affix_keys[layer] = apply_rope(keys.gather(1, index), *self._affix_rope)
        return self._affix_keys[layer]

    def probe(self, with_kv: bool = False) -> tuple[ForwardOutput, torch.Tensor, torch.Tensor]:
        """The serving-path probe: the columns a refresh recomputes before anchors (the question and masks)
        against the stale shared affix K/V, as a direct-reuse refresh runs. Returns the forward (queries
        captured, and the fed columns' K/V ``with_kv``) and the fed column index and validity. After a
        :meth:`shallow_probe` it runs the remaining layers only (not when K/V are asked: it kept none)."""
        if self._probe is None or (with_kv and self._probe[0].kv is None):
            layers = self.model.config.num_layers
            if self._shallow is not None and not with_kv and len(self._shallow[0].queries) == layers:
                out, fed, fed_valid = self._shallow  # the shallow share was every layer (a 1-layer model), normed
            elif self._shallow is not None and not with_kv:
                early, fed, fed_valid = self._shallow
                out, _, _ = self._run_probe(range(len(early.queries), layers), False, early.hidden)
                out.queries = early.queries + out.queries
            else:
                out, fed, fed_valid = self._run_probe(range(layers), with_kv)
            self._probe = (out, fed, fed_valid)
        return self._probe

    def shallow_probe(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The probe through its first :func:`shallow_layers` only: those layers' queries (the whole probe's
        there, at that share of its cost) and the fed column index and validity."""
        k = shallow_layers(self.model.config.num_layers)
        if self._probe is not None:
            out, fed, fed_valid = self._probe
            return out.queries[:k], fed, fed_valid
        if self._shallow is None:
            self._shallow = self._run_probe(range(k), False)
        out, fed, fed_valid = self._shallow
        return out.queries, fed, fed_valid

    def _run_probe(self, layers: range, with_kv: bool, hidden: torch.Tensor | None = None,
                   ) -> tuple[ForwardOutput, torch.Tensor, torch.Tensor]:
        """The probe's ``layers`` from the embeddings, or from ``hidden``, the states entering the first of
        them; the final norm once they reach the last layer."""
        c, model = self.canvas, self.model
        t = c.total
        own = ~self.affix_mask if self.own is None else self.own
        fed, fed_valid = compact_index(c.valid & own, fill=t)
        cached, cached_valid = compact_index(self.affix_mask & ~own, fill=t)
        gather = fed.clamp_max(t - 1)
        x = model.embed(c.tokens.gather(1, gather)) if hidden is None else hidden
        if torch.equal(cached, self.affix_columns[0]):  # every affix column is cached: their keys rotated once
            index = cached[:, :, None, None].expand(-1, -1, *self.kv.keys[0].shape[2:])
            n = len(self.kv.keys)
            values = LayerView(lambda i: self.kv.values[i].gather(1, index), n)
            past = LayerwiseKV(LayerView(self.affix_keys, n), values, self.kv.positions.gather(1, cached),
                               self.kv.valid.gather(1, cached) & cached_valid, rotated=True)
        else:
            past = self.kv.gather(cached, cached_valid)
        out = model.run_layers(x, c.positions.gather(1, gather), fed_valid, past, layers, return_kv=with_kv,
                               capture_queries=True)
        if layers.stop == model.config.num_layers:
            out.hidden = model.norm(out.hidden)
        return out, fed, fed_valid

    def probe_logits(self, length: int) -> torch.Tensor:
        """fp32 ``[B, length, V]`` predictions of the first ``length`` generation columns from the probe:
        what a first denoising step on directly reused affix K/V proposes (``probe_step``)."""
        out, fed, fed_valid = self.probe()
        c = self.canvas
        cols = torch.arange(c.gen_start, c.gen_start + length, device=fed.device).expand(fed.shape[0], -1)
        # a row whose window ends before ``length`` fed fewer columns; what lies past its own block is dropped
        at = torch.searchsorted(fed.contiguous(), cols.contiguous()).clamp_max(fed.shape[1] - 1)
        return self.model.logits(out.hidden, at, fed_valid)

    def full(self) -> ForwardOutput:
        """A no-cache forward of the whole canvas, affix tokens included (queries and K/V captured)."""
        if self._full is None:
            c = self.canvas
            self._full = self.model(c.tokens, c.positions, c.valid, return_kv=True, capture_queries=True)
        return self._full

    def affix_queries(self) -> list[torch.Tensor]:
        """Per layer, ``[B, T, H, D]`` pre-RoPE queries of every affix column as its affix computed them alone
        (zero elsewhere): each affix runs by itself at positions ``0..n-1``, as its cache was made, so these
        are the queries behind the cached K/V (question-free, the same for every request that shares it)."""
        if self._affix_queries is None:
            c, model = self.canvas, self.model
            t, b = c.total, c.tokens.shape[0]
            queries: list[torch.Tensor] = []
            for slot in range(int(self.affix_slot.max()) + 1 if self.affix_slot.numel() else 0):
                cols, valid = compact_index(self.affix_slot == slot, fill=t)
                at = cols.clamp_max(t - 1)
                positions = torch.arange(cols.shape[1], device=cols.device).expand_as(cols)
                out = model(c.tokens.gather(1, at), positions, valid, capture_queries=True)
                for layer, q in enumerate(out.queries):
                    if len(queries) <= layer:
                        queries.append(q.new_zeros((b, t + 1, *q.shape[2:]), dtype=torch.float32))
                    queries[layer].scatter_(1, cols[:, :, None, None].expand_as(q), q.float())
            self._affix_queries = [q[:, :t] for q in queries]
        return self._affix_queries

    def first_layers(self) -> ForwardOutput:
        """Layers 0 and 1 of the whole canvas in full context (K/V captured): the first layer whose K/V go
        stale is layer 1, since layer 0's depend on each token alone."""
        if self._first_layers is None:
            c, model = self.canvas, self.model
            self._first_layers = model.run_layers(model.embed(c.tokens), c.positions, c.valid, None,
                                                  range(0, min(2, model.config.num_layers)), return_kv=True)
        return self._first_layers

    def first_stale_deviation(self) -> torch.Tensor:
        """``[B, T]``: each column's ``sum over heads of ||K - K_cached|| + ||V - V_cached||`` at layer 1, its K/V
        in full context against the cached affix K/V placed there (read only at affix columns)."""
        t = self.canvas.total
        if self.model.config.num_layers < 2:
            return torch.zeros(self.canvas.tokens.shape, dtype=torch.float32, device=self.canvas.tokens.device)
        kv = self._full.kv if self._full is not None else self.first_layers().kv  # a full forward holds layer 1
        return self.model.reduce_heads(kv_deviation(kv.keys[1], kv.values[1], self.kv.keys[1][:, :t],
                                                    self.kv.values[1][:, :t]))

    def stale_deviation(self, candidates: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: the layer-1 deviation of the ``candidates`` columns alone (zero elsewhere), equal to
        :meth:`first_stale_deviation` there at a fraction of its cost. Layer 0's K/V are context-free, so the
        candidates and the non-affix columns run layers 0 and 1 against the other affix tokens' cached K/V
        and get their exact layer-0 outputs; a token's layer-1 K/V depend on nothing else."""
        c, model = self.canvas, self.model
        t = c.total
        if model.config.num_layers < 2:
            return torch.zeros(c.tokens.shape, dtype=torch.float32, device=c.tokens.device)
        if self._full is not None or self._first_layers is not None:  # already known for every column
            return self.first_stale_deviation() * candidates
        affix = self.affix_mask & c.valid
        fed, fed_valid = compact_index(c.valid & (~affix | candidates), fill=t)
        cached, cached_valid = compact_index(affix & ~candidates, fill=t)
        at = fed.clamp_max(t - 1)
        out = model.run_layers(model.embed(c.tokens.gather(1, at)), c.positions.gather(1, at), fed_valid,
                               self.kv.gather(cached, cached_valid), range(0, 2), return_kv=True)
        index = at[..., None, None].expand_as(out.kv.keys[1])
        fresh = model.reduce_heads(kv_deviation(out.kv.keys[1], out.kv.values[1], self.kv.keys[1].gather(1, index),
                                                self.kv.values[1].gather(1, index)))
        dev = torch.zeros(c.tokens.shape[0], t + 1, dtype=torch.float32, device=c.tokens.device)
        return dev.scatter_(1, fed, fresh)[:, :t] * candidates

    def attention_mass(self, queries: list[torch.Tensor], q_cols: torch.Tensor,
                       q_valid: torch.Tensor) -> torch.Tensor:
        """``I(j) = sum_{l,h,i} softmax_{j in affix}(q_{l,h,i} . k_{l,h,j} / sqrt(d))`` for every column.

        ``queries[l]`` are pre-RoPE ``[B, M, H, D]`` of the canvas columns ``q_cols [B, M]``; only those
        with ``q_valid`` count, rotated at their absolute positions. Keys are the cached affix keys rotated
        at the affix's absolute positions. The softmax runs over each affix's own columns (anchors are
        chosen per affix). Returns ``[B, T]`` (zero outside affixes).
        """
        c, cfg = self.canvas, self.model.config
        t = c.total
        scores = torch.zeros(c.tokens.shape, dtype=torch.float32, device=c.tokens.device)
        if not bool(self.affix_mask.any()):
            return scores
        pick, pick_valid = compact_index(q_valid, fill=q_valid.shape[1])  # the queries that count
        pick = pick.clamp_max(q_valid.shape[1] - 1)
        if pick.shape[1] == 0:  # no query counts in any row (a question-attention score of prompts with no question)
            return scores
        cols = q_cols.gather(1, pick)
        keys_at, keys_valid = self.affix_columns
        keys_at = keys_at.clamp_max(t - 1)
        slot = torch.where(keys_valid, self.affix_slot.gather(1, keys_at), -1)
        q_positions = self.kv.positions.gather(1, cols)
        mass = AffixMass(cfg, pick_valid, slot, visible_keys(cfg, q_positions, self.kv.positions.gather(1, keys_at)))
        q_rope = self.model.rope(q_positions)
        q_index = pick[:, :, None, None].expand(-1, -1, cfg.num_heads, cfg.head_dim)
        for layer, q in enumerate(queries):
            scores.scatter_add_(1, keys_at, mass(apply_rope(q.gather(1, q_index), *q_rope), self.affix_keys(layer))
                                * keys_valid)
        return self.model.reduce_heads(scores)


def visible_keys(config: ModelConfig, query_positions: torch.Tensor, key_positions: torch.Tensor
                 ) -> torch.Tensor | None:
    """``[B, M, K]``: the keys each query attends to where attention is block-causal (a key's block, ``position //
    block_size``, not after the query's, as the model's mask has it); None where every query sees every key."""
    block = getattr(config, "block_size", None)
    if block is None:
        return None
    return (key_positions // block)[:, None, :] <= (query_positions // block)[:, :, None]


class AffixMass:
    """One layer's attention mass on each affix key: ``sum over heads h and counted queries i of
    softmax_{j in its affix}(q_{h,i} . k_{h,j} / sqrt(d))``, for fixed query weights and key slots (the shape
    work is decided once, then each layer is one batched matmul).

    The query heads that share a key head are stacked as rows against it (``[B * Hkv, rep * M, D]`` against
    ``[B * Hkv, D, K]``): no key copied per query head; each row's weight is whether its query counts, and the
    rows' weighted sum is the mass over heads and queries. The steps that change nothing are left out: the mask
    when every key is the affix's, the NaN guard when every row has a member. On CPU the score blocks are taken
    a few at a time, so each is scored while in cache. The sum covers this process's heads (tensor parallel:
    the caller completes it with ``reduce_heads``). Under block-causal attention (``visible``) each query's softmax
    runs over the keys of the affix it attends to, and a query that sees none of an affix adds nothing to it.
    """

    def __init__(self, config: ModelConfig, weight: torch.Tensor, slot: torch.Tensor,
                 visible: torch.Tensor | None = None) -> None:
        """``weight [B, M]``: which queries count; ``slot [B, K]``: each key's affix in its row, -1 for padding;
        ``visible [B, M, K]``: the keys each query attends to (:func:`visible_keys`; None: all)."""
        b, m = weight.shape
        keys = slot.shape[1]
        self.kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.rep = config.num_heads // self.kv_heads
        n = b * self.kv_heads
        self.shape = (b, m, keys)
        self.weight = weight[:, None, None, :].expand(b, self.kv_heads, self.rep, m).reshape(n, 1, self.rep * m).float()
        self.members = []
        self.visible = visible  # expanded over the heads a chunk at a time, never whole
        for affix in range(int(slot.max()) + 1 if slot.numel() else 0):
            member = (slot == affix)[:, None, :]
            rows = member.expand(b, self.kv_heads, keys).reshape(n, 1, keys)
            # with visibility a query may see none of an affix: its row is zeroed after the softmax
            seen_all = visible is None
            self.members.append((rows, seen_all and bool(member.all()), seen_all and bool(member.any(-1).all())))
        self.chunk = n if slot.device.type != "cpu" else max(1, _CPU_SCORE_BYTES // (4 * self.rep * m * max(keys, 1)))

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[B, K]`` mass from rotated ``queries [B, M, H, D]`` on rotated ``keys [B, K, Hkv, D]``."""
        b, m, k = self.shape
        d, rep, n = self.head_dim, self.rep, b * self.kv_heads
        contiguous = torch.contiguous_format
        qr = queries.view(b, m, self.kv_heads, rep, d).permute(0, 2, 3, 1, 4)
        qr = qr.to(torch.float32, memory_format=contiguous, copy=True).view(n, rep * m, d)
        kr = keys.permute(0, 2, 3, 1).to(torch.float32, memory_format=contiguous, copy=True).view(n, d, k)
        mass = torch.zeros(n, k, dtype=torch.float32, device=keys.device)
        for lo in range(0, n, self.chunk):
            hi = min(n, lo + self.chunk)
            logits = torch.matmul(qr[lo:hi], kr[lo:hi]).div_(math.sqrt(d))
            seen = None
            if self.visible is not None:  # rows lo..hi are (request, key head) pairs: each request's [M, K], per head
                rows = torch.arange(lo, hi, device=keys.device) // self.kv_heads
                seen = self.visible[rows][:, None].expand(-1, rep, m, k).reshape(hi - lo, rep * m, k)
            for member, every_key, every_row in self.members:
                mask = member[lo:hi] if seen is None else member[lo:hi] & seen
                probs = torch.softmax(logits if every_key else logits.masked_fill(~mask, float("-inf")), dim=-1)
                if not every_row:
                    probs = torch.nan_to_num(probs, nan=0.0)
                mass[lo:hi] += torch.matmul(self.weight[lo:hi], probs).squeeze(1)
        return mass.view(b, self.kv_heads, k).sum(1)
