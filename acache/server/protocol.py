"""Request bodies of the OpenAI-compatible API, plus the diffusion and affix extras.

Unknown fields are refused (400) rather than ignored, so a client never believes a setting took
effect when it did not. Defaults of the extras: gen_length 128 (or from max_tokens), block_length 32,
threshold 0.9, temperature 0, steps = gen_length, remasking threshold, anchor_ratio 0.2, selector
attention (when an affix is reused).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from acache.policies import COMMIT_RULES


class DiffusionFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, description="maps to gen_length (rounded up to whole blocks)")
    temperature: float | None = None
    seed: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    stream_options: dict | None = None
    gen_length: int | None = None
    block_length: int | None = None
    steps: int | None = None
    threshold: float | None = None
    remasking: Literal[COMMIT_RULES] | None = None
    factor: float | None = None
    anchor_ratio: float | None = None
    selector: str | None = Field(default=None, description="anchor selector for reused affixes; 'off' disables reuse")
    affix: str | None = Field(default=None, description="id of an affix registered with POST /v1/affixes")


class CompletionRequest(DiffusionFields):
    prompt: str | list[str] | list[int]
    affix_layout: Literal["prefix", "suffix"] = "prefix"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(DiffusionFields):
    messages: list[ChatMessage] = Field(min_length=1)


class AffixRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = None
    messages: list[ChatMessage] | None = None
    name: str | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
