"""LLaDA (OLMo-derived): upstream config fields and tensor names."""

from __future__ import annotations

from typing import Any

from acache.models.base import DiffusionLM
from acache.models.config import ConfigError, ModelConfig, boolean, integer, number

_FAMILY = "LLaDA"

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "q_proj.weight": "q_proj.weight",
    "k_proj.weight": "k_proj.weight",
    "v_proj.weight": "v_proj.weight",
    "attn_out.weight": "o_proj.weight",
    "ff_norm.weight": "mlp_norm.weight",
    "ff_proj.weight": "gate_proj.weight",
    "up_proj.weight": "up_proj.weight",
    "ff_out.weight": "down_proj.weight",
}


class LLaDAModel(DiffusionLM):
    family = "llada"
    model_types = ("llada",)
    architectures = ("LLaDAModelLM",)
    shifted_logits = False

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        if boolean(raw, "include_bias", _FAMILY, False):
            raise ConfigError("LLaDA config: include_bias=true (biases on every linear layer) is not supported")
        if boolean(raw, "alibi", _FAMILY, False):
            raise ConfigError("LLaDA config: alibi positional bias is not supported, only RoPE")
        if not boolean(raw, "rope", _FAMILY, True):
            raise ConfigError("LLaDA config: rope=false is not supported")
        if raw.get("clip_qkv"):  # a number, or null: OLMo's option LLaDA leaves off
            raise ConfigError(f"LLaDA config: clip_qkv={raw['clip_qkv']!r} (clipping of the query, key and value "
                              "projections) is not supported")
        # OLMo options LLaDA leaves off: a model that sets one would decode wrongly
        for key, what in (("scale_logits", "scaling of the output logits"),
                          ("attention_layer_norm", "layer norms on the queries and keys"),
                          ("input_emb_norm", "scaling of the input embeddings")):
            if boolean(raw, key, _FAMILY, False):
                raise ConfigError(f"LLaDA config: {key}=true ({what}) is not supported")
        for key, expected in (("block_type", "llama"), ("activation_type", "silu"), ("layer_norm_type", "rms")):
            if key in raw and raw[key] != expected:
                raise ConfigError(f"LLaDA config: {key}={raw[key]!r} is not supported (expected {expected!r})")
        d_model = integer(raw, "d_model", _FAMILY)
        n_heads = integer(raw, "n_heads", _FAMILY)
        mlp = integer(raw, "mlp_hidden_size", _FAMILY, None) or integer(raw, "mlp_ratio", _FAMILY, 4) * d_model
        vocab = integer(raw, "embedding_size", _FAMILY, None) or integer(raw, "vocab_size", _FAMILY)
        eos = integer(raw, "eos_token_id", _FAMILY)
        return ModelConfig(
            family=cls.family,
            vocab_size=vocab,
            hidden_size=d_model,
            num_layers=integer(raw, "n_layers", _FAMILY),
            num_heads=n_heads,
            num_kv_heads=integer(raw, "n_kv_heads", _FAMILY,
                                 1 if boolean(raw, "multi_query_attention", _FAMILY, False) else n_heads),
            intermediate_size=mlp,
            rope_theta=number(raw, "rope_theta", _FAMILY, 10000.0),
            rms_norm_eps=number(raw, "rms_norm_eps", _FAMILY, 1e-5),
            max_position_embeddings=integer(raw, "max_sequence_length", _FAMILY),
            mask_token_id=integer(raw, "mask_token_id", _FAMILY),
            eos_token_id=eos,
            pad_token_id=integer(raw, "pad_token_id", _FAMILY, eos),
            qkv_bias=boolean(raw, "include_qkv_bias", _FAMILY, False),
            tie_word_embeddings=boolean(raw, "weight_tying", _FAMILY, False),
            raw=dict(raw),
        )

    @classmethod
    def config_to_hf(cls, config: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": list(cls.architectures),
            "model_type": "llada",
            "activation_type": "silu",
            "alibi": False,
            "block_type": "llama",
            "d_model": config.hidden_size,
            "embedding_size": config.vocab_size,
            "vocab_size": config.vocab_size,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "mask_token_id": config.mask_token_id,
            "include_bias": False,
            "include_qkv_bias": config.qkv_bias,
            "layer_norm_type": "rms",
            "max_sequence_length": config.max_position_embeddings,
            "mlp_hidden_size": config.intermediate_size,
            "n_heads": config.num_heads,
            "n_kv_heads": config.num_kv_heads,
            "n_layers": config.num_layers,
            "rms_norm_eps": config.rms_norm_eps,
            "rope": True,
            "rope_full_precision": True,
            "rope_theta": config.rope_theta,
            "weight_tying": config.tie_word_embeddings,
            "torch_dtype": "float32",
        }

    @classmethod
    def hf_tensor_names(cls, config: ModelConfig) -> dict[str, str]:
        names = {"model.transformer.wte.weight": "embed.weight",
                 "model.transformer.ln_f.weight": "norm.weight"}
        if not config.tie_word_embeddings:
            names["model.transformer.ff_out.weight"] = "lm_head.weight"
        layer_names = dict(_LAYER_NAMES)
        if config.qkv_bias:
            layer_names.update({f"{p}.bias": f"{p}.bias" for p in ("q_proj", "k_proj", "v_proj")})
        for i in range(config.num_layers):
            for hf, ours in layer_names.items():
                names[f"model.transformer.blocks.{i}.{hf}"] = f"layers.{i}.{ours}"
        return names
