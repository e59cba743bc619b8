"""The transformer shared by every family: pre-norm blocks, RoPE, SwiGLU, bidirectional attention.

Families differ only in how their upstream config and tensors are named, whether q/k/v carry a bias,
whether logits are shifted (Dream, Fast-dLLM v2) and whether attention is block-causal (block diffusion:
``ModelConfig.block_size``). Those differences live in the family subclasses and the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from acache.models.config import ModelConfig
from acache.models.kv import KVCache
from acache.models.layers import (
    RMSNorm,
    apply_rope,
    attend,
    block_causal_mask,
    dense_mask,
    rope_frequencies,
    rope_tables,
)


@dataclass
class ForwardOutput:
    """What a forward hands back besides the final states; the lists hold one entry per layer run."""

    hidden: torch.Tensor  # [B, T, hidden]: after the final norm for ``forward``, raw for ``run_layers``
    kv: KVCache | None = None  # pre-RoPE K/V of the fed tokens, with ``return_kv``
    queries: list[torch.Tensor] | None = None  # pre-RoPE queries [B, T, H, D], with ``capture_queries``
    layer_inputs: list[torch.Tensor] | None = None  # each layer's input states, with ``capture_inputs``
    #: with ``capture_rotated``: each layer's rotated queries ``[B, T, H, D]`` and the rotated keys it attended
    #: ``[B, S, Hkv, D]`` (the past's, then the fed tokens'), the tensors its attention read (on a past with room
    #: for the fed keys, ``engine.step_keys``, the keys are that buffer, which a later step overwrites)
    rotated: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def _fuse(linears: tuple[nn.Linear, ...], attr: str) -> torch.Tensor:
    """One tensor holding the ``attr`` (weight or bias) of ``linears`` stacked by output row; each linear's own
    Parameter keeps its identity (optimizers, hooks) and now reads a view into it."""
    whole = torch.cat([getattr(lin, attr).detach() for lin in linears])
    start = 0
    for lin in linears:
        param = getattr(lin, attr)
        param.data = whole[start:start + param.shape[0]]
        start += param.shape[0]
    return whole


def _aliases(whole: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether ``parts`` are still the consecutive row blocks of ``whole`` (none converted or re-pointed)."""
    offset = whole.storage_offset()
    for p in parts:
        if (p.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() or p.storage_offset() != offset
                or p.dtype != whole.dtype):
            return False
        offset += p.numel()
    return True


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.attn_norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.tp = None  # a TensorParallel when this layer holds one rank's slice (o and down then sum over ranks)
        # with fuse_projections: [q; k; v] and [gate; up] in one tensor each, the separate weights views into them
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.gate_up: torch.Tensor | None = None
        self._fused_from: tuple[nn.Parameter, ...] | None = None  # the Parameters they were built from

    def _projection_params(self) -> tuple[nn.Parameter, ...]:
        linears = (self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj)
        return (*(m.weight for m in linears), *(m.bias for m in linears[:3] if m.bias is not None))

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Stores the q, k and v projections as one matrix, and the gate and up projections as another, so a
        forward without gradients runs two matmuls where it ran five: on a small model every matmul costs about
        the same whatever its size, and on a large one the wider matmul runs nearer the machine's peak. On CPU
        each output equals the separate projection's to the bit (tested: each column is its own dot product);
        a GPU library may pick another kernel for the wider shape, so there it agrees to rounding. The separate
        Parameters stay the same objects and read views into the fused tensors, so no memory is added and
        state dicts, checkpoint names, in-place loads and optimizers see what they saw before; a forward that
        records gradients runs the separate matmuls. Idempotent. A conversion (``.to``) re-fuses at once, a
        replaced Parameter (``load_state_dict(assign=True)``) at the next forward without gradients, and a copy
        (``copy.deepcopy``, pickling) starts unfused."""
        qkv, gate_up = (self.q_proj, self.k_proj, self.v_proj), (self.gate_proj, self.up_proj)
        if self.fused_current() and _aliases(self.gate_up, [m.weight for m in gate_up]) \
                and _aliases(self.qkv[0], [m.weight for m in qkv]) \
                and (self.qkv[1] is None or _aliases(self.qkv[1], [m.bias for m in qkv])):
            return
        with torch.inference_mode(False):  # the fused tensors must stay ordinary tensors under inference mode
            self.qkv = _fuse(qkv, "weight"), (_fuse(qkv, "bias") if self.q_proj.bias is not None else None)
            self.gate_up = _fuse(gate_up, "weight")
        self._fused_from = self._projection_params()

    @property
    def fused(self) -> bool:
        """Whether :meth:`fuse_projections` has run on this layer (and no copy or pickling has unfused it)."""
        return self._fused_from is not None

    def fused_current(self) -> bool:
        """Whether the layer is fused and every projection Parameter is still the one it was fused from."""
        return self._fused_from is not None and all(
            a is b for a, b in zip(self._projection_params(), self._fused_from, strict=True))

    def _apply(self, fn, recurse: bool = True):
        # ``.to()``/``.half()`` give every weight its own converted storage: re-fuse them into one again
        out = super()._apply(fn, recurse)
        if self.fused:
            self.fuse_projections()
        return out

    def __getstate__(self) -> dict:
        # a copy's Parameters are fresh tensors, not views into the copied fused ones: the copy starts unfused
        return {**super().__getstate__(), "qkv": None, "gate_up": None, "_fused_from": None}

    def _projections(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None or torch.is_grad_enabled():
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        qkv = F.linear(h, *self.qkv)
        return qkv.split((self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features), dim=-1)

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or torch.is_grad_enabled():
            return F.silu(self.gate_proj(h)) * self.up_proj(h)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_k: tuple[torch.Tensor, torch.Tensor], past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, key_mask: torch.Tensor | None, past_rotated: bool = False,
                fill: bool = False, rotated: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the new states and the fed tokens' pre-RoPE q, k, v. With ``past_rotated`` the past keys
        are already rotated and ``rope_k`` covers the fed keys only (the same values, rotated once); with
        ``fill`` too, the past's last ``T`` columns are room for the fed keys, written there in place of a
        concatenation (the same key set, one copy fewer). ``rotated``, a list, gets the rotated queries and
        keys attention read (a score of that attention then rotates nothing again)."""
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = self._projections(h)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if past_k is None:
            keys, values = apply_rope(k, *rope_k), v
        elif fill:  # a rotated past with room for the fed keys
            past_k[:, -t:] = apply_rope(k, *rope_k)
            past_v[:, -t:] = v
            keys, values = past_k, past_v
        elif past_rotated:
            keys, values = torch.cat((past_k, apply_rope(k, *rope_k)), dim=1), torch.cat((past_v, v), dim=1)
        else:
            keys, values = apply_rope(torch.cat((past_k, k), dim=1), *rope_k), torch.cat((past_v, v), dim=1)
        q_rotated = apply_rope(q, *rope_q)
        if rotated is not None:
            rotated.append((q_rotated, keys))
        out = attend(q_rotated, keys, values, key_mask)
        attn = self.o_proj(out.reshape(b, t, -1))
        x = x + (attn if self.tp is None else self.tp.reduce(attn))
        h = self.mlp_norm(x)
        mlp = self.down_proj(self._gated(h))
        return x + (mlp if self.tp is None else self.tp.reduce(mlp)), q, k, v


