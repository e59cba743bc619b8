"""The decoder layers under torch.compile: the engine decodes the same tokens, and only the attention families
accept it."""

from __future__ import annotations

from pathlib import Path

import pytest

from acache.engine import EngineConfig, LLMEngine
from acache.models.loader import load_model
from acache.sampling_params import SamplingParams
from tests.affix.helpers import layouts
from tests.helpers import run_engine


def test_compiled_layers_decode_the_same_tokens(llada_dir):
    """Mixed requests (prefix / infix / suffix, two lengths, with and without anchors, one with a far-mask
    window) arriving at different steps: eager and compiled engines write the same tokens."""
    model = load_model(llada_dir)  # its own copy: compiling changes the model object
    prompts = [layouts(seed=s)[k] for s in range(2) for k in ("prefix", "infix", "suffix")]
    params = [SamplingParams(gen_length=(16, 32)[i % 2], block_length=8, threshold=(0.5, 0.9)[i % 2],
                             selector="attention" if i % 3 != 2 else None, far_mask_window=(None, 1)[i % 2])
              for i in range(6)]
    outs = {}
    for compiled in (False, True):
        engine = LLMEngine(model, EngineConfig(page_size=4, kv_cache_memory=1 << 22, max_num_seqs=3,
                                               compile=compiled))
        outs[compiled] = [o.token_ids for o in run_engine(model, prompts, params, [0, 0, 1, 2, 4, 4], engine=engine)]
    assert outs[True] == outs[False]
    first = model.layers[0].forward
    model.compile_layers()  # once only: a second call wraps nothing again
    assert model.layers[0].forward is first and hasattr(first, "_torchdynamo_orig_callable")


def test_compile_is_refused_for_a_state_cache_family():
    from acache.models.ssm import SSMBlockDiffusionLM
    from tests.engine.test_state_runner import SSM_CONFIG

    model = SSMBlockDiffusionLM(SSM_CONFIG)
    with pytest.raises(ValueError, match="compile applies to the attention families"):
        LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22, compile=True))
    with pytest.raises(ValueError, match="reuse_step_keys keeps rotated copies of paged K/V"):  # it was ignored
        LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22, reuse_step_keys=True))
    assert LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22, reuse_step_keys=False)).kv.budget_bytes > 0
    assert not any(hasattr(getattr(m, "forward", None), "_torchdynamo_orig_callable") for m in model.modules())


def test_llm_refuses_compile_for_a_state_cache_family_by_name():
    from acache import LLM

    with pytest.raises(ValueError, match="compile applies to the attention families' decoder layers; a "
                                         "blockdiff_ssm model runs eagerly"):
        LLM(Path(__file__).resolve().parents[2] / "models" / "acache-tiny-ssm", compile=True)
