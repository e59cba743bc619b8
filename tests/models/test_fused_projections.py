"""Fused q/k/v and gate/up projections: the same forward to the bit in every family and dtype, no memory added,
gradients still reach every weight, and conversions, in-place loads, saves and tensor-parallel slices keep the
fused matrices in step with the weights."""

from __future__ import annotations

import copy

import pytest
import torch

from acache.engine import EngineConfig, LLMEngine
from acache.models.checkpoint import save_checkpoint
from acache.models.kv import KVCache
from acache.models.loader import load_model
from acache.models.tensor_parallel import TensorParallel, shard_model


def _run(model, seed=0, past=None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen).to(model.device)
    offset = 0 if past is None else past.positions.shape[1]
    pos = (torch.arange(9) + offset).expand(2, -1).to(model.device)
    mask = torch.ones(2, 9, dtype=torch.bool, device=model.device)
    mask[1, -3:] = False  # padding in one row
    with torch.inference_mode():
        return model(ids, pos, mask, past=past, return_kv=True, capture_queries=True)


def _same(a, b) -> bool:
    pairs = [*zip(a.kv.keys, b.kv.keys, strict=True), *zip(a.kv.values, b.kv.values, strict=True),
             *zip(a.queries, b.queries, strict=True), (a.hidden, b.hidden)]
    return all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_forward_is_bitwise_the_separate_one(family_dir, dtype):
    plain = load_model(family_dir, dtype=dtype)
    fused = load_model(family_dir, dtype=dtype)
    fused.fuse_projections()
    assert all(layer.qkv is not None and layer.gate_up is not None for layer in fused.layers)
    assert plain.layers[0].qkv is None
    first = _run(plain), _run(fused)
    assert _same(*first)
    # against a past too (the engine's refreshes and steps), with the first forward's K/V as the cache
    past = KVCache(first[0].kv.keys, first[0].kv.values, torch.arange(9).expand(2, -1),
                   torch.ones(2, 9, dtype=torch.bool))
    assert _same(_run(plain, 1, past), _run(fused, 1, past))


def test_fusing_adds_no_memory_and_keeps_every_name(llada_dir):
    plain, fused = load_model(llada_dir), load_model(llada_dir)
    fused.fuse_projections()
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused.state_dict().values(), strict=True))
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    for layer in fused.layers:
        for whole, parts in ((layer.qkv[0], (layer.q_proj, layer.k_proj, layer.v_proj)),
                             (layer.gate_up, (layer.gate_proj, layer.up_proj))):
            storage = whole.untyped_storage().data_ptr()
            assert all(m.weight.untyped_storage().data_ptr() == storage for m in parts)
    before = fused.layers[0].qkv[0]
    fused.fuse_projections()  # idempotent: nothing copied again
    assert fused.layers[0].qkv[0] is before


def test_gradients_reach_every_separate_weight(llada_dir):
    plain, fused = load_model(llada_dir), load_model(llada_dir)
    fused.fuse_projections()
    ids = torch.randint(0, plain.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(7).expand(2, -1)
    grads = []
    for model in (plain, fused):
        model.requires_grad_(True)
        model(ids, pos).hidden.float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        g = grads[1][f"layers.0.{name}.weight"]
        assert g is not None and torch.allclose(g, grads[0][f"layers.0.{name}.weight"], rtol=1e-5, atol=1e-7)


def test_conversion_in_place_load_and_replacement_keep_the_fused_matrices_in_step(llada_dir):
    fused = load_model(llada_dir)
    fused.fuse_projections()
    fused.to(torch.bfloat16)  # every weight gets a converted storage: re-fused, not left behind in fp32
    layer = fused.layers[0]
    assert layer.qkv[0].dtype == torch.bfloat16
    assert layer.q_proj.weight.untyped_storage().data_ptr() == layer.qkv[0].untyped_storage().data_ptr()
    assert _same(_run(fused), _run(load_model(llada_dir, dtype="bfloat16")))
    # an in-place load (load_model's copy_) writes through the views into the fused matrices
    other = load_model(llada_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    fused.to(torch.float32)
    fused.load_state_dict(other.state_dict())
    assert _same(_run(fused), _run(other))


def test_saving_a_fused_model_writes_a_checkpoint_that_loads_back(llada_dir, tmp_path):
    fused = load_model(llada_dir)
    fused.fuse_projections()
    save_checkpoint(fused, tmp_path / "again")
    back = load_model(tmp_path / "again")
    assert _same(_run(back), _run(load_model(llada_dir)))


def test_a_fused_model_sharded_later_fuses_its_slices(llada_dir):
    whole = load_model(llada_dir)
    fused = copy.deepcopy(whole)
    fused.fuse_projections()
    shard_model(fused, TensorParallel(rank=0, world_size=2))  # no group: slices only
    layer = fused.layers[0]
    assert layer.qkv[0].shape[0] == (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
    assert torch.equal(layer.qkv[0][:layer.q_proj.out_features], layer.q_proj.weight)
    assert layer.q_proj.weight.untyped_storage().data_ptr() == layer.qkv[0].untyped_storage().data_ptr()
    assert torch.equal(layer.gate_up[:layer.gate_proj.out_features],
                       whole.layers[0].gate_proj.weight[:layer.gate_proj.out_features])


def test_the_engine_fuses_the_model_it_serves(llada_dir):
    model = load_model(llada_dir)
    LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22))
    assert all(layer.qkv is not None for layer in model.layers)
