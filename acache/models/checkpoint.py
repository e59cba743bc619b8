"""Writes checkpoints in the exact upstream layout: random-weight ones for tests and benchmarks, and
any model the project trains. What is written here goes back through the public loader unchanged."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from torch import nn

from acache.models.base import DiffusionLM
from acache.models.config import AFFIX_TRAINING_KEY, ModelConfig
from acache.models.dream import DreamModel
from acache.models.loader import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, parse_dtype
from acache.models.registry import family_class
from acache.models.ssm import init_scan_model_
from acache.models.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

# Special tokens of each family's tokenizer, in the upstream spelling; ids are assigned at build time.
SPECIAL_TOKENS = {
    "llada": {"bos": "<|startoftext|>", "eos": "<|endoftext|>", "mask": "<|mdm_mask|>",
              "extra": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "stop": "<|eot_id|>"},
    "dream": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "mask": "<|mask|>",
              "extra": ["<|im_start|>", "<|im_end|>"], "stop": "<|im_end|>"},
    "fast_dllm_v2": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "mask": "|<MASK>|",
                     "extra": ["<|im_start|>", "<|im_end|>"], "stop": "<|im_end|>"},
}
# the families of our own layout take the block-diffusion family's Qwen2.5 tokens and chat format
SPECIAL_TOKENS["blockdiff_ssm"] = SPECIAL_TOKENS["r2lm"] = SPECIAL_TOKENS["fast_dllm_v2"]

CHAT_TEMPLATES = {
    "llada": (
        "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
        "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "dream": (
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}
CHAT_TEMPLATES["fast_dllm_v2"] = CHAT_TEMPLATES["blockdiff_ssm"] = CHAT_TEMPLATES["r2lm"] = CHAT_TEMPLATES["dream"]


def build_byte_tokenizer(family: str) -> HFTokenizer:
    """A byte-level tokenizer (every byte a token, no merges) with the family's special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    spec = SPECIAL_TOKENS[family]
    specials = list(dict.fromkeys([spec["bos"], spec["eos"], *spec["extra"], spec["mask"]]))
    tok.add_special_tokens(specials)
    return tok


def tokenizer_config(family: str, tokenizer: HFTokenizer) -> dict:
    spec = SPECIAL_TOKENS[family]
    return {
        "bos_token": spec["bos"],
        "eos_token": spec["stop"],
        "pad_token": spec["eos"],
        "mask_token": spec["mask"],
        "chat_template": CHAT_TEMPLATES[family],
        "model_max_length": None,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "special": True}
            for t in dict.fromkeys([spec["bos"], spec["eos"], *spec["extra"], spec["mask"]])
        },
    }


def save_checkpoint(model: DiffusionLM, out: str | Path, tokenizer: HFTokenizer | None = None,
                    tok_config: dict | None = None, shards: int = 1, dtype: str | torch.dtype | None = None) -> Path:
    """Writes ``model`` (and a tokenizer) to ``out`` under the family's upstream tensor names."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    target = parse_dtype(dtype) if dtype is not None else None
    params = dict(model.named_parameters())
    tensors = {}
    for hf_name, ours in model.hf_tensor_names(model.config).items():
        t = params[ours].detach().to("cpu")
        t = (t.to(target) if target is not None else t).contiguous()
        # a fused projection's weight is a view into its layer's stacked matrix: safetensors stores tensors alone
        tensors[hf_name] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
    hf_config = model.config_to_hf(model.config)
    stored = target if target is not None else next(iter(tensors.values())).dtype  # what "auto" loads it as
    hf_config["torch_dtype"] = str(stored).removeprefix("torch.")
    (root / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    # another checkpoint's weights left in ``out`` would load in place of these: the index before the single file
    for old in (root / INDEX_FILE, root / WEIGHTS_FILE, *root.glob("model-*-of-*.safetensors")):
        old.unlink(missing_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, root / WEIGHTS_FILE, metadata={"format": "pt"})
    else:
        per_shard = -(-len(names) // shards)
        weight_map = {}
        for s in range(shards):
            part = names[s * per_shard:(s + 1) * per_shard]
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, root / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(root / TOKENIZER_FILE))
        (root / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config or {}, indent=2) + "\n")
    return root


def random_config(family: str, vocab_size: int, mask_token_id: int, eos_token_id: int, layers: int = 2,
                  hidden_size: int = 64, heads: int = 4, kv_heads: int | None = None,
                  intermediate_size: int | None = None, max_seq_len: int = 4096,
                  rope_theta: float | None = None, block_size: int | None = None) -> ModelConfig:
    """A family's config at a given shape; ``block_size`` (default 32) only for block-causal families."""
    cls = family_class(family)
    if block_size is not None and not cls.block_causal:
        raise ValueError(f"block_size applies to block-causal families, not {cls.family}")
    return ModelConfig(
        family=cls.family, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads or heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        rope_theta=rope_theta or (500000.0 if cls.family == "llada" else 1000000.0),
        rms_norm_eps=1e-5 if cls.family == "llada" else 1e-6,
        max_position_embeddings=max_seq_len, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
        pad_token_id=eos_token_id, qkv_bias=issubclass(cls, DreamModel),  # Qwen2-shaped: q/k/v biases
        block_size=(block_size or 32) if cls.block_causal else None,
    )


