"""An affix's K/V computed alone at positions ``0..n-1``: what every cache stores, whatever holds it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from acache.affix.prompt import affix_key
from acache.models.base import DiffusionLM


@dataclass
class AffixEntry:
    """An affix's per-layer K/V as dense tensors, computed alone at positions ``0..n-1``."""

    key: str
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [n, Hkv, D], pre-RoPE
    values: list[torch.Tensor]
    hidden: list[torch.Tensor] | None = None  # input states of each layer and the last output [n, hidden]
    name: str | None = None
    refcount: int = 0
    transient: bool = False  # handed out without being stored

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def to_cpu(self) -> AffixEntry:
        """A copy of the K/V (and hidden states) on the CPU, as the store on disk keeps them."""
        return AffixEntry(self.key, self.token_ids, [t.cpu() for t in self.keys], [t.cpu() for t in self.values],
                          [t.cpu() for t in self.hidden] if self.hidden is not None else None, self.name)

    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *(self.hidden or [])]
        return sum(t.numel() * t.element_size() for t in tensors)


@torch.inference_mode()
def compute_affix(model: DiffusionLM, token_ids: Sequence[int], name: str | None = None, keep_hidden: bool = False,
                  key_fn: Callable[[Sequence[int]], str] = affix_key) -> AffixEntry:
    """An affix's per-layer pre-RoPE K/V from running it alone at positions ``0..n-1``."""
    ids = tuple(int(t) for t in token_ids)
    label = f"affix {name!r}" if name else "affix"
    limit = model.config.max_position_embeddings
    if not ids:
        raise ValueError(f"{label} is empty")
    if len(ids) > limit:
        raise ValueError(f"{label} has {len(ids)} tokens, more than the model's context of {limit}")
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"{label} holds a token id outside the vocabulary of {vocab}")
    device = model.device
    x = torch.tensor([ids], device=device)
    out = model.run_layers(model.embed(x), torch.arange(len(ids), device=device)[None], None, None,
                           range(len(model.layers)), return_kv=True, capture_inputs=keep_hidden)
    hidden = [h[0] for h in out.layer_inputs] if keep_hidden else None
    return AffixEntry(key_fn(ids), ids, [k[0] for k in out.kv.keys], [v[0] for v in out.kv.values], hidden, name)


@torch.inference_mode()
def first_layer_kv(model: DiffusionLM, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's pre-RoPE K/V of ``token_ids``: they depend on each token alone (no attention yet),
    so a stored entry can be checked against its own ids at the cost of one embedding and two projections."""
    layer = model.layers[0]
    x = model.embed(torch.tensor(list(token_ids), device=model.device))
    h = layer.attn_norm(x)
    shape = (len(token_ids), layer.num_kv_heads, layer.head_dim)
    return layer.k_proj(h).view(shape), layer.v_proj(h).view(shape)