class DiffusionLM(nn.Module):
    """A masked-diffusion LM whose forward runs any subset of positions against an explicit key set."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    architectures: ClassVar[tuple[str, ...]]
    #: Dream predicts token ``i`` from the hidden state at ``i - 1``.
    shifted_logits: ClassVar[bool] = False
    #: block diffusion: attention is block-causal (``ModelConfig.block_size``), so finished blocks' K/V are final
    block_causal: ClassVar[bool] = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.tp = None  # set by acache.models.tensor_parallel.shard_model
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # RoPE's frequencies, made once per device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope_tables` for ``positions [B, T]``, the frequencies made once per device rather than at every
        call (a layer-by-layer forward builds tables at every call)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = rope_frequencies(
                self.config.head_dim, self.config.rope_theta, positions.device)
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta, inv_freq)

    def rope_pair(self, positions: torch.Tensor, key_positions: torch.Tensor) -> tuple[tuple, tuple]:
        """The tables of queries at ``positions`` and of keys at ``key_positions``, which end with ``positions``
        (a past, then the fed tokens): the key tables built once, the queries' a view of their fed part."""
        keys = self.rope(key_positions)
        fed = key_positions.shape[1] - positions.shape[1]
        return tuple(t[:, fed:] for t in keys), keys

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over attention heads computed from this process's heads, completed over the tensor-parallel
        ranks (unchanged without tensor parallelism)."""
        return t if self.tp is None else self.tp.reduce(t)

    # -- upstream format, one implementation per family -------------------------------------------
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    @classmethod
    def config_to_hf(cls, config: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def hf_tensor_names(cls, config: ModelConfig) -> dict[str, str]:
        """Maps every upstream tensor name to this module's parameter name."""
        raise NotImplementedError

    # -- compute ----------------------------------------------------------------------------------
    def fuse_projections(self) -> None:
        """Fuses every decoder layer's q/k/v and gate/up projections (:meth:`DecoderLayer.fuse_projections`):
        the same outputs (to the bit on CPU), three matmuls fewer a layer in every forward that takes no gradient."""
        for layer in self.layers:
            layer.fuse_projections()

    def compile_layers(self) -> None:
        """Compiles every decoder layer's forward with ``torch.compile`` (dynamic shapes), once: the norms, the
        rotations and the gated MLP's element-wise work fuse into a few kernels, the matmuls and attention stay
        library calls. The layers share their graphs (a handful in all: with or without a past key set, rotated
        or not, masked or not), so compiling costs tens of seconds at the first forward of each kind, not per
        layer or per shape. Hooks on the layers still run, outside the compiled code."""
        if getattr(self, "_layers_compiled", False):
            return
        # every kind of forward is one graph shared by the layers; batch 1 and other 0/1-sized shapes add some
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        self._layers_compiled = True

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past: KVCache | None = None,
                return_kv: bool = False, capture_queries: bool = False) -> ForwardOutput:
        """Runs the fed tokens ``input_ids [B, T]`` at absolute ``positions [B, T]`` through all layers.

        Each fed token attends to every valid fed token and every valid slot of ``past`` (a block-causal
        model: those of its own block and earlier ones, by position). Padding (``attention_mask`` False) is
        never attended. A ``[B, T, T]`` ``attention_mask`` says per query which keys it sees (without ``past``):
        what affix-isolated training feeds (:mod:`acache_lab.train.isolation`). Returns final hidden states of
        the fed tokens and, with ``return_kv``, their pre-RoPE K/V so callers can cache them.
        """
        out = self.run_layers(self.embed(input_ids), positions, attention_mask, past,
                              range(len(self.layers)), return_kv, capture_queries)
        out.hidden = self.norm(out.hidden)
        return out

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None,
                   past: KVCache | None, layers: range, return_kv: bool = False,
                   capture_queries: bool = False, capture_inputs: bool = False,
                   capture_rotated: bool = False) -> ForwardOutput:
        """Runs states ``x [B, T, hidden]`` through ``layers`` only (no final norm).

        ``past`` holds every layer of the model and is read at the absolute layer index, so a caller
        can run the shallow layers on one token set and the deep layers on another (BiCache). With
        ``capture_rotated`` the output holds each layer's rotated queries and the rotated keys its attention read
        (:attr:`ForwardOutput.rotated`), for a score of that attention that would otherwise rotate them again.
        """
        if x.shape[:2] != positions.shape:
            raise ValueError(f"input_ids {tuple(x.shape[:2])} and positions {tuple(positions.shape)} "
                             "must have the same shape")
        if attention_mask is None:
            attention_mask = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        elif attention_mask.dtype != torch.bool:  # a Hugging Face style 0/1 mask
            attention_mask = attention_mask != 0
        if attention_mask.dim() == 3 and (past is not None or self.config.block_size is not None):
            raise ValueError("a per-query attention_mask [B, T, T] (affix-isolated training) takes no past and no "
                             "block-causal mask")
        key_positions = positions
        if past is not None:
            if past.num_layers != len(self.layers):
                raise ValueError(f"past KV has {past.num_layers} layers, the model {len(self.layers)}")
            key_mask = torch.cat((past.mask, attention_mask), dim=1)
            if not past.rotated or self.config.block_size is not None:
                key_positions = torch.cat((past.positions, positions), dim=1)
            if past.rotated:  # only the fed keys are rotated here
                rope_q = rope_k = self.rope(positions)
            else:
                rope_q, rope_k = self.rope_pair(positions, key_positions)
        else:
            rope_q = self.rope(positions)
            key_mask, rope_k = attention_mask, rope_q
        if self.config.block_size is not None:
            key_mask = block_causal_mask(key_mask, positions, key_positions, self.config.block_size)
        key_mask = dense_mask(key_mask)
        # a rotated past with room for exactly the fed tokens takes their keys in place (engine.step_keys)
        fill = past is not None and past.rotated and 0 < getattr(past, "room", 0) == positions.shape[1]
        if not torch.is_grad_enabled():  # a fused layer whose Parameters were replaced since re-fuses them
            for i in layers:
                layer = self.layers[i]
                if layer.fused and not layer.fused_current():
                    layer.fuse_projections()
        keys, values, queries, inputs = [], [], [], []
        rotated = [] if capture_rotated else None
        for i in layers:
            if capture_inputs:
                inputs.append(x)
            past_k = past_v = None
            if past is not None:
                past_k, past_v = (past.full_keys[i], past.full_values[i]) if fill else (past.keys[i], past.values[i])
            x, q, k, v = self.layers[i](x, rope_q, rope_k, past_k, past_v, key_mask,
                                        past is not None and past.rotated, fill, rotated)
            if return_kv:
                keys.append(k)
                values.append(v)
            if capture_queries:
                queries.append(q)
        if capture_inputs:
            inputs.append(x)
        return ForwardOutput(
            hidden=x,
            kv=KVCache(keys, values, positions, attention_mask) if return_kv else None,
            queries=queries if capture_queries else None,
            layer_inputs=inputs if capture_inputs else None,
            rotated=rotated,
        )

    def logits(self, hidden: torch.Tensor, cols: slice | torch.Tensor | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 predictions for the fed columns ``cols`` of ``hidden``: all (None), a slice, a 1-D index
        shared by every row, or a per-row ``[B, K]`` index.

        For a shifted family the prediction of fed column ``c`` comes from fed column ``c - 1``; a column
        with no real token before it (column 0, or padding before it per ``valid [B, T]``) uses its own
        state, as upstream does, so callers must not rely on it in a partial forward.
        """
        b, t = hidden.shape[:2]
        if isinstance(cols, torch.Tensor) and cols.dim() == 2:
            index = cols
        else:
            index = torch.arange(t, device=hidden.device)
            if cols is not None:
                index = index[cols]
            index = index.expand(b, -1)
        if self.shifted_logits:
            prev = (index - 1).clamp_min(0)
            ok = index > 0
            if valid is not None:
                ok = ok & valid.gather(1, prev)
            index = torch.where(ok, prev, index)
        return self.unembed(torch.gather(hidden, 1, index[..., None].expand(-1, -1, hidden.shape[-1])))

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 predictions of states ``[..., hidden]`` as they are, each from its own state (no column shift):
        the output embedding alone, which :meth:`logits` applies after choosing the columns."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
