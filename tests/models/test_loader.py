"""Checkpoint round trips in the upstream layout and clear errors on broken checkpoints."""

from __future__ import annotations

import dataclasses
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


def test_a_checkpoint_says_the_dtype_its_weights_are_stored_in(tmp_path, dream_dir):
    """A bfloat16 model saved without a dtype said float32, and dtype='auto' loaded it at twice the memory."""
    model = load_model(dream_dir, dtype="bfloat16")
    save_checkpoint(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_model(tmp_path / "m", dtype="auto").dtype == torch.bfloat16
    save_checkpoint(model, tmp_path / "f", dtype="float32")
    assert json.loads((tmp_path / "f" / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("change", ["other id", "field left out"])
def test_a_mask_id_that_is_not_the_tokenizers_mask_token_is_refused(tmp_path, blockdiff_dir, change):
    """A Fast-dLLM v2 config without mask_token_id takes upstream's Qwen2.5 id (151665): with a tokenizer whose
    mask token is elsewhere it decoded from the wrong token, silently."""
    from acache import LLM

    root = shutil.copytree(blockdiff_dir, tmp_path / "m")
    config = json.loads((root / "config.json").read_text())
    mask = config["mask_token_id"]
    if change == "other id":
        config["mask_token_id"] = mask - 1
    else:
        del config["mask_token_id"]
        config["vocab_size"] = 151680  # room for upstream's id, so that only the tokenizer can tell
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"mask_token_id \d+ is not the tokenizer's mask token '\|<MASK>\|' "
                                         rf"\(id {mask}\): set mask_token_id to {mask}"):
        LLM(root)


def test_a_checkpoint_written_over_another_loads_as_written(tmp_path, llada_dir):
    """A sharded checkpoint left in the folder loaded in place of a single file written over it (the index comes
    first): a merged LoRA run into the same --out served the earlier run's weights."""
    first, second = load_model(llada_dir), load_model(llada_dir)
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(0.5)
    for shards in ((3, 1), (1, 3), (3, 2)):
        save_checkpoint(first, tmp_path / "m", shards=shards[0])
        save_checkpoint(second, tmp_path / "m", shards=shards[1])
        got = dict(load_model(tmp_path / "m").named_parameters())
        for name, p in second.named_parameters():
            assert torch.equal(got[name], p), (shards, name)
        assert len(list((tmp_path / "m").glob("*.safetensors"))) == shards[1]


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


def test_a_tensor_of_a_layer_the_config_builds_without_it_is_refused(tmp_path, llada_dir, caplog):
    """A bias the config leaves out was ignored with a warning, and another model than the one saved ran (logits
    0.585 apart in the reviewer's case); a tensor of no layer the model has (a stored rotary table) is still only
    named."""
    root = shutil.copytree(llada_dir, tmp_path / "m")
    tensors = load_file(root / "model.safetensors")
    save_file({**tensors, "model.transformer.blocks.0.rotary_emb.inv_freq": torch.ones(4)}, root / "model.safetensors")
    load_model(root)
    assert "ignoring 1 tensors" in caplog.text and "rotary_emb.inv_freq" in caplog.text
    biases = {f"model.transformer.blocks.{i}.k_proj.bias": torch.ones(16) for i in range(2)}
    save_file({**tensors, **biases}, root / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"holds model\.transformer\.blocks\.0\.k_proj\.bias and 1 more, a "
                                              "tensor of a layer the config builds without it"):
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


def _with_config(tmp_path, src, **change):
    root = shutil.copytree(src, tmp_path / "m")
    raw = json.loads((root / "config.json").read_text())
    raw.update(change)
    (root / "config.json").write_text(json.dumps(raw))
    return root


@pytest.mark.parametrize("family, change, message", [
    ("llada", {"d_model": "abc"}, "'d_model' must be a whole number, got 'abc'"),
    ("llada", {"n_layers": 1.7}, "'n_layers' must be a whole number, got 1.7"),
    ("dream", {"eos_token_id": [1, 2]}, "'eos_token_id' must be a whole number, got \\[1, 2\\]"),
    ("dream", {"rope_theta": "big"}, "'rope_theta' must be a number"),
    ("llada", {"rope_theta": 0}, "rope_theta must be a positive number, got 0.0"),
    ("dream", {"rms_norm_eps": -1}, "rms_norm_eps must be a positive number, got -1.0"),
    ("llada", {"d_model": 30, "n_heads": 2, "n_kv_heads": 2}, "the head dimension 15 is odd"),
], ids=["text-int", "fractional-int", "list-int", "text-float", "zero-theta", "negative-eps", "odd-head-dim"])
def test_a_config_field_of_the_wrong_kind_is_named(tmp_path, llada_dir, dream_dir, family, change, message):
    root = _with_config(tmp_path, llada_dir if family == "llada" else dream_dir, **change)
    with pytest.raises(ConfigError, match=message) as err:
        load_model(root)
    assert "config" in str(err.value)


def test_a_null_optional_field_takes_its_default(tmp_path, dream_dir):
    from acache.models.loader import read_config

    root = _with_config(tmp_path, dream_dir, pad_token_id=None, num_key_value_heads=None)
    config = read_config(root)[1]
    assert config.pad_token_id == config.eos_token_id and config.num_kv_heads == config.num_heads


def test_a_config_that_is_not_an_object_is_refused(tmp_path, llada_dir):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    (root / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json holds a list, not an object of fields"):
        load_model(root)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:len(data) // 2], "is not a readable safetensors file"),
    (lambda data: b"not safetensors at all", "is not a readable safetensors file"),
], ids=["cut", "garbage"])
def test_a_damaged_weights_file_is_named(tmp_path, llada_dir, damage, message):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    weights = root / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(root)
    assert str(weights) in str(err.value)


@pytest.mark.parametrize("index, message", [
    ({"weight_map": ["model.safetensors"]}, "its weight_map is not an object"),
    (["weight_map"], "is not a valid safetensors index"),
    ({"weight_map": {"a": 3}}, "its weight_map is not an object"),
], ids=["map-a-list", "index-a-list", "shard-a-number"])
def test_a_malformed_index_is_named(tmp_path, llada_dir, index, message):
    root = shutil.copytree(llada_dir, tmp_path / "m")
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        load_model(root)


def test_devices_and_dtypes_the_engine_cannot_run_are_refused(tmp_path, llada_dir):
    for device in ("meta", "mps"):
        with pytest.raises(ValueError, match=f"device '{device}': this engine runs on cpu or cuda"):
            load_model(llada_dir, device=device)
    root = _with_config(tmp_path, llada_dir, torch_dtype="float64")
    with pytest.raises(ValueError, match="the checkpoint.s dtype .float64. is not one this engine runs; pass a dtype"):
        load_model(root, dtype="auto")
    assert load_model(root, dtype="float32").dtype == torch.float32


def test_a_bad_tokenizer_config_is_named_before_the_weights_load(tmp_path, llada_dir, monkeypatch):
    from acache import LLM

    root = shutil.copytree(llada_dir, tmp_path / "m")
    (root / "tokenizer_config.json").write_text("{'eos_token': 1}")
    monkeypatch.setattr("acache.llm.load_model", lambda *a, **k: pytest.fail("the weights loaded first"))
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        LLM(root)
    with pytest.raises(ValueError, match="max_model_len must be an integer in 1..512"):
        LLM(llada_dir, max_model_len=10_000)


@pytest.mark.parametrize("change, message", [
    ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ({"scale_logits": True}, "scale_logits=true"),
    ({"attention_layer_norm": True}, "attention_layer_norm=true"),
    ({"input_emb_norm": True}, "input_emb_norm=true"),
])
def test_an_olmo_option_llada_leaves_off_is_refused(tmp_path, llada_dir, change, message):
    """Such a checkpoint ran without the option and decoded wrongly, with no error."""
    root = _with_config(tmp_path, llada_dir, **change)
    with pytest.raises(ConfigError, match=f"{message} .* is not supported"):
        load_model(root)


def test_llada_as_shipped_sets_those_options_off(tmp_path, llada_dir):
    """LLaDA-8B's config writes them all, off; multi-query attention means one K/V head."""
    from acache.models.loader import read_config

    off = {"clip_qkv": None, "scale_logits": False, "attention_layer_norm": False, "input_emb_norm": False,
           "multi_query_attention": None}
    written = read_config(_with_config(tmp_path / "a", llada_dir, **off))[1]
    assert dataclasses.replace(written, raw={}) == dataclasses.replace(read_config(llada_dir)[1], raw={})
    config = read_config(_with_config(tmp_path / "b", llada_dir, multi_query_attention=True, n_kv_heads=None))[1]
    assert config.num_kv_heads == 1


@pytest.mark.parametrize("extra", ["layer", "qk-norm"])
def test_tensors_of_layers_the_config_does_not_build_are_refused(tmp_path, llada_dir, dream_dir, extra):
    """A checkpoint with more layers than config.json names, or with a part its layers lack (a Qwen3-style QK
    norm), loaded with a warning and ran a cut-down or different model."""
    if extra == "layer":  # two layers saved, one named
        root = shutil.copytree(llada_dir, tmp_path / "m")
        config = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps({**config, "n_layers": 1}))
        want = r"holds model\.transformer\.blocks\.1\.\S+ and \d+ more"
    else:
        root = shutil.copytree(dream_dir, tmp_path / "m")
        tensors = load_file(root / "model.safetensors")
        norms = {f"model.layers.{i}.self_attn.{w}_norm.weight": torch.ones(16) for i in range(2) for w in "qk"}
        save_file({**tensors, **norms}, root / "model.safetensors")
        want = r"holds model\.layers\.0\.self_attn\.k_norm\.weight and 3 more"
    with pytest.raises(CheckpointError, match=want + r", a tensor of a layer the config builds without it or of a "
                                                     "layer it does not build"):
        load_model(root)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype", None])
