"""Dream (Qwen2-derived): upstream config fields and tensor names, and shifted logits."""

from __future__ import annotations

from typing import Any, ClassVar

from acache.models.base import DiffusionLM
from acache.models.config import ConfigError, ModelConfig, boolean, integer, number

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.weight": "o_proj.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}


class DreamModel(DiffusionLM):
    family = "dream"
    model_types = ("dream",)
    architectures = ("DreamModel",)
    shifted_logits = True
    #: the family's name in error messages
    label: ClassVar[str] = "Dream"
    #: ``model_type`` written to a checkpoint's config
    hf_model_type: ClassVar[str] = "Dream"

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        if raw.get("rope_scaling"):
            raise ConfigError(f"{cls.label} config: rope_scaling={raw['rope_scaling']!r} is not supported")
        if boolean(raw, "use_sliding_window", cls.label, False):
            raise ConfigError(f"{cls.label} config: sliding-window attention is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{cls.label} config: hidden_act={raw['hidden_act']!r} is not supported "
                              "(expected 'silu')")
        n_heads = integer(raw, "num_attention_heads", cls.label)
        eos = integer(raw, "eos_token_id", cls.label)
        return ModelConfig(
            family=cls.family,
            vocab_size=integer(raw, "vocab_size", cls.label),
            hidden_size=integer(raw, "hidden_size", cls.label),
            num_layers=integer(raw, "num_hidden_layers", cls.label),
            num_heads=n_heads,
            num_kv_heads=integer(raw, "num_key_value_heads", cls.label, n_heads),
            intermediate_size=integer(raw, "intermediate_size", cls.label),
            rope_theta=number(raw, "rope_theta", cls.label, 10000.0),
            rms_norm_eps=number(raw, "rms_norm_eps", cls.label, 1e-6),
            max_position_embeddings=integer(raw, "max_position_embeddings", cls.label),
            mask_token_id=integer(raw, "mask_token_id", cls.label),
            eos_token_id=eos,
            pad_token_id=integer(raw, "pad_token_id", cls.label, eos),
            qkv_bias=True,
            tie_word_embeddings=boolean(raw, "tie_word_embeddings", cls.label, False),
            raw=dict(raw),
        )

    @classmethod
    def config_to_hf(cls, config: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": list(cls.architectures),
            "model_type": cls.hf_model_type,
            "hidden_act": "silu",
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": config.tie_word_embeddings,
            "vocab_size": config.vocab_size,
            "mask_token_id": config.mask_token_id,
            "eos_token_id": config.eos_token_id,
            "bos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def hf_tensor_names(cls, config: ModelConfig) -> dict[str, str]:
        if not config.qkv_bias:
            raise ConfigError(f"{cls.label} checkpoints always carry q/k/v biases")
        names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
        if not config.tie_word_embeddings:
            names["lm_head.weight"] = "lm_head.weight"
        for i in range(config.num_layers):
            for hf, ours in _LAYER_NAMES.items():
                names[f"model.layers.{i}.{hf}"] = f"layers.{i}.{ours}"
        return names
