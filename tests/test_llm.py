"""The public API: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import pytest
import torch

from acache import LLM, SamplingParams
from acache.reference import reference_generate


@pytest.fixture(scope="module")
def llm(llada_dir):
    return LLM(llada_dir, max_batch_size=2)


def test_generate_returns_text_ids_and_stats(llm):
    params = [SamplingParams(gen_length=16, block_length=8, threshold=0.5),
              SamplingParams(gen_length=8, block_length=4, threshold=0.7),
              SamplingParams(gen_length=16, block_length=16, remasking="low_confidence", steps=8)]
    outs = llm.generate(["Where is Mary?", "Hi", "A longer prompt than the others"], params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Where is Mary?", "Hi", "A longer prompt than the others"]
    for out in outs:
        assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.stats.num_generated_tokens == len(out.token_ids)
        assert out.stats.nfe >= 1 and out.stats.forward_time_s > 0
        assert not set(out.token_ids) & llm.stop_token_ids
    for out, sp in zip(outs, params, strict=True):  # each, the two that shared a batch too, as it decodes alone
        direct = reference_generate(llm.model, out.prompt_token_ids, sp, stop_token_ids=llm.stop_token_ids)
        assert out.token_ids == direct.token_ids
    assert outs[0].stats.batch_size == outs[1].stats.batch_size == 2 and outs[2].stats.batch_size <= 2
    assert len({o.request_id for o in outs}) == 3


def test_token_id_prompts_and_chat(llm):
    params = SamplingParams(gen_length=8, block_length=8, threshold=0.5)
    by_ids = llm.generate([[10, 20, 30]], params, use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.prompt_token_ids == [10, 20, 30]
    chat = llm.generate("hi", params, chat=True, use_tqdm=False)[0]
    assert chat.prompt_token_ids[0] == llm.tokenizer.token_to_id("<|startoftext|>")
    assert llm.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(gen_length=16, block_length=8, temperature=0.8, threshold=0.5, seed=7)
    a = llm.generate(["abc", "defgh"], params, use_tqdm=False)
    b = llm.generate(["defgh"], params, use_tqdm=False)
    assert a[1].token_ids == b[0].token_ids


def test_bad_inputs(llm, tmp_path):
    with pytest.raises(ValueError, match="prompt 0 is too long"):
        llm.generate("x" * 600, SamplingParams(gen_length=16, block_length=8), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token id 100000"):
        llm.generate([[1, 100000]], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("x", {"gen_length": 8})
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams(), None])
    assert not llm.engine.has_unfinished()
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(tmp_path / "missing")
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(tmp_path, max_batch_size=0)


def test_prompt_forms(llm):
    import numpy as np

    from acache import GEN, Affix

    params = SamplingParams(gen_length=8, block_length=8, threshold=0.5)
    one = llm.generate(["question ", Affix("doc"), GEN], params, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt is None
    arr = llm.generate(np.array([10, 20, 30]), params, use_tqdm=False)
    assert len(arr) == 1 and arr[0].prompt_token_ids == [10, 20, 30]
    with pytest.raises(ValueError, match="chat=True applies to text prompts"):
        llm.generate([["q", Affix("doc"), GEN]], params, chat=True)
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(3.5, params)


def test_one_sampling_params_per_prompt(llm):
    """Mixed lengths, rules, caches and seeds in one call: each prompt as it is decoded alone."""
    params = [SamplingParams(gen_length=8, block_length=8, threshold=0.5),
              SamplingParams(gen_length=24, block_length=8, cache="prefix", remasking="low_confidence", steps=12),
              SamplingParams(gen_length=16, block_length=4, cache="none", temperature=0.7, seed=3),
              SamplingParams(gen_length=16, block_length=16, remasking="factor", factor=2.0)]
    prompts = ["Where is Mary?", "Hi", "A longer prompt than the others", "x y"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        ref = reference_generate(llm.model, out.prompt_token_ids, p, stop_token_ids=llm.stop_token_ids)
        assert out.token_ids == ref.token_ids and out.stats.nfe == ref.nfe
    assert [len(o.token_ids) <= p.gen_length for o, p in zip(outs, params, strict=True)] == [True] * 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed=1.5), "seed must be an integer"), (dict(seed=2**64), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"), (dict(dtype=torch.int64), "dtype torch.int64 is not one"),
    (dict(dtype=torch.complex64), "dtype torch.complex64 is not one"),
    (dict(max_affix_tokens=-1), "max_affix_tokens must be a positive integer"),
    (dict(compile="yes"), "compile must be true or false"),
    (dict(gpu_memory_utilization="half"), "gpu_memory_utilization must be in"),
])
def test_bad_settings_are_named_at_construction(llada_dir, kwargs, message):
    """Each used to pass construction and fail later, or deep inside torch: seed=None and 1.5 in manual_seed after
    the weights loaded, an integer dtype in Module.to, a complex one at every request, a negative affix cap and
    compile='yes' at the first generate."""
    with pytest.raises(ValueError, match=message):
        LLM(llada_dir, **kwargs)


def test_seed_none_draws_a_fresh_seed(llada_dir):
    """vLLM's LLM(seed=None): a fresh seed, so unseeded sampled requests differ between two such LLMs."""
    params = SamplingParams(gen_length=16, block_length=16, temperature=5.0)
    outs = [LLM(llada_dir, seed=None).generate("x", params, use_tqdm=False)[0].token_ids for _ in range(2)]
    seeded = [LLM(llada_dir, seed=3).generate("x", params, use_tqdm=False)[0].token_ids for _ in range(2)]
    assert outs[0] != outs[1] and seeded[0] == seeded[1]


def test_a_batch_the_pool_cannot_hold_is_refused_whole_before_any_request_is_queued(llada_dir):
    """The requests were added one by one: the third was refused by its internal id (req-3), after the first two
    had been queued and then aborted, and counted so."""
    small = LLM(llada_dir, page_size=8, kv_cache_memory=3 * 8 * 2 * 2 * 2 * 32 * 4)  # a few pages of this model
    pages = small.engine.pool.num_pages
    params = SamplingParams(gen_length=8, block_length=8)
    small.generate([[5] * 4], params, use_tqdm=False)
    before = small.engine.summary()
    with pytest.raises(ValueError, match=rf"^prompt 2: the request needs \d+ KV pages of 8 tokens, more than the "
                                         rf"whole pool of {pages}"):
        small.generate([[5] * 4, [6] * 4, [7] * (8 * pages)], params, use_tqdm=False)
    counts = ("requests_finished", "requests_aborted", "requests_failed")
    assert [small.engine.summary()[k] for k in counts] == [before[k] for k in counts] == [1, 0, 0]
    assert not small.engine.has_unfinished()