def init_random_(model: DiffusionLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: normal linears and embeddings, norms near one, small biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def family_model(family: str, vocab_size: int, mask_token_id: int, eos_token_id: int, *, layers: int,
                 hidden_size: int, heads: int, kv_heads: int | None = None, intermediate_size: int | None = None,
                 max_seq_len: int | None = None, rope_theta: float | None = None, block_size: int | None = None,
                 **scan: int) -> nn.Module:
    """An uninitialised model of any family at a shape: a transformer family through :func:`random_config`, a
    state-cache family (our own layout) through its ``random_config``, which also takes the ``scan`` options it
    names (``state_size``; ``conv_kernel`` and ``n_groups`` for the state-space variant). ``max_seq_len`` None is
    the family's default (4096; the state-space family's 65536)."""
    cls = family_class(family)
    if issubclass(cls, DiffusionLM):
        if scan:
            raise ValueError(f"{', '.join(sorted(scan))} belong to the state-cache families, not to {cls.family}")
        positions = 4096 if max_seq_len is None else max_seq_len
        return cls(random_config(cls.family, vocab_size, mask_token_id, eos_token_id, layers=layers,
                                 hidden_size=hidden_size, heads=heads, kv_heads=kv_heads,
                                 intermediate_size=intermediate_size, max_seq_len=positions,
                                 rope_theta=rope_theta, block_size=block_size))
    return cls(cls.random_config(vocab_size, mask_token_id, eos_token_id, layers, hidden_size, heads,
                                 intermediate_size, block_size, rope_theta, kv_heads=kv_heads, max_seq_len=max_seq_len,
                                 **scan))


def init_weights_(model: nn.Module, seed: int, std: float = 0.02, scan_init: str = "short") -> None:
    """Deterministic random weights for a model of any family (:func:`init_random_`, or the scans' own with
    their decays as ``scan_init`` names them)."""
    if isinstance(model, DiffusionLM):
        init_random_(model, seed, std)
    else:
        init_scan_model_(model, seed, std, scan_init)


def make_random_checkpoint(family: str, out: str | Path, *, layers: int = 2, hidden_size: int = 64,
                           heads: int = 4, kv_heads: int | None = None, intermediate_size: int | None = None,
                           vocab_size: int | None = None, max_seq_len: int | None = None, seed: int = 0,
                           shards: int = 1, dtype: str = "float32", std: float = 0.02,
                           block_size: int | None = None) -> Path:
    """A random-weight checkpoint in the family's upstream layout, with a byte-level tokenizer."""
    if isinstance(std, bool) or not isinstance(std, int | float) or not math.isfinite(std) or std <= 0:
        raise ValueError(f"std must be a positive finite number, got {std!r}")
    cls = family_class(family)
    tokenizer = build_byte_tokenizer(cls.family)
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = vocab_size or -(-n_tok // 64) * 64
    if vocab < n_tok:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {n_tok} tokens")
    spec = SPECIAL_TOKENS[cls.family]
    model = family_model(cls.family, vocab, tokenizer.token_to_id(spec["mask"]), tokenizer.token_to_id(spec["eos"]),
                         layers=layers, hidden_size=hidden_size, heads=heads, kv_heads=kv_heads,
                         intermediate_size=intermediate_size, max_seq_len=max_seq_len, block_size=block_size)
    init_weights_(model, seed, std)
    return save_checkpoint(model, out, tokenizer, tokenizer_config(cls.family, tokenizer), shards=shards,
                           dtype=dtype)


#: the files besides the weights and config.json that a checkpoint derived from another takes along: the
#: tokenizer's, the generation defaults, and the modelling code (``*.py``) its config's ``auto_map`` names
COPIED_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "generation_config",
                   "chat_template")


def derive_from(source: str | Path, out: str | Path) -> None:
    """Makes the checkpoint just written to ``out`` load like ``source``: the source's config.json keys the engine
    does not write (``auto_map`` and the like) kept under the written ones, its affix-training record left out
    (the written weights are not what was trained), and its tokenizer, generation and modelling files
    (:data:`COPIED_PREFIXES`, ``*.py``) copied."""
    source, out = Path(source), Path(out)
    original = {k: v for k, v in json.loads((source / CONFIG_FILE).read_text()).items() if k != AFFIX_TRAINING_KEY}
    written = json.loads((out / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps({**original, **written}, indent=2) + "\n")
    for file in sorted(source.iterdir()):
        if file.is_file() and (file.name.startswith(COPIED_PREFIXES) or file.suffix == ".py"):
            shutil.copy2(file, out / file.name)
