"""R2LM: causal attention plus a right-to-left sidecar inside each block; its K/V cache is exact, so cached
decoding equals uncached decoding token for token."""

from __future__ import annotations

import pytest
import torch

from acache.models.r2lm import R2LM, R2LMConfig
from acache.models.ssm import init_scan_model_
from acache.reference import reference_generate_state_cache
from acache.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.helpers import right_padded

CONFIG = dict(vocab_size=300, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
              sidecar_heads=2, sidecar_head_dim=8, state_size=6, block_size=4, mask_token_id=299, eos_token_id=298)


@pytest.fixture(scope="module")
def model():
    m = R2LM(R2LMConfig(**CONFIG))
    init_scan_model_(m, seed=5, std=0.3)
    return m.eval()


def logits_of(model, ids):
    return model.extend(torch.tensor(ids), 0, model.empty_cache())[0]


def test_left_context_by_attention_right_context_only_inside_the_block(model):
    ids = random_prompts([12], vocab=290, seed=3)[0]
    base = logits_of(model, ids)
    for changed_at, same_until in ((9, 8), (6, 4)):  # block 2; then the middle of block 1
        other = list(ids)
        other[changed_at] = (other[changed_at] + 1) % 290
        moved = logits_of(model, other)
        assert torch.allclose(base[:same_until], moved[:same_until], atol=1e-6)
        assert not torch.allclose(base[same_until], moved[same_until], atol=1e-4)  # the sidecar carries it left
    # without the sidecar, position 4 could not see position 6: causal attention alone is left-only
    for layer in model.layers:
        layer.sidecar.out_proj.weight.data.zero_()
    try:
        other = list(ids)
        other[6] = (other[6] + 1) % 290
        assert torch.allclose(logits_of(model, ids)[:6], logits_of(model, other)[:6], atol=1e-6)
    finally:
        init_scan_model_(model, seed=5, std=0.3)


def test_the_cache_is_exact_and_grows_with_the_context(model):
    ids = torch.tensor(random_prompts([12], vocab=290, seed=4)[0])
    whole, _ = model.extend(ids, 0, None)
    cache, parts = None, []
    for s in range(0, 12, 4):
        logits, cache = model.extend(ids[s:s + 4], s, cache)
        parts.append(logits)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5)
    cfg = model.config
    assert model.cache_bytes(cache) == 12 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


CASES = [dict(threshold=0.3), dict(remasking="low_confidence", steps=8), dict(remasking="factor", factor=1.5),
         dict(temperature=0.8, seed=4), dict(threshold=0.05, stop_token_ids=(7,))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cached_decoding_equals_uncached(model, case):
    for prompt, block in zip(random_prompts([3, 4, 6, 9], vocab=290, seed=case + 10), (4, 2, 8, 4), strict=True):
        base = dict(gen_length=8, block_length=block, **CASES[case])  # within, at, and across model blocks
        cached = reference_generate_state_cache(model, prompt, SamplingParams(**base))
        uncached = reference_generate_state_cache(model, prompt, SamplingParams(**base, cache="none"))
        assert cached.token_ids == uncached.token_ids and cached.nfe == uncached.nfe


def test_config_is_validated():
    with pytest.raises(ValueError, match="sidecar_heads must be a positive integer"):
        R2LMConfig(**{**CONFIG, "sidecar_heads": 0})
    with pytest.raises(ValueError, match="do not divide"):
        R2LMConfig(**{**CONFIG, "num_kv_heads": 3})
    for name, value in (("rope_theta", 0), ("rope_theta", -5.0), ("rms_norm_eps", -1), ("rms_norm_eps", "1e-6"),
                        ("rope_theta", float("inf"))):
        with pytest.raises(ValueError, match=f"{name} must be a positive number"):
            R2LMConfig(**{**CONFIG, name: value})
    heads = CONFIG["hidden_size"] // 3  # a head dimension of 3
    with pytest.raises(ValueError, match="the head dimension 3 is odd"):
        R2LMConfig(**{**CONFIG, "num_heads": heads, "num_kv_heads": heads})


@pytest.mark.parametrize("family", ["r2lm", "blockdiff_ssm"])
def test_own_layout_checkpoints_round_trip(tmp_path, family):
    """The state-cache families write and load through the same checkpoint code as the upstream ones (every tensor
    accounted for), decode the same after the round trip and on the engine, which refuses by name what they
    cannot do."""
    import json

    from safetensors.torch import load_file

    from acache import LLM
    from acache.cli import main
    from acache.models import ConfigError, load_model

    root = tmp_path / family
    assert main(["make-random-checkpoint", "--family", family, "--out", str(root), "--hidden-size", "32",
                 "--layers", "2", "--heads", "2", "--block-size", "4", "--std", "0.3"]) == 0
    model = load_model(root)
    assert model.family == family and model.config.block_size == 4
    assert set(load_file(root / "model.safetensors")) == set(model.hf_tensor_names(model.config))
    # written and read back: every tensor the same (two loads of one file would agree on a wrong write too)

    from acache.models.checkpoint import save_checkpoint
    from acache.models.tokenizer import Tokenizer

    save_checkpoint(model, tmp_path / "again", Tokenizer.from_dir(root)._tok, json.loads(
        (root / "tokenizer_config.json").read_text()))
    again = load_model(tmp_path / "again")
    assert model.state_dict().keys() == again.state_dict().keys()
    assert all(torch.equal(t, again.state_dict()[k]) for k, t in model.state_dict().items())
    params = SamplingParams(gen_length=8, block_length=4, threshold=0.4)
    want = reference_generate_state_cache(model, [5, 6, 7], params).token_ids
    assert reference_generate_state_cache(again, [5, 6, 7], params).token_ids == want
    llm = LLM(root)  # the engine serves it, as the reference loop decodes it
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids == reference_generate_state_cache(
        model, [5, 6, 7], params).token_ids
    for kwargs, name in [(dict(tensor_parallel_size=2), "tensor_parallel_size"),
                         (dict(affix_cache_dir=tmp_path), "affix_cache_dir")]:
        with pytest.raises(ValueError, match=f"{name} is not supported for a {family} model"):
            LLM(root, **kwargs)
    raw = json.loads((root / "config.json").read_text())
    for change, why in [("state_size", "missing the field 'state_size'"), ("block_size", "missing the field")]:
        (root / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != change}))
        with pytest.raises(ConfigError, match=why):
            load_model(root)
    (root / "config.json").write_text(json.dumps({**raw, "block_size": 0}))
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        load_model(root)


def test_padding_is_never_seen(model):
    ids = random_prompts([6, 11], vocab=290, seed=8)
    batch, valid = right_padded(ids, 298)
    got = model.train_logits(batch, valid)
    for i, row in enumerate(ids):
        assert torch.allclose(got[i, :len(row)], logits_of(model, row), atol=1e-5)
