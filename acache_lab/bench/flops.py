"""How close a run comes to the machine: the model FLOPs it did, and the peak a plain matmul reaches.

Model FLOPs count the useful arithmetic of every decoder layer call and every logit computed, from the
shapes that reach them: ``2 x (the layer's linear weights)`` a real fed token, plus ``4 x heads x head_dim``
a (real fed token, valid key) pair for the attention scores and their weighted sum (on a block-causal model, the
keys each token's block sees), plus ``2 x hidden x vocab`` a logit row. Padding is left out: it is work the
machine does, not work the model needs. The peak is measured, not looked up: a matmul in the model's dtype on
its device, timed in the same run.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from acache.models.base import DiffusionLM


class FlopCounter:
    """Counts the model FLOPs of everything ``model`` runs while the ``with`` block lasts."""

    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self._counted = 0
        self._pending: list[torch.Tensor] = []  # device scalars, read once: no host sync per layer call
        self._handles: list = []

    @property
    def flops(self) -> int:
        if self._pending:
            self._counted += int(torch.stack([p.to("cpu") for p in self._pending]).sum())
            self._pending.clear()
        return self._counted

    def _layer_hook(self, layer: nn.Module):
        linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        width = layer.num_heads * layer.head_dim

        def hook(_module, args):
            x, past_k, key_mask = args[0], args[3], args[5]
            if key_mask is None:  # every key valid (attention ran without a mask)
                b, t = x.shape[:2]
                fill = len(args) > 7 and args[7]  # the past already holds the fed keys' room
                keys = (0 if fill else t) + (0 if past_k is None else past_k.shape[1])
                self._counted += b * (2 * linear * t + 4 * width * t * keys)  # shapes only: no tensor, no sync
                return
            t = x.shape[1]
            if key_mask.dim() == 3:  # block-causal, a key set per query [B, T, S]: a real token sees itself
                at = torch.arange(t, device=key_mask.device)
                real = key_mask[:, at, key_mask.shape[2] - t + at]
                self._pending.append(2 * linear * real.sum() + 4 * width * (key_mask.sum(dim=2) * real).sum())
                return
            fed = key_mask[:, -t:].sum(dim=1)  # the fed tokens are the key set's last columns
            keys = key_mask.sum(dim=1)
            self._pending.append(2 * linear * fed.sum() + 4 * width * (fed * keys).sum())
        return hook

    def __enter__(self) -> FlopCounter:
        for layer in self.model.layers:
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(layer)))
        original = self.model.logits
        vocab_flops = 2 * self.model.config.hidden_size * self.model.config.vocab_size

        def counted(hidden, cols=None, valid=None):
            out = original(hidden, cols, valid)
            self._counted += vocab_flops * out.shape[:-1].numel()
            return out

        self.model.logits = counted  # an instance attribute, removed on exit
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        del self.model.logits


def matmul_peak(dtype: torch.dtype, device: torch.device, m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``device``, repeated for about ``seconds``."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(3):  # warm-up
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done, start = 0, time.perf_counter()
    while True:
        a @ b
        done += 1
        if done % 4 == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if time.perf_counter() - start >= seconds:
                break
    return 2 * m * k * n * done / (time.perf_counter() - start)
