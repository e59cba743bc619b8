"""The model's logits equal a straightforward re-computation of the same math, written here from the
upstream tensor names alone (fp64 loops over heads, explicit rotary pairs, and for block diffusion an
explicit loop over the block-causal mask)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from acache.models.loader import load_model


def _names(family: str):
    if family == "llada":
        pre = "model.transformer.blocks.{i}."
        return {"embed": "model.transformer.wte.weight", "final_norm": "model.transformer.ln_f.weight",
                "head": "model.transformer.ff_out.weight", "attn_norm": pre + "attn_norm.weight",
                "q": pre + "q_proj", "k": pre + "k_proj", "v": pre + "v_proj", "o": pre + "attn_out.weight",
                "mlp_norm": pre + "ff_norm.weight", "gate": pre + "ff_proj.weight", "up": pre + "up_proj.weight",
                "down": pre + "ff_out.weight"}
    pre = "model.layers.{i}."
    return {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "head": "lm_head.weight",
            "attn_norm": pre + "input_layernorm.weight", "q": pre + "self_attn.q_proj",
            "k": pre + "self_attn.k_proj", "v": pre + "self_attn.v_proj", "o": pre + "self_attn.o_proj.weight",
            "mlp_norm": pre + "post_attention_layernorm.weight", "gate": pre + "mlp.gate_proj.weight",
            "up": pre + "mlp.up_proj.weight", "down": pre + "mlp.down_proj.weight"}


def reference_logits(ckpt, ids: list[int], theta_scale: float = 1.0) -> torch.Tensor:
    """Logits ``[T, V]`` for one unpadded sequence, computed in float64 from the files on disk."""
    raw = json.loads((ckpt / "config.json").read_text())
    family = "llada" if raw["model_type"] == "llada" else "dream"
    sd = {k: v.double() for k, v in load_file(ckpt / "model.safetensors").items()}
    n = _names(family)
    if family == "llada":
        layers, hidden, nh, nkv = raw["n_layers"], raw["d_model"], raw["n_heads"], raw["n_kv_heads"]
    else:
        layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
        nh, nkv = raw["num_attention_heads"], raw["num_key_value_heads"]
    eps, theta = raw["rms_norm_eps"], raw["rope_theta"] * theta_scale
    d = hidden // nh
    t = len(ids)

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def linear(x, name):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    def rotary(x):  # x [T, d]: pair i with i + d/2, angle pos * theta^(-2i/d)
        out = x.clone()
        for p in range(t):
            for i in range(d // 2):
                a = p * theta ** (-2 * i / d)
                c, s = math.cos(a), math.sin(a)
                out[p, i] = x[p, i] * c - x[p, i + d // 2] * s
                out[p, i + d // 2] = x[p, i + d // 2] * c + x[p, i] * s
        return out

    x = sd[n["embed"]][torch.tensor(ids)]
    for layer in range(layers):
        f = {k: v.format(i=layer) for k, v in n.items()}
        h = norm(x, sd[f["attn_norm"]])
        q, k, v = linear(h, f["q"]), linear(h, f["k"]), linear(h, f["v"])
        heads = []
        for head in range(nh):
            kv_head = head // (nh // nkv)
            qh = rotary(q[:, head * d:(head + 1) * d])
            kh = rotary(k[:, kv_head * d:(kv_head + 1) * d])
            vh = v[:, kv_head * d:(kv_head + 1) * d]
            scores = qh @ kh.T / math.sqrt(d)
            if "bd_size" in raw:  # block diffusion: query p sees key j only if j's block is not after p's
                for p in range(t):
                    for j in range(t):
                        if j // raw["bd_size"] > p // raw["bd_size"]:
                            scores[p, j] = float("-inf")
            weights = torch.softmax(scores, dim=-1)
            heads.append(weights @ vh)
        x = x + torch.cat(heads, dim=-1) @ sd[f["o"]].T
        h = norm(x, sd[f["mlp_norm"]])
        gate = h @ sd[f["gate"]].T
        x = x + ((gate * torch.sigmoid(gate)) * (h @ sd[f["up"]].T)) @ sd[f["down"]].T
    logits = norm(x, sd[n["final_norm"]]) @ sd[n["head"]].T
    if family != "llada":  # prediction for position i from the state at i - 1; position 0 keeps its own
        logits = torch.cat([logits[:1], logits[:-1]], dim=0)
    return logits


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_reference(family_dir, seed):
    model = load_model(family_dir)
    ids = torch.randint(0, 260, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None])
    got = model.logits(out.hidden)[0].double()
    want = reference_logits(family_dir, ids)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_reference_is_sensitive_to_rope(family_dir):
    """The comparison above can fail: a slightly different RoPE base moves logits far past 1e-5."""
    model = load_model(family_dir)
    ids = list(range(40, 49))
    got = model.logits(model(torch.tensor([ids]), torch.arange(9)[None]).hidden)[0].double()
    assert (got - reference_logits(family_dir, ids, theta_scale=0.5)).abs().max() > 1e-3
