"""The state-space block-diffusion variant: the chunked scan against a step-by-step recurrence, a state that
carries exactly from block to block, and cached decoding equal to uncached decoding token for token."""

from __future__ import annotations

import pytest
import torch

from acache.models.ssm import SSMBlockDiffusionLM, SSMConfig, chunked_scan, init_scan_model_
from acache.reference import reference_generate_state_cache
from acache.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.helpers import right_padded

CONFIG = dict(vocab_size=300, hidden_size=48, num_layers=2, intermediate_size=96, num_heads=3, head_dim=8,
              state_size=6, block_size=4, mask_token_id=299, eos_token_id=298)


@pytest.fixture(scope="module", params=[1, 3], ids=["one-group", "a-group-a-head"])
def model(request):
    m = SSMBlockDiffusionLM(SSMConfig(**CONFIG, n_groups=request.param))
    init_scan_model_(m, seed=3, std=0.3)
    return m.eval()


def recurrence(x, dt, a, b, c, state):
    """The scan one step at a time: S = exp(dt a) S + dt x b^T, y = S c, with ``b, c [B, T, N]`` shared by the
    heads or ``[B, T, G, N]``, head ``i`` reading group ``i // (H / G)``."""
    h = x.shape[2]
    if b.dim() == 3:
        b, c = b[:, :, None].expand(-1, -1, h, -1), c[:, :, None].expand(-1, -1, h, -1)
    group = [i // (h // b.shape[2]) for i in range(h)]
    ys = []
    for t in range(x.shape[1]):
        decay = (dt[:, t] * a).exp()[:, :, None, None]  # [B, H, 1, 1]
        bt, ct = b[:, t, group], c[:, t, group]  # [B, H, N]
        state = decay * state + dt[:, t, :, None, None] * x[:, t, :, :, None] * bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, ct))
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("groups", [None, 1, 2, 4])
@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_chunked_scan_equals_the_recurrence(chunk, groups):
    """Shared ``B, C`` (None) or one per group of heads (4 heads: groups of 4, 2 and 1)."""
    g = torch.Generator().manual_seed(chunk)
    bsz, t, h, p, n = 2, 11, 4, 4, 5
    x = torch.randn(bsz, t, h, p, generator=g, dtype=torch.float64)
    dt = torch.rand(bsz, t, h, generator=g, dtype=torch.float64) * 0.5 + 0.01
    a = -torch.rand(h, generator=g, dtype=torch.float64) * 3
    shape = (bsz, t, n) if groups is None else (bsz, t, groups, n)
    b, c = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    s0 = torch.randn(bsz, h, p, n, generator=g, dtype=torch.float64)
    y, s = chunked_scan(x, dt, a, b, c, s0, chunk)
    y_ref, s_ref = recurrence(x, dt, a, b, c, s0)
    assert torch.allclose(y, y_ref, atol=1e-10) and torch.allclose(s, s_ref, atol=1e-10)
    # and the comparison can fail: a decay off by a little moves the outputs
    y_off, _ = chunked_scan(x, dt, a * 1.01, b, c, s0, chunk)
    assert not torch.allclose(y_off, y_ref, atol=1e-6)


def test_the_state_carries_block_to_block_exactly(model):
    """Logits of whole blocks run at once equal those run a block at a time from the carried state (and the
    convolution's window: without it a block's first tokens would lose the inputs before them)."""
    ids = torch.tensor([random_prompts([12], vocab=290, seed=1)[0]])
    whole, end = model(ids)
    state, parts = None, []
    for s in range(0, 12, 4):
        logits, state = model(ids[:, s:s + 4], state)
        parts.append(logits)
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-5)
    # the state and the convolution's window, layer by layer
    assert all(torch.allclose(x, y, atol=1e-5) for a, b in zip(state, end, strict=True)
               for x, y in zip(a, b, strict=True))


def test_a_block_sees_itself_both_ways_and_no_later_block(model):
    ids = random_prompts([12], vocab=290, seed=2)[0]
    base, _ = model(torch.tensor([ids]))
    later = list(ids)
    later[9] = (later[9] + 1) % 290  # block 2
    moved, _ = model(torch.tensor([later]))
    assert torch.allclose(base[0, :8], moved[0, :8], atol=1e-6)
    inside = list(ids)
    inside[7] = (inside[7] + 1) % 290  # the last token of block 1 changes the block's first token
    moved, _ = model(torch.tensor([inside]))
    assert torch.allclose(base[0, :4], moved[0, :4], atol=1e-6) and not torch.allclose(base[0, 4], moved[0, 4])


