"""Fast-dLLM v2 (block diffusion on Qwen2.5): Dream's Qwen2 layout plus a block-causal attention mask.

The upstream checkpoint is Qwen2-shaped (``model.layers.{i}.self_attn.q_proj`` with q/k/v biases, SwiGLU
``mlp``, ``input_layernorm``/``post_attention_layernorm``, ``model.norm``, ``lm_head``), with
``model_type`` ``Fast_dLLM_Qwen``, architecture ``Fast_dLLM_QwenForCausalLM`` and two fields of its own:
``bd_size`` (the block length of its attention mask) and ``mask_token_id``. At inference a token attends
to every block before its own and to its own block both ways, blocks counted from position 0; the token
at ``i`` is predicted from the state at ``i - 1`` (its token shift, as Dream's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from acache.models.config import ConfigError, ModelConfig, require
from acache.models.dream import DreamModel

#: upstream's ``|<MASK>|`` id in the Qwen2.5 vocabulary, the config's default when the field is absent
UPSTREAM_MASK_TOKEN_ID = 151665


class FastDLLMv2Model(DreamModel):
    family = "fast_dllm_v2"
    model_types = ("fast_dllm_qwen",)
    architectures = ("Fast_dLLM_QwenForCausalLM",)
    label = "Fast-dLLM v2"
    hf_model_type = "Fast_dLLM_Qwen"
    block_causal = True

    @classmethod
    def config_from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        block = require(raw, "bd_size", cls.label)
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ConfigError(f"{cls.label} config: bd_size must be a positive integer, got {block!r}")
        config = super().config_from_hf({"mask_token_id": UPSTREAM_MASK_TOKEN_ID, **raw})
        return dataclasses.replace(config, block_size=block)

    @classmethod
    def config_to_hf(cls, config: ModelConfig) -> dict[str, Any]:
        return {**super().config_to_hf(config), "bd_size": config.block_size}
