"""A key set's slices keep whether its keys are already rotated: a rotated slice read as unrotated would be
rotated twice when attended."""

import pytest
import torch

from acache.models.kv import KVCache


def key_set(rotated: bool, length: int = 4) -> KVCache:
    keys = [torch.randn(1, length, 2, 8) for _ in range(2)]
    return KVCache(keys, [k.clone() for k in keys], torch.arange(length)[None], torch.ones(1, length, dtype=torch.bool),
                   rotated)


@pytest.mark.parametrize("rotated", [False, True])
def test_slices_and_joins_keep_the_rotation(rotated):
    kv = key_set(rotated)
    assert kv.columns(slice(1, 3)).rotated is rotated
    assert kv.columns(torch.tensor([0, 2])).rotated is rotated
    assert kv.gather(torch.tensor([[3, 1]])).rotated is rotated
    assert KVCache.cat([kv, key_set(rotated)]).rotated is rotated


def test_rotated_and_unrotated_keys_are_not_joined():
    with pytest.raises(ValueError, match="rotated and unrotated"):
        KVCache.cat([key_set(True), key_set(False)])


def test_a_zero_one_attention_mask_reads_as_the_boolean_one(llada_dir):
    """A Hugging Face style integer mask used to fail deep in the attention kernel."""
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    ids, positions = torch.tensor([[5, 6, 7, 8, 0]]), torch.arange(5)[None]
    with torch.inference_mode():
        want = model(ids, positions, torch.tensor([[True, True, True, True, False]])).hidden
        got = model(ids, positions, torch.tensor([[1, 1, 1, 1, 0]])).hidden
    assert torch.equal(got[:, :4], want[:, :4])
