"""Shared fixtures: tiny checkpoints written in the upstream layout by the project itself (random, or trained a
few steps on the task suite so they carry its word-level tokenizer)."""

from __future__ import annotations

import os

import pytest
import torch

from acache.models.checkpoint import make_random_checkpoint
from acache.models.loader import load_model

torch.set_num_threads(2)

# ACACHE_TEST_DEVICE=cuda runs the tests that take family_model / llada_model on a GPU (scripts/gpu_check.sh)
DEVICE = os.environ.get("ACACHE_TEST_DEVICE", "cpu")

# Large enough weights that attention is sharp and greedy decoding varies from token to token.
TEST_STD = 0.15


def tiny_checkpoint(root, family: str, **kw):
    opts = {"layers": 2, "hidden_size": 64, "heads": 4, "kv_heads": 2, "seed": 1, "std": TEST_STD,
            "max_seq_len": 512}
    if family == "blockdiff_ssm":  # no attention: an attention shape is refused
        del opts["kv_heads"]
    opts.update(kw)
    return make_random_checkpoint(family, root, **opts)


@pytest.fixture(scope="session")
def task_model_dir(tmp_path_factory):
    """A 2-layer model trained 3 steps on qa1: the task tokenizer and checkpoint layout, no skill."""
    from acache_lab.train.trainer import ModelShape, TrainConfig, train

    out = tmp_path_factory.mktemp("tiny-task-model")
    train(TrainConfig(out=str(out), steps=3, batch_size=4, warmup=1, bf16=False, tasks=("qa1",),
                      model=ModelShape(layers=2, hidden_size=32, heads=2, intermediate_size=64)), progress=False)
    return out


@pytest.fixture(scope="session")
def llada_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llada"), "llada")


@pytest.fixture(scope="session")
def dream_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("dream"), "dream")


@pytest.fixture(scope="session")
def blockdiff_dir(tmp_path_factory):
    """Fast-dLLM v2's layout with attention blocks of 4, so short prompts already span several of them."""
    return tiny_checkpoint(tmp_path_factory.mktemp("fast-dllm-v2"), "fast_dllm_v2", block_size=4)


@pytest.fixture(scope="session", params=["llada", "dream", "fast_dllm_v2"])
def family_dir(request, llada_dir, dream_dir, blockdiff_dir):
    return {"llada": llada_dir, "dream": dream_dir, "fast_dllm_v2": blockdiff_dir}[request.param]


def _served(path):
    """A test model fused as every engine fuses its model, so a reference path run before an engine's first
    forward multiplies the same matrices as the engine does (bitwise the same on CPU anyway, not on a GPU)."""
    model = load_model(path, device=DEVICE)
    model.fuse_projections()
    return model


@pytest.fixture(scope="session")
def family_model(family_dir):
    return _served(family_dir)


def random_prompts(lengths, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def llada_model(llada_dir):
    return _served(llada_dir)