def test_the_state_is_the_same_size_at_any_context(model):
    sizes = {model.state_bytes(model(torch.tensor([random_prompts([n], vocab=290)[0]]))[1]) for n in (4, 40, 400)}
    cfg = model.config
    window = (cfg.conv_kernel - 1) * (cfg.num_heads * cfg.head_dim + 2 * cfg.n_groups * cfg.state_size) * 4
    assert sizes == {cfg.num_layers * (cfg.num_heads * cfg.head_dim * cfg.state_size * 4 + window)}
    assert sizes == {model.cache_bytes_for(4)} == {model.cache_bytes_for(4000)}


CASES = [dict(threshold=0.3), dict(remasking="low_confidence", steps=8), dict(remasking="factor", factor=1.5),
         dict(temperature=0.8, seed=4), dict(threshold=0.05, stop_token_ids=(7,))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cached_decoding_equals_uncached(model, case):
    for prompt, block in zip(random_prompts([3, 4, 6, 9], vocab=290, seed=case), (4, 2, 8, 4), strict=True):
        base = dict(gen_length=8, block_length=block, **CASES[case])  # within, at, and across model blocks
        cached = reference_generate_state_cache(model, prompt, SamplingParams(**base))
        uncached = reference_generate_state_cache(model, prompt, SamplingParams(**base, cache="none"))
        assert cached.token_ids == uncached.token_ids and cached.nfe == uncached.nfe
        assert cached.cache_bytes == model.state_bytes(model.empty_state())


@pytest.mark.parametrize("option", [dict(focus_layers=1), dict(far_mask_window=1)])
def test_the_reference_loop_refuses_what_the_engine_refuses(model, option):
    """Both ask :func:`check_state_request`: an option the family cannot honour is refused by name, not
    silently ignored by one of the two paths."""
    from acache.engine import EngineConfig, LLMEngine

    params = SamplingParams(block_length=4, gen_length=8, **option)
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"{name} is not supported for the blockdiff_ssm family"):
        reference_generate_state_cache(model, [1, 2, 3], params)
    with pytest.raises(ValueError, match=f"{name} is not supported for the blockdiff_ssm family"):
        LLMEngine(model, EngineConfig(kv_cache_memory=1 << 24)).add_request([1, 2, 3], params)


def test_bad_requests(model):
    # a plain token list has no affix, so a policy has nothing to do: decoded as without one, as the engine does
    plain = SamplingParams(block_length=4, gen_length=8)
    with_policy = SamplingParams(block_length=4, gen_length=8, selector="attention")
    assert reference_generate_state_cache(model, [1, 2, 3], with_policy).token_ids == reference_generate_state_cache(
        model, [1, 2, 3], plain).token_ids
    with pytest.raises(ValueError, match="in the vocabulary"):
        reference_generate_state_cache(model, [1, 400], SamplingParams(gen_length=4, block_length=4))


@pytest.mark.parametrize("scan_init, a_range, dt_range", [("short", (0.5, 8.0), (0.1, 0.1)),
                                                         ("long", (1.0, 16.0), (0.001, 0.1))])
def test_scan_init_spreads_decays_over_the_heads(scan_init, a_range, dt_range):
    """Each layer's heads start with ``A`` and ``dt`` log-spaced over the named ranges, ends included, so the
    ``long`` heads' per-token decay ``exp(-dt A)`` runs from nearly one to well below it."""
    m = SSMBlockDiffusionLM(SSMConfig(**{**CONFIG, "num_heads": 5}))
    init_scan_model_(m, seed=0, scan_init=scan_init)
    mixer = m.layers[1].mixer
    a = mixer.A_log.detach().double().exp()
    dt = torch.nn.functional.softplus(mixer.dt_bias.detach().double())
    for got, (lo, hi) in ((a, a_range), (dt, dt_range)):
        want = torch.tensor([lo * (hi / lo) ** (i / 4) for i in range(5)], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5), (got, want)
    with pytest.raises(ValueError, match="scan_init must be one of"):
        init_scan_model_(m, seed=0, scan_init="mamba")


