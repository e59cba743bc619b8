"""CPU attention two ways at the engine benchmark's shapes: PyTorch's flash kernel (what the engine runs) against
scores by batched matmul, an fp32 softmax and a matmul by V (the heads that share a key head stacked as rows).

It asks whether the slow part of a refresh, attention at a quarter of the linear layers' FLOP/s, could run
through the faster matmul kernels instead. Median of 5 after one untimed call, GFLOP/s counted as
``4 x batch x heads x queries x keys x head_dim``:

    python -m acache_lab.probes.attention_paths
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from acache.cli import _positive_int

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def by_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One request at a time, so the fp32 scores of a request stay small."""
    rep, tq = HEADS // KV_HEADS, q.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        rows = q[b].reshape(KV_HEADS, rep * tq, HEAD_DIM)
        scores = torch.matmul(rows, k[b].transpose(-1, -2)).float() * HEAD_DIM ** -0.5
        out[b] = torch.matmul(scores.softmax(-1).to(q.dtype), v[b]).reshape(HEADS, tq, HEAD_DIM)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=_positive_int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    for tq, tk, what in ((1016, 1016, "a dual-cache refresh"), (456, 1016, "an ACache refresh"),
                         (32, 1016, "an in-block step")):
        q = torch.randn(args.batch, HEADS, tq, HEAD_DIM, dtype=torch.bfloat16)
        k, v = (torch.randn(args.batch, KV_HEADS, tk, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * args.batch * HEADS * tq * tk * HEAD_DIM
        line = []
        for name, fn in (("flash", flash), ("matmul + softmax", by_matmul)):
            fn(q, k, v)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn(q, k, v)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            line.append(f"{name} {t * 1e3:.1f} ms ({flops / t / 1e9:.0f} GFLOP/s)")
        diff = (flash(q, k, v).float() - by_matmul(q, k, v).float()).abs().max().item()
        print(f"{what} (batch {args.batch}, {tq} queries, {tk} keys): " + ", ".join(line) + f"; max |diff| {diff:.4f}")


if __name__ == "__main__":
    main()
