"""Checkpoint round trips in the upstream layout and clear errors on broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from acache.models import CheckpointError, ConfigError, DreamModel, LLaDAModel, Tokenizer, load_model
from acache.models.checkpoint import save_checkpoint
from tests.conftest import tiny_checkpoint

UPSTREAM_NAMES = {
    "llada": ["model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight",
              "model.transformer.blocks.0.attn_norm.weight", "model.transformer.blocks.1.attn_out.weight",
              "model.transformer.blocks.0.ff_proj.weight", "model.transformer.blocks.0.up_proj.weight",
              "model.transformer.blocks.0.ff_out.weight", "model.transformer.blocks.0.ff_norm.weight"],
    "dream": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.o_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.0.post_attention_layernorm.weight"],
}


def _logits(model, ids):
    return model.logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]).hidden)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_upstream_layout(tmp_path, family):
    root = tiny_checkpoint(tmp_path / family, family)
    files = {p.name for p in root.iterdir()}
    assert files == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    names = set(load_file(root / "model.safetensors"))
    assert set(UPSTREAM_NAMES[family]) <= names
    raw = json.loads((root / "config.json").read_text())
    tok = Tokenizer.from_dir(root)
    if family == "llada":
        assert raw["model_type"] == "llada" and raw["architectures"] == ["LLaDAModelLM"]
        assert {"d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "embedding_size",
                "max_sequence_length", "mask_token_id", "weight_tying", "include_bias"} <= set(raw)
        assert raw["mask_token_id"] == tok.token_to_id("<|mdm_mask|>")
    else:
        assert raw["architectures"] == ["DreamModel"]
        assert {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "mask_token_id", "tie_word_embeddings"} <= set(raw)
        assert raw["mask_token_id"] == tok.token_to_id("<|mask|>")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_single_and_sharded_round_trip(tmp_path, family):
    single = tiny_checkpoint(tmp_path / "single", family)
    model = load_model(single)
    assert isinstance(model, {"llada": LLaDAModel, "dream": DreamModel}[family])
    sharded = save_checkpoint(model, tmp_path / "sharded", shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()
    reloaded = load_model(sharded)
    ids = [3, 14, 15, 92, 65, 35]
    assert torch.equal(_logits(model, ids), _logits(reloaded, ids))
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(reloaded.named_parameters())[name]), name


def test_bfloat16_load(llada_dir):
    model = load_model(llada_dir, dtype="bfloat16")
    assert model.embed.weight.dtype == torch.bfloat16
    ids = [1, 2, 3, 4]
    ref = _logits(load_model(llada_dir), ids)
    got = _logits(model, ids)
    assert got.dtype == torch.float32 and (got - ref).abs().max() < 0.25


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nowhere")


def test_missing_config(tmp_path, llada_dir):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    (root / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(root)


def test_missing_weights(tmp_path, llada_dir):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    (root / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(root)


def test_missing_shard(tmp_path, llada_dir):
    root = save_checkpoint(load_model(llada_dir), tmp_path / "m", shards=2)
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(root)


def test_wrong_tensor_shape(tmp_path, dream_dir):
    root = shutil.copytree(dream_dir, tmp_path / "m")
    tensors = load_file(root / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, root / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(7, 64\)"):
        load_model(root)


def test_missing_tensor(tmp_path, llada_dir):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    tensors = load_file(root / "model.safetensors")
    del tensors["model.transformer.blocks.1.v_proj.weight"]
    save_file(tensors, root / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.transformer\.blocks\.1\.v_proj\.weight"):
        load_model(root)


def test_unknown_model_type(tmp_path, llada_dir):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    raw = json.loads((root / "config.json").read_text())
    raw.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (root / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unknown model type 'gpt2'"):
        load_model(root)


def test_missing_config_field(tmp_path, dream_dir):
    root = shutil.copytree(dream_dir, tmp_path / "m")
    raw = json.loads((root / "config.json").read_text())
    del raw["mask_token_id"]
    (root / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="mask_token_id"):
        load_model(root)


def test_unknown_dtype_and_device(llada_dir):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(llada_dir, dtype="float8")
    with pytest.raises(ValueError, match="device"):
        load_model(llada_dir, device="tpu")


def test_tokenizer_and_chat_template(llada_dir, dream_dir):
    tok = Tokenizer.from_dir(llada_dir)
    text = "Where is Mary? é"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "hi"}])
    assert rendered == ("<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.eos_token_id == tok.token_to_id("<|eot_id|>")
    dream = Tokenizer.from_dir(dream_dir)
    assert dream.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="'role' and 'content'"):
        tok.apply_chat_template([{"content": "no role"}])