def test_convolution_taps_start_uniform():
    """Every tap of the short convolution starts at Mamba's default, uniform over +-1/sqrt(taps), not near the
    identity: with only the last tap at one, a token needed thousands of steps to bind to one a few positions
    back (docs/model.md, the state-space section)."""
    m = SSMBlockDiffusionLM(SSMConfig(**{**CONFIG, "conv_kernel": 8}))
    init_scan_model_(m, seed=0)
    w = m.layers[0].mixer.conv1d.weight.detach()
    bound = 1 / 8 ** 0.5
    assert float(w.abs().max()) <= bound
    spread = w.abs().mean(dim=(0, 1))  # mean size of each tap over the channels: about bound / 2 each
    assert torch.allclose(spread, torch.full_like(spread, bound / 2), rtol=0.25), spread
    assert float(m.layers[0].mixer.conv1d.bias.detach().abs().max()) == 0.0


def test_scan_options_shape_the_model():
    """A training shape's state size and convolution reach the model (and only a state-cache family takes them)."""
    from acache.models.checkpoint import family_model

    m = family_model("blockdiff_ssm", 300, 299, 298, layers=1, hidden_size=32, heads=2, block_size=4,
                     state_size=24, conv_kernel=6, n_groups=2)
    assert m.config.state_size == 24 and m.config.conv_kernel == 6 and m.config.n_groups == 2
    assert m.layers[0].mixer.in_proj.weight.shape[0] == 2 * 64 + 2 * 2 * 24 + 4  # x, z, B and C per group, dt
    assert m.layers[0].mixer.conv1d.weight.shape[-1] == 6 and m.empty_cache()[0][1].shape[1] == 5
    assert m.cache_bytes_for(10) == m.cache_bytes(m.empty_cache())
    with pytest.raises(ValueError, match="conv_kernel belong to the state-cache families, not to llada"):
        family_model("llada", 300, 299, 298, layers=1, hidden_size=32, heads=2, conv_kernel=6)


def test_groups_give_each_group_its_own_key():
    """With a group a head, changing one head's slice of ``B`` moves that head's outputs and no other's."""
    torch.manual_seed(0)
    bsz, t, h, p, n = 1, 6, 3, 2, 4
    x, dt = torch.randn(bsz, t, h, p, dtype=torch.float64), torch.rand(bsz, t, h, dtype=torch.float64) + 0.1
    a = -torch.rand(h, dtype=torch.float64)
    b, c = torch.randn(bsz, t, h, n, dtype=torch.float64), torch.randn(bsz, t, h, n, dtype=torch.float64)
    s0 = torch.zeros(bsz, h, p, n, dtype=torch.float64)
    y, _ = chunked_scan(x, dt, a, b, c, s0, 4)
    b2 = b.clone()
    b2[:, :, 1] += 1.0
    y2, _ = chunked_scan(x, dt, a, b2, c, s0, 4)
    moved = [not torch.allclose(y[:, :, i], y2[:, :, i]) for i in range(h)]
    assert moved == [False, True, False]


def test_config_is_validated():
    with pytest.raises(ValueError, match="state_size must be a positive integer"):
        SSMConfig(**{**CONFIG, "state_size": 0})
    with pytest.raises(ValueError, match="n_groups must be a positive integer"):
        SSMConfig(**{**CONFIG, "n_groups": 0})
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of n_groups=2"):
        SSMConfig(**{**CONFIG, "n_groups": 2})
    with pytest.raises(ValueError, match="mask_token_id=300 is outside the vocabulary"):
        SSMConfig(**{**CONFIG, "mask_token_id": 300})
    for name, value in (("eos_token_id", True), ("mask_token_id", 259.0), ("eos_token_id", "2")):
        with pytest.raises(ValueError, match=f"{name} must be an integer token id, got {value!r}"):
            SSMConfig(**{**CONFIG, name: value})
    for eps in (0, -1.0, float("nan"), "1e-6", True):  # a bad epsilon made every logit NaN, or failed in RMSNorm
        with pytest.raises(ValueError, match="rms_norm_eps must be a positive number"):
            SSMConfig(**{**CONFIG, "rms_norm_eps": eps})


def test_padding_is_transparent_to_the_scans(model):
    """A right-padded row of a training batch gets the logits it gets alone: padding steps neither write to
    the state nor decay it."""
    ids = random_prompts([7, 11], vocab=290, seed=9)
    batch, valid = right_padded(ids, 298)
    got = model.train_logits(batch, valid)
    for i, row in enumerate(ids):
        alone, _ = model(torch.tensor([row]))
        assert torch.allclose(got[i, :len(row)], alone[0], atol=1e-5)
    assert not torch.allclose(model(batch)[0][0, :7], got[0, :7], atol=1e-5)  # unmasked padding would leak
