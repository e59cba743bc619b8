"""The FLOP counter against the arithmetic written out by hand, and the measured matmul peak."""

from __future__ import annotations

import torch

from acache.models.kv import KVCache
from acache_lab.bench.flops import FlopCounter, matmul_peak


def test_counts_layers_attention_and_logits(llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    cfg = model.config
    h, layers, inter = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = h * q_width + 2 * h * kv_width + q_width * h + 3 * h * inter  # q, k, v, o, gate, up, down
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[True, True, True, True], [False, True, True, True]])  # row 1 has one pad
    with torch.inference_mode(), FlopCounter(model) as counter:
        model(ids, torch.arange(4).expand(2, -1), mask)
    fed = 4 + 3
    pairs = 4 * 4 + 3 * 3  # each real token against each valid key of its row
    assert counter.flops == layers * (2 * linear * fed + 4 * q_width * pairs)
    # a forward against a past key set: the past's valid keys count too; then the logits of 3 columns
    past = KVCache([torch.zeros(2, 5, cfg.num_kv_heads, cfg.head_dim)] * layers,
                   [torch.zeros(2, 5, cfg.num_kv_heads, cfg.head_dim)] * layers, torch.arange(5).expand(2, -1) + 4,
                   torch.tensor([[True] * 5, [True, True, False, False, False]]))
    with torch.inference_mode(), FlopCounter(model) as counter:
        out = model(ids, torch.arange(4).expand(2, -1), mask, past=past)
        model.logits(out.hidden, torch.tensor([0, 2, 3]))
    pairs = 4 * (4 + 5) + 3 * (3 + 2)
    assert counter.flops == layers * (2 * linear * fed + 4 * q_width * pairs) + 2 * h * cfg.vocab_size * 2 * 3
    assert "logits" not in vars(model)  # the wrapper is gone after the block
    # no padding anywhere: attention runs without a mask, and the count is the same arithmetic
    with torch.inference_mode(), FlopCounter(model) as counter:
        model(ids, torch.arange(4).expand(2, -1), past=past.columns(slice(0, 2)))
    assert counter.flops == layers * (2 * linear * 8 + 4 * q_width * 8 * (4 + 2))


def test_a_block_causal_model_counts_the_keys_each_block_sees(blockdiff_dir):
    """Block-causal attention (blocks of 4): a token's keys are those of its block and the blocks before it, so
    8 real tokens of one row attend to 4 + 4 + 4 + 4 + 8 + 8 + 8 + 8 keys; a padded token and key count nothing."""
    from acache.models.loader import load_model

    model = load_model(blockdiff_dir)
    cfg = model.config
    h, layers, inter = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = h * q_width + 2 * h * kv_width + q_width * h + 3 * h * inter
    ids = torch.arange(5, 21).view(2, 8)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 7] = False  # row 1: the last token is padding
    with torch.inference_mode(), FlopCounter(model) as counter:
        model(ids, torch.arange(8).expand(2, -1), mask)
    fed = 8 + 7
    pairs = (4 * 4 + 4 * 8) + (4 * 4 + 3 * 7)
    assert counter.flops == layers * (2 * linear * fed + 4 * q_width * pairs)


def test_matmul_peak_is_a_rate():
    rate = matmul_peak(torch.float32, torch.device("cpu"), 64, 64, 64, seconds=0.05)
    assert 1e6 < rate < 1e14
