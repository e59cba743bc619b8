"""Building blocks shared by every model family: RMSNorm, RoPE and attention over an explicit key set.

Keys are cached *before* RoPE, so attention rotates every key at the absolute position it is attended
at. That is what lets a cached span be placed at any offset (the affix cache) and lets the caller pass
any subset of query positions against any set of cached keys (dual cache, anchors, paged gathers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as both upstream families do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's ``head_dim / 2`` inverse frequencies, fp32, computed on ``device``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape ``[B, T, 1, head_dim]`` in fp32 for absolute ``positions`` ``[B, T]``; a caller that
    builds tables often passes :func:`rope_frequencies` made once on the positions' device (the same values)."""
    if inv_freq is None:
        inv_freq = rope_frequencies(head_dim, theta, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE on ``[B, T, H, D]``, in fp32, returned in the input dtype.

    ``x * cos + rotate_half(x) * sin`` written as two half-width updates of ``x * cos`` (``x1 cos - x2 sin``,
    ``x2 cos + x1 sin``): the same values bit for bit, without the rotated copy, so a quarter less memory
    traffic. It matters where keys are rotated at every step (a GPU's in-block steps rotate the whole cached
    past at each layer)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    out = x32 * cos
    out[..., :half].sub_(x32[..., half:] * sin[..., :half])  # in place on the view: no copy back through setitem
    out[..., half:].add_(x32[..., :half] * sin[..., half:])
    return out.to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``q [B, Tq, H, D]`` over ``k, v [B, S, Hkv, D]`` (already rotated).

    ``key_mask`` is True for keys that may be attended (padding and absent slots are False): ``[B, S]`` for
    every query alike (bidirectional), or ``[B, Tq, S]`` per query (block-causal); None when every key may be
    attended by every query (see :func:`dense_mask`). Returns ``[B, Tq, H, D]``.
    """
    mask = key_mask
    if key_mask is not None:
        mask = key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def dense_mask(key_mask: torch.Tensor) -> torch.Tensor | None:
    """None when ``key_mask`` lets every query see every key: attention then runs without a mask, which on CPU
    is a quarter faster and gives the same values (an all-True mask only adds zeros to the scores). One host
    read a forward, not a layer."""
    return None if bool(key_mask.all()) else key_mask


def block_causal_mask(key_mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """``[B, Tq, S]``: ``key_mask [B, S]`` narrowed to the keys each query may see under block-causal attention,
    those whose block (``position // block_size``) is not after the query's. A query with no key left (only
    padding can be one) keeps ``key_mask``, so attention never divides by zero."""
    seen = (key_positions[:, None, :] // block_size) <= (query_positions[:, :, None] // block_size)
    mask = key_mask[:, None, :] & seen
    return mask | (~mask.any(-1, keepdim=True) & key_mask[:, None, :])