def test_auto_takes_the_checkpoints_dtype_where_config_names_it_or_not(tmp_path, llada_dir, key):
    """LLaDA-8B-Instruct's config.json names no dtype, and newer transformers write ``dtype``: its bfloat16 weights
    loaded as float32 under auto."""
    root = save_checkpoint(load_model(llada_dir), tmp_path / "m", dtype="bfloat16")
    config = json.loads((root / "config.json").read_text())
    config.pop("torch_dtype")
    if key is not None:
        config[key] = "bfloat16"
    (root / "config.json").write_text(json.dumps(config))
    assert load_model(root, dtype="auto").dtype == torch.bfloat16


@pytest.mark.parametrize("family, field", [("llada", "weight_tying"), ("llada", "include_qkv_bias"),
                                           ("dream", "tie_word_embeddings"), ("llada", "alibi")])
def test_a_true_false_field_that_is_not_a_boolean_is_refused(tmp_path, llada_dir, dream_dir, family, field):
    """``"false"`` read as true: weight_tying "false" ran with tied embeddings, the checkpoint's output layer
    ignored; alibi "false" was refused as alibi."""
    root = shutil.copytree(llada_dir if family == "llada" else dream_dir, tmp_path / "m")
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, field: "false"}))
    with pytest.raises(ConfigError, match=f"'{field}' must be true or false, got 'false'"):
        load_model(root)


