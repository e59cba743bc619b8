"""Tensor parallelism over ``torch.distributed`` (gloo on CPU, nccl on CUDA), in Megatron's split: q/k/v and
gate/up are column-parallel (each rank keeps whole heads and a slice of the MLP), o and down are
row-parallel and their partial outputs are summed across ranks. Embeddings, norms and the LM head stay
whole on every rank, so every rank sees the same hidden states and logits and can run the same engine step.

Whatever sums over heads outside the layers (the attention mass that picks anchors, K/V deviations) sums
its rank's heads and then calls :meth:`TensorParallel.reduce`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from acache.models.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; ``group`` is None for the default group."""

    rank: int
    world_size: int
    group: object = None

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks (in place, and returned)."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """A clear error for a model that cannot be split ``world_size`` ways."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(config, name) % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {name} "
                             f"({getattr(config, name)})")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """What one rank's layers hold: its share of the heads and of the MLP, heads of the same size."""
    check_divisible(config, world_size)
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=config.num_kv_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size, head_size=config.head_dim)


def _keep_rows(linear: nn.Linear, rank: int, world_size: int) -> None:
    rows = linear.out_features // world_size
    sl = slice(rank * rows, (rank + 1) * rows)
    linear.weight = nn.Parameter(linear.weight.data[sl].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[sl].clone(), requires_grad=False)
    linear.out_features = rows


def _keep_cols(linear: nn.Linear, rank: int, world_size: int) -> None:
    cols = linear.in_features // world_size
    linear.weight = nn.Parameter(linear.weight.data[:, rank * cols:(rank + 1) * cols].clone(), requires_grad=False)
    linear.in_features = cols


def shard_model(model, tp: TensorParallel):
    """Keeps this rank's slice of every decoder layer of a loaded (whole) model, in place; returns it."""
    if tp.world_size == 1:
        return model
    local = shard_config(model.config, tp.world_size)
    for layer in model.layers:
        for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.up_proj):
            _keep_rows(linear, tp.rank, tp.world_size)
        for linear in (layer.o_proj, layer.down_proj):
            _keep_cols(linear, tp.rank, tp.world_size)
        layer.num_heads, layer.num_kv_heads = local.num_heads, local.num_kv_heads
        layer.tp = tp
        if layer.fused:  # fused before sharding: fuse this rank's slices instead
            layer.fuse_projections()
    model.config = local
    model.tp = tp
    return model
