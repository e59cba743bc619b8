"""Fused q/k/v and gate/up projections: the same forward to the bit in every family and dtype (on CPU), no
memory added, gradients still reach every weight, and conversions, loads, replaced weights, copies, saves and
tensor-parallel slices keep the fused matrices in step with the weights."""

from __future__ import annotations

import copy

import pytest
import torch

from acache.engine import EngineConfig, LLMEngine
from acache.models.checkpoint import save_checkpoint
from acache.models.kv import KVCache
from acache.models.loader import load_model
from acache.models.tensor_parallel import TensorParallel, shard_model
from tests.conftest import DEVICE


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
    plain = load_model(family_dir, dtype=dtype, device=DEVICE)
    fused = load_model(family_dir, dtype=dtype, device=DEVICE)
    fused.fuse_projections()
    assert all(layer.qkv is not None and layer.gate_up is not None for layer in fused.layers)
    assert plain.layers[0].qkv is None
    first = _run(plain), _run(fused)
    if DEVICE != "cpu":  # another library may pick another kernel for the wider matmul: equal to rounding there
        torch.testing.assert_close(first[1].hidden, first[0].hidden, atol=2e-2 if dtype == "bfloat16" else 1e-4,
                                   rtol=2e-2 if dtype == "bfloat16" else 1e-4)
        return
    assert _same(*first)
    # against a past too (the engine's refreshes and steps), with the first forward's K/V as the cache
    past = KVCache(first[0].kv.keys, first[0].kv.values, torch.arange(9).expand(2, -1).to(DEVICE),
                   torch.ones(2, 9, dtype=torch.bool, device=DEVICE))
    assert _same(_run(plain, 1, past), _run(fused, 1, past))


def test_a_fused_forward_runs_two_projection_matmuls_not_five(family_dir):
    fused = load_model(family_dir)
    fused.fuse_projections()

    def refuse(*_):
        raise AssertionError("a separate projection ran")

    for layer in fused.layers:
        for m in (layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.up_proj):
            m.forward = refuse
    _run(fused)  # no gradients: the fused matmuls only
    with pytest.raises(AssertionError, match="separate projection"):  # with gradients: the separate ones
        fused(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None])


def test_fusing_adds_no_memory_and_keeps_every_name(llada_dir):
    plain, fused = load_model(llada_dir), load_model(llada_dir)
    fused.fuse_projections()
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused.state_dict().values(), strict=True))
    params = {n: p for n, p in fused.named_parameters()}
    fused.fuse_projections()  # idempotent: the same Parameters (an optimizer's references stay valid), no copy
    assert all(p is params[n] for n, p in fused.named_parameters())
    for layer in fused.layers:
        for whole, parts in ((layer.qkv[0], (layer.q_proj, layer.k_proj, layer.v_proj)),
                             (layer.gate_up, (layer.gate_proj, layer.up_proj))):
            storage = whole.untyped_storage().data_ptr()
            assert all(m.weight.untyped_storage().data_ptr() == storage for m in parts)
    before = fused.layers[0].qkv[0]
    fused.fuse_projections()
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


def test_a_conversion_and_an_in_place_load_keep_the_fused_matrices_in_step(family_dir):
    fused = load_model(family_dir)
    fused.fuse_projections()
    fused.to(torch.bfloat16)  # every weight gets a converted storage: re-fused, not left behind in fp32
    layer = fused.layers[0]
    assert layer.qkv[0].dtype == torch.bfloat16 and layer.gate_up.dtype == torch.bfloat16
    for whole, parts in ((layer.qkv[0], [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]),
                         (layer.gate_up, [layer.gate_proj.weight, layer.up_proj.weight])):
        assert all(p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for p in parts)
    if layer.q_proj.bias is not None:
        assert layer.qkv[1].dtype == torch.bfloat16
        assert layer.k_proj.bias.untyped_storage().data_ptr() == layer.qkv[1].untyped_storage().data_ptr()
    assert _same(_run(fused), _run(load_model(family_dir, dtype="bfloat16")))
    # an in-place load (load_model's copy_) writes through the views into the fused matrices
    other = _halved(load_model(family_dir))
    fused.to(torch.float32)
    fused.load_state_dict(other.state_dict())
    assert _same(_run(fused), _run(other))


def _halved(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


def test_replaced_weights_are_fused_again_before_the_next_forward(family_dir):
    fused = load_model(family_dir)
    fused.fuse_projections()
    other = _halved(load_model(family_dir))
    fused.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects, the fused ones now stale
    assert not fused.layers[0].fused_current()
    assert _same(_run(fused), _run(other))
    assert fused.layers[0].fused_current()


def test_a_copy_of_a_fused_model_starts_unfused_and_equal(llada_dir):
    fused = load_model(llada_dir)
    fused.fuse_projections()
    twin = copy.deepcopy(fused)
    assert not any(layer.fused for layer in twin.layers) and twin.layers[0].qkv is None
    assert _same(_run(twin), _run(fused))
    _halved(twin)  # an in-place change to the copy reaches its forward (nothing stale was carried over)
    assert _same(_run(twin), _run(_halved(load_model(llada_dir))))


def test_saving_a_fused_model_writes_a_checkpoint_that_loads_back(llada_dir, tmp_path):
    fused = load_model(llada_dir)
    fused.fuse_projections()
    save_checkpoint(fused, tmp_path / "again")
    back = load_model(tmp_path / "again")
    assert _same(_run(back), _run(load_model(llada_dir)))


def test_a_fused_model_sharded_later_fuses_its_slices(dream_dir):
    whole = load_model(dream_dir)  # Dream: q/k/v carry biases
    fused = load_model(dream_dir)
    fused.fuse_projections()
    shard_model(fused, TensorParallel(rank=1, world_size=2))  # no group: the slices alone are checked
    for layer, full in zip(fused.layers, whole.layers, strict=True):
        assert layer.fused_current()
        for stacked, names in ((layer.qkv[0], ("q_proj", "k_proj", "v_proj")), (layer.qkv[1], ("q_proj", "k_proj",
                               "v_proj")), (layer.gate_up, ("gate_proj", "up_proj"))):
            attr = "bias" if stacked is layer.qkv[1] else "weight"
            start = 0
            for name in names:
                part = getattr(getattr(layer, name), attr)
                rows = part.shape[0]
                want = getattr(getattr(full, name), attr)[rows:2 * rows]  # rank 1's half
                assert torch.equal(stacked[start:start + rows], want) and torch.equal(part, want)
                assert part.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
                start += rows
            assert start == stacked.shape[0]


def test_the_engine_fuses_the_model_it_serves(llada_dir):
    model = load_model(llada_dir)
    LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22))
    assert all(layer.fused_current() for layer in model.layers)