def test_weights_that_do_not_fit_are_a_clear_error_and_shapes_are_read_before_any_memory(tmp_path, llada_dir,
                                                                                        monkeypatch):
    """Running out of memory while the model was allocated was a traceback from the allocator; and a config whose
    sizes the weights do not have was allocated at its sizes first (out of memory, not the shape's message)."""
    def full(self, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to_empty", full)
    with pytest.raises(ValueError, match=r"weights need 0\.0 GiB in float32 on cpu, more than it has free "
                                         r"\(OutOfMemoryError\); pass a smaller --dtype"):
        load_model(llada_dir)
    root = _with_config(tmp_path, llada_dir, d_model=1 << 20)
    with pytest.raises(CheckpointError, match="has shape .* the config implies"):
        load_model(root)  # named from the headers: to_empty, which would fail, is never reached


@pytest.mark.parametrize("change, message", [
    ({"chat_template": ["x"]}, r"chat_template must be a string or a list of"),
    ({"chat_template": 5}, r"chat_template must be a string, got int"),
    ({"eos_token": 5}, r"eos_token must be a token's text .*, got 5"),
    ({"mask_token": "<|no such token|>"}, r"mask_token '<\|no such token\|>' is not in the tokenizer's vocabulary"),
], ids=["template-list", "template-int", "eos-int", "mask-unknown"])
def test_a_malformed_tokenizer_config_field_is_named(tmp_path, llada_dir, change, message):
    """A list template of strings was a traceback (AttributeError) at the first chat; an integer eos_token a
    failure at the first generate that named no field."""
    from acache import LLM

    root = shutil.copytree(llada_dir, tmp_path / "m")
    path = root / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=message):
        LLM(root)


def test_the_mask_token_tokenizer_config_names_must_be_the_configs(tmp_path, llada_dir):
    """The tokenizer's declared mask token was never read: config.json's mask_token_id pointing at another token
    loaded and decoded from an ordinary token."""
    from acache import LLM
    from acache.models import Tokenizer

    root = shutil.copytree(llada_dir, tmp_path / "m")
    tokenizer = Tokenizer.from_dir(root)
    config = json.loads((root / "config.json").read_text())
    mask = config["mask_token_id"]
    name = next(t for t in (tokenizer.decode([i], skip_special_tokens=False) for i in range(3, 50))
                if tokenizer.token_to_id(t) not in (None, mask))
    path = root / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "mask_token": name}))
    with pytest.raises(ValueError, match=rf"mask_token_id {mask} is not the tokenizer's mask token"):
        LLM(root)
