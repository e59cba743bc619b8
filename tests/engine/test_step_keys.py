"""A request's in-block key set, gathered and rotated once a refresh: the same keys the model would rotate at
attend time, rebuilt after a refresh, and padded per layer for a batch."""

from __future__ import annotations

import torch

from acache.engine.page_pool import PagePool
from acache.engine.step_keys import StackedKV, StepKeyCache
from acache.models.layers import apply_rope, rope_tables


def test_step_keys_are_the_pool_keys_rotated_and_reused_until_a_refresh(llada_model):
    cfg = llada_model.config
    pool = PagePool(cfg, 4, 4, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for k in pool.keys:
        k.copy_(torch.randn(k.shape, generator=g))
    cache = StepKeyCache(pool, cfg.head_dim, cfg.rope_theta)
    slots, positions = torch.tensor([3, 0, 7]), torch.tensor([0, 5, 9])
    first = cache.get("a", 1, slots, positions)
    want = apply_rope(pool.keys[1][slots][None], *rope_tables(positions[None], cfg.head_dim, cfg.rope_theta))[0]
    assert torch.equal(first.keys[1], want) and torch.equal(first.values[0], pool.values[0][slots])
    pool.keys[1].zero_()  # a refresh writes the pool; the same refresh count still reads the kept set
    assert cache.get("a", 1, slots, positions) is first
    assert not cache.get("a", 2, slots, positions).keys[1].any()
    cache.get("b", 1, slots[:1], positions[:1])
    stacked = StackedKV([cache.entries["a"], cache.entries["b"]], torch.device("cpu"))
    assert stacked.rotated and stacked.keys[0].shape[:2] == (2, 3) and stacked.mask.tolist() == [[True] * 3,
                                                                                                 [True, False, False]]
    cache.keep_only({"b"})
    assert set(cache.entries) == {"b"}


def test_the_room_takes_the_fed_keys_in_place_of_a_concatenation(llada_model):
    """A stack with room for the fed tokens gives, step after step, the states and the FLOP count of the stack
    without room; the same batch gets the same stack back until its sets, its requests or its width change."""
    from acache_lab.bench.flops import FlopCounter

    cfg = llada_model.config
    pool = PagePool(cfg, 8, 4, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in (*pool.keys, *pool.values):
        t.copy_(torch.randn(t.shape, generator=g))
    cache = StepKeyCache(pool, cfg.head_dim, cfg.rope_theta)
    sets = [cache.get("a", 1, torch.tensor([3, 0, 7, 9, 12]), torch.arange(5)),
            cache.get("b", 1, torch.tensor([20, 21]), torch.tensor([0, 1]))]
    dev = torch.device("cpu")
    stack = cache.stacked(["a", "b"], sets, 3, dev)
    assert stack.full_keys[0].shape[1] == 5 + 3 and stack.keys[0].shape[1] == 5
    for _ in range(3):  # the room is overwritten at every step, nothing of the last one stays
        ids = torch.randint(3, cfg.vocab_size - 3, (2, 3), generator=g)
        positions = torch.tensor([[5, 6, 7], [2, 3, 4]])
        counters = []
        with torch.inference_mode():
            outs = []
            for past in (cache.stacked(["a", "b"], sets, 3, dev), StackedKV(sets, dev)):
                with FlopCounter(llada_model) as counter:
                    outs.append(llada_model(ids, positions, past=past).hidden)
                counters.append(counter.flops)
        assert torch.equal(outs[0], outs[1]) and counters[0] == counters[1] > 0
    assert cache.stacked(["a", "b"], sets, 3, dev) is stack
    assert cache.stacked(["a", "b"], sets, 2, dev) is not stack  # another width: a new stack
    cache.keep_only({"a"})
    assert cache._stacks == {}


def test_reused_step_keys_change_no_token(family_model):
    """The same mixed requests, arriving at different steps, with and without the kept key sets."""
    from acache.engine import EngineConfig, LLMEngine
    from acache.sampling_params import SamplingParams
    from tests.affix.helpers import layouts
    from tests.helpers import run_engine

    prompts = [layouts(seed=s)[k] for s in range(2) for k in ("prefix", "infix", "suffix")]
    params = [SamplingParams(gen_length=(16, 32)[i % 2], block_length=8, threshold=(0.5, 0.9)[i % 2],
                             refresh_interval=(None, 2, None)[i % 3], cache=("dual", "dual", "prefix")[i % 3],
                             selector="attention" if i % 3 != 2 else None, far_mask_window=(None, 1)[i % 2])
              for i in range(6)]
    outs = {}
    for reuse in (False, True):
        engine = LLMEngine(family_model, EngineConfig(page_size=4, kv_cache_memory=1 << 22, max_num_seqs=3,
                                                      reuse_step_keys=reuse))
        outs[reuse] = [o.token_ids for o in run_engine(family_model, prompts, params, [0, 0, 1, 2, 4, 4],
                                                       engine=engine)]
        assert (engine.runner.step_keys is not None) == reuse
    assert outs[True] == outs[False]


def test_focused_steps_read_the_kept_key_set_as_they_read_the_pool(llada_model):
    from acache.engine import EngineConfig, LLMEngine
    from acache.sampling_params import SamplingParams
    from tests.conftest import random_prompts
    from tests.helpers import run_engine

    prompts = random_prompts([7, 12, 3, 9], seed=5)
    params = [SamplingParams(gen_length=(16, 32)[i % 2], block_length=8, threshold=0.5, focus_layers=1,
                             focus_ratio=(0.25, 0.5)[i % 2], far_mask_window=(None, 1)[i % 2]) for i in range(4)]
    outs = [[o.token_ids for o in run_engine(llada_model, prompts, params, [0, 0, 2, 5], engine=LLMEngine(
        llada_model, EngineConfig(page_size=4, kv_cache_memory=1 << 22, reuse_step_keys=reuse)))]
        for reuse in (False, True)]
    assert outs[0] == outs[1]


def test_two_in_block_batches_of_one_step_each_keep_their_stack(llada_model, monkeypatch):
    """Requests of other block lengths step as two batches in one step; they overwrote each other's stack, so
    every step rebuilt both (48 stacks here where each alone builds 1 and 8). Their tokens stay each one's alone."""
    from acache.engine import EngineConfig, LLMEngine
    from acache.engine import step_keys as module
    from acache.sampling_params import SamplingParams
    from tests.conftest import random_prompts
    from tests.helpers import run_engine

    built = []
    init = module.StackedKV.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(module.StackedKV, "__init__", counted)
    prompts = random_prompts([20, 24], seed=3)
    params = [SamplingParams(gen_length=32, block_length=b, steps=32, remasking="low_confidence", ignore_eos=True)
              for b in (32, 4)]

    def run(indices):
        built.clear()
        engine = LLMEngine(llada_model, EngineConfig(page_size=4, kv_cache_memory=1 << 24, reuse_step_keys=True))
        outs = run_engine(llada_model, [prompts[i] for i in indices], [params[i] for i in indices], engine=engine)
        return len(built), [o.token_ids for o in outs], engine.runner.step_keys

    together, tokens, cache = run([0, 1])
    alone = [run([0]), run([1])]
    assert together == alone[0][0] + alone[1][0] == 9
    assert tokens == [alone[0][1][0], alone[1][1][0]] and cache._stacks == {} and cache.entries == {}


def test_a_request_joining_a_batch_frees_its_old_stack_first(llada_model):
    """A request that stepped alone and now steps with another: its old stack was kept one more step beside the
    new one, three copies of its keys where two are needed."""
    cfg = llada_model.config
    pool = PagePool(cfg, 8, 4, torch.float32, torch.device("cpu"))
    cache = StepKeyCache(pool, cfg.head_dim, cfg.rope_theta)
    a = cache.get("a", 1, torch.tensor([3, 0]), torch.arange(2))
    b = cache.get("b", 1, torch.tensor([5]), torch.arange(1))
    other = cache.get("c", 1, torch.tensor([6]), torch.arange(1))
    cache.stacked(["a"], [a], 4, torch.device("cpu"))
    cache.stacked(["c"], [other], 4, torch.device("cpu"))
    cache.keep_only({"a", "b", "c"})
    cache.stacked(["a", "b"], [a, b], 4, torch.device("cpu"))
    assert set(cache._stacks) == {("a", "b"), ("c",)}
