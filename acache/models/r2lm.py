"""R2LM (a bifocal diffusion LM): causal attention for the left context, a right-to-left selective scan for
the right context inside the block being decoded.

Each layer adds to the residual stream causal self-attention (a token attends to itself and every position
before it, with RoPE and grouped K/V heads), then a small reverse state-space sidecar
(:class:`~acache.models.ssm.SSMMixer` without its forward scan: right to left inside each block of
``block_size`` positions, from a zero state), then a SwiGLU MLP. A token thus sees every earlier token
exactly and the rest of its own block compressed, never a later block: a finished block's K/V are final,
so the attention cache is exact, and the blocks are decoded in parallel steps (``engine/state_runner.py``).
Logits are not shifted. The family has no public upstream checkpoint; its layers use Qwen2's names for
attention, norms and MLP and Mamba-2's for the sidecar (``sidecar.in_proj``, ``A_log``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from acache.models.layers import RMSNorm, apply_rope, attend, rope_tables
from acache.models.ssm import OwnLayout, SSMMixer, check_sizes

#: a layer's cached K/V: keys (rotated: a key's position never changes) and values ``[B, S, Hkv, D]`` of
#: positions ``0..S-1``
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class R2LMConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    sidecar_heads: int
    sidecar_head_dim: int
    state_size: int
    block_size: int
    mask_token_id: int
    eos_token_id: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096  # the longest canvas the engine accepts
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the config.json it came from

    def __post_init__(self) -> None:
        check_sizes(self, "R2LM config", ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                          "intermediate_size", "sidecar_heads", "sidecar_head_dim", "state_size",
                                          "block_size", "max_position_embeddings"),
                    reals=("rope_theta", "rms_norm_eps"))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"R2LM config: hidden {self.hidden_size}, {self.num_heads} heads and "
                             f"{self.num_kv_heads} K/V heads do not divide")
        if self.head_dim % 2:
            raise ValueError(f"R2LM config: the head dimension {self.head_dim} is odd; rotary position embeddings "
                             "rotate pairs of dimensions")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def pad_token_id(self) -> int:
        return self.eos_token_id


class R2LMLayer(nn.Module):
    def __init__(self, config: R2LMConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = config.num_heads, config.num_kv_heads, d, \
            config.rope_theta
        self.attn_norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.sidecar_norm = RMSNorm(h, config.rms_norm_eps)
        self.sidecar = SSMMixer(h, config.sidecar_heads, config.sidecar_head_dim, config.state_size,
                                config.block_size, config.rms_norm_eps, forward_scan=False)
        self.mlp_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, start: int, past: LayerKV | None, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, LayerKV]:
        """``x [B, T, hidden]`` at positions ``start..start+T-1`` (``start`` a block boundary), after the
        cached ``past`` of positions ``0..start-1``; ``valid [B, T]`` marks real tokens of a right-padded
        batch (no past). Returns the new states and the K/V of all positions."""
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim)
        q_pos = torch.arange(start, start + t, device=x.device)[None]
        rope = rope_tables(q_pos, self.head_dim, self.theta)  # the fed tokens' keys sit at their queries' places
        k = apply_rope(k, *rope)
        keys = k if past is None else torch.cat((past[0], k), dim=1)
        values = v if past is None else torch.cat((past[1], v), dim=1)
        k_pos = torch.arange(0, keys.shape[1], device=x.device)[None]
        causal = (k_pos[:, None, :] <= q_pos[:, :, None]).expand(b, -1, -1)
        if valid is not None:  # padding is never attended (a padded query still sees the first token)
            causal = causal & (valid[:, None, :] | (k_pos == 0)[:, None, :])
        out = attend(apply_rope(q, *rope), keys, values, causal)
        x = x + self.o_proj(out.reshape(b, t, -1))
        x = x + self.sidecar(self.sidecar_norm(x), None, valid)[0]
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), (keys, values)


class R2LM(OwnLayout, nn.Module):
    """The bifocal model; its cache is the attention K/V of the finished blocks (exact)."""

    family = "r2lm"
    model_types = ("acache_r2lm",)
    architectures = ("R2LM",)
    config_class = R2LMConfig

    @classmethod
    def random_config(cls, vocab_size: int, mask_token_id: int, eos_token_id: int, layers: int, hidden_size: int,
                      heads: int, intermediate_size: int | None, block_size: int | None,
                      rope_theta: float | None = None, state_size: int | None = None, kv_heads: int | None = None,
                      max_seq_len: int | None = None) -> R2LMConfig:
        """A config at a width: a sidecar of 2 heads of 16 channels, state 16 unless given; RoPE at LLaDA's base
        unless given, so a LLaDA parent's attention carries over; as many K/V heads as query heads unless given."""
        return R2LMConfig(vocab_size, hidden_size, layers, heads, kv_heads or heads,
                          intermediate_size or 4 * hidden_size, 2, 16, state_size or 16, block_size or 32,
                          mask_token_id, eos_token_id, rope_theta or 500000.0,
                          max_position_embeddings=4096 if max_seq_len is None else max_seq_len)

    def __init__(self, config: R2LMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(R2LMLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def empty_cache(self) -> list[LayerKV] | None:
        return None

    @staticmethod
    def cache_bytes(cache: list[LayerKV] | None) -> int:
        return sum(t.numel() * t.element_size() for kv in cache or () for t in kv)

    def cache_bytes_for(self, length: int) -> int:
        """The cache's size once a canvas of ``length`` tokens is decoded: the K/V of every position."""
        c = self.config
        return 2 * c.num_layers * length * c.num_kv_heads * c.head_dim * self.embed.weight.element_size()

    def step_bytes(self, length: int) -> int:
        """What a step on a canvas of ``length`` adds beside its cache, at the most: the K/V it extends a copy of,
        through the last column it feeds (rows run one after another: :attr:`rows_together` is False)."""
        return self.cache_bytes_for(length)

    def extend(self, tokens: torch.Tensor, start: int, cache: list[LayerKV] | None, logits: bool = True
               ) -> tuple[torch.Tensor | None, list[LayerKV]]:
        """Logits ``[T, V]`` of ``tokens [T]`` at positions ``start..`` (whole blocks after the cached ones;
        None without ``logits``, when only the cache is wanted), and the cache extended by them."""
        out, kv = self._run(tokens[None], start, cache, logits=logits)
        return None if out is None else out[0], kv

    def train_logits(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits of a right-padded training batch whose rows start at position 0."""
        return self._run(input_ids, 0, None, valid)[0]

    def _run(self, input_ids: torch.Tensor, start: int, cache: list[LayerKV] | None,
             valid: torch.Tensor | None = None, logits: bool = True) -> tuple[torch.Tensor | None, list[LayerKV]]:
        x = self.embed(input_ids)
        out = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, start, None if cache is None else cache[i], valid)
            out.append(kv)
        return (self.lm_head(self.norm(x)).float() if logits else None), out
