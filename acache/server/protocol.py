"""Request bodies of the OpenAI-compatible API, plus the diffusion and affix extras.

Unknown fields are refused (400) rather than ignored, so a client never believes a setting took
effect when it did not. Defaults of the extras: gen_length 128 (or from max_tokens), block_length 32,
threshold 0.9, temperature 0, steps = gen_length, remasking threshold, anchor_ratio 0.2, selector
attention (when an affix is reused), affix_reuse auto (the server's rule, :mod:`acache.server.reuse_gate`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from acache.affix.chat import template_messages
from acache.policies import ANCHOR_PASSES, ANCHOR_QUERIES, COMMIT_RULES, DEFAULT_SELECTOR, SELECTOR_CHOICES
from acache.sampling_params import SamplingParams
from acache.server.stops import stop_list

MAX_LOGPROBS = 20
#: stop strings a request may give, and their length: each block of a stream looks for every one in the text, on
#: the event loop every other request waits on (OpenAI takes 4 stops; lm-eval's ``until`` lists a few)
MAX_STOPS = 64
MAX_STOP_CHARS = 256
MAX_MC_SAMPLES = 1024
DEFAULTS = SamplingParams()
#: the sampling fields a body passes to SamplingParams as they are, when given
PASSED_THROUGH = ("threshold", "remasking", "factor", "anchor_ratio", "anchor_query", "far_mask_window", "focus_layers",
                  "focus_ratio")


class BadRequest(ValueError):
    """A request the server refuses with 400."""


class ModelNotFound(BadRequest):
    """A request for a model this server does not serve: 404 ``model_not_found``, as OpenAI answers it."""


class DiffusionFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1,
                                   description="maps to gen_length (rounded up to whole blocks)")
    temperature: float | None = None
    seed: int | None = None
    stream: bool | None = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="token ids that end the answer, besides "
                                             "the model's EOS (vLLM's field)")
    ignore_eos: bool | None = Field(default=None, description="decode the whole region past the model's EOS "
                                    "(vLLM's field; stop_token_ids still end it)")
    n: int | None = 1
    user: str | None = None
    stream_options: dict | None = None
    gen_length: int | None = None
    block_length: int | None = None
    steps: int | None = None
    threshold: float | None = None
    remasking: Literal[COMMIT_RULES] | None = None
    factor: float | None = None
    anchor_ratio: float | None = None
    far_mask_window: int | None = Field(default=None, description="blocks after the current one attended (far-mask "
                                        "pruning; default all)")
    focus_layers: int | None = Field(default=None, description="FOCUS: layers an in-block step runs on the whole block")
    focus_ratio: float | None = Field(default=None, description="FOCUS: share of a block's masks the later layers keep")
    selector: str | None = Field(default=None, description="anchor selector for reused affixes; 'off' disables reuse")
    anchor_query: Literal[ANCHOR_QUERIES] | None = Field(default=None, description="where ACache's anchor queries "
                                                         "come from: probe (default), full or shallow")
    anchor_pass: Literal[ANCHOR_PASSES] | None = Field(default=None, description="where anchors are chosen: one "
                                                       "(inside the first refresh; the default where the selector "
                                                       "has that form) or two (a selection of its own first; "
                                                       "first-k, random, none and all choose at admission)")
    anchor_depth: float | None = Field(default=None, gt=0, le=1, description="share of the layers a one-pass "
                                       "selection scores through (default 1.0: every layer)")
    probe_step: bool | None = Field(default=None, description="the anchor-selection probe also decodes the first "
                                    "step (one forward fewer); only where an affix is reused")
    affix: str | None = Field(default=None, description="id of an affix registered with POST /v1/affixes")
    affix_reuse: Literal["auto", "off", "always"] | None = Field(
        default=None, description="automatic reuse of spans seen before: auto (the server's rule, default), off "
        "(computed as if never seen), always (reused at once, unchecked: the answer may differ)")
    # OpenAI fields a diffusion model honours only at their neutral value (NEUTRAL says which and why)
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI fields with no effect on decoding, accepted as the API accepts them
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def token_limit(self) -> int | None:
        """The most tokens the answer may have: ``max_tokens``, or chat's ``max_completion_tokens``."""
        return self.max_tokens if self.max_tokens is not None else getattr(self, "max_completion_tokens", None)

    def to_sampling_params(self, reuse: bool, default_selector: str = DEFAULT_SELECTOR) -> SamplingParams:
        """The request's SamplingParams, every field checked here (the body is left as it came):
        ``max_tokens`` becomes whole blocks of gen_length, a reused affix without a ``selector`` takes the served
        model's ``default_selector``. Raises BadRequest naming the request's own fields."""
        if self.n not in (None, 1):
            raise BadRequest("only n=1 is supported")
        stops = stop_list(self.stop)  # an empty string is no stop, and counts as none
        if len(stops) > MAX_STOPS:
            raise BadRequest(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise BadRequest(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of "
                             f"{max(len(stop) for stop in stops)}")
        for name, (neutral, why) in NEUTRAL.items():
            value = getattr(self, name, None)
            if not any(value == ok and type(value) is type(ok) or value is ok for ok in neutral):
                raise BadRequest(f"{name}={value!r} cannot be honoured by this diffusion model: {why}")
        if self.stream_options is not None:
            if not self.stream:
                raise BadRequest("stream_options is only allowed with stream=true")
            unknown = set(self.stream_options) - {"include_usage"}
            if unknown or not isinstance(self.stream_options.get("include_usage", False), bool):
                raise BadRequest(f"stream_options takes include_usage (a bool); got {self.stream_options!r}")
        limit = getattr(self, "max_completion_tokens", None)
        if limit is not None and self.max_tokens is not None and self.max_tokens != limit:
            raise BadRequest(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({limit}) disagree")
        if self.selector is not None and self.selector != "off" and self.selector not in SELECTOR_CHOICES:
            raise BadRequest(f"selector must be one of {', '.join(SELECTOR_CHOICES)} or 'off', got {self.selector!r}")
        max_tokens = self.token_limit
        block = self.block_length if self.block_length is not None else DEFAULTS.block_length
        gen = self.gen_length
        if gen is None and max_tokens is not None:
            if max_tokens <= 0:
                raise BadRequest(f"max_tokens must be positive, got {max_tokens}")
            block = min(block, max_tokens) if self.block_length is None and block > 0 else block
            gen = -(-max_tokens // block) * block if block > 0 else max_tokens
        if gen is None:
            gen = DEFAULTS.gen_length
        elif self.block_length is None and max_tokens is None and 0 < gen < block:
            block = gen  # a short generation region is one block

        selector = self.selector or default_selector
        kwargs = {"gen_length": gen, "block_length": block, "steps": self.steps, "seed": self.seed,
                  "temperature": self.temperature if self.temperature is not None else DEFAULTS.temperature,
                  "selector": selector if reuse and selector != "off" else None}
        kwargs.update({name: getattr(self, name) for name in PASSED_THROUGH if getattr(self, name) is not None})
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.ignore_eos:
            kwargs["ignore_eos"] = True
        if self.probe_step and reuse:  # a chat whose spans are not (yet) shared affixes decodes as usual
            kwargs["probe_step"] = True
        if self.anchor_pass is not None and reuse and kwargs["selector"] is not None:
            kwargs["anchor_pass"] = self.anchor_pass
        if self.anchor_depth is not None and reuse and kwargs["selector"] is not None:
            kwargs["anchor_depth"] = self.anchor_depth
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:  # name the request's fields, not SamplingParams'
            raise BadRequest(str(exc).replace("gen_length", "gen_length (or max_tokens)")) from None


#: field -> (the values a diffusion model honours, why it cannot honour others)
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "top_p": ((None, 1, 1.0), "diffusion decoding takes the most confident token (or a Gumbel-max draw at "
                              "temperature > 0) over the whole vocabulary; nucleus sampling is not implemented"),
    "frequency_penalty": ((None, 0, 0.0), "tokens are committed in parallel and in any order, so there is no "
                                          "left-to-right history to penalise"),
    "presence_penalty": ((None, 0, 0.0), "tokens are committed in parallel and in any order, so there is no "
                                         "left-to-right history to penalise"),
    "logit_bias": ((None, {}), "biasing the logits is not implemented"),
    "best_of": ((None, 1), "only one candidate is decoded per request"),
    "tools": ((None, []), "tool calling is not implemented"),
    "functions": ((None, []), "function calling is not implemented"),
    "tool_choice": ((None, "none"), "tool calling is not implemented"),
    "function_call": ((None, "none"), "function calling is not implemented"),
    "parallel_tool_calls": ((None, False, True), ""),
    "response_format": ((None, {"type": "text"}), "only plain text responses are implemented"),
    "modalities": ((None, ["text"]), "only text is generated"),
    "audio": ((None,), "only text is generated"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "reasoning_effort": ((None,), "the model has no reasoning mode"),
    "web_search_options": ((None,), "web search is not implemented"),
}


class CompletionRequest(DiffusionFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    affix_layout: Literal["prefix", "infix", "suffix"] = Field(
        default="prefix", description="where the registered affix goes: before the prompt, in place of the prompt's "
        "one '<|affix|>' (infix), or after the generation region")
    suffix: str | None = Field(default=None, description="text after the generation region (infilling)")
    max_tokens: int | None = Field(default=None, ge=0, description="maps to gen_length (rounded up to whole "
                                   "blocks); 0 only with echo, to score the prompt")
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="per-token log-likelihood estimates plus this many top tokens")
    mc_samples: int | None = Field(default=None, ge=1, le=MAX_MC_SAMPLES,
                                   description="Monte Carlo draws per split for logprobs (acache.scoring)")
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as the chat template reads it (:func:`acache.affix.chat.template_messages`)."""
        return template_messages([self.model_dump(exclude_none=True)])[0]


class ChatCompletionRequest(DiffusionFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    mc_samples: int | None = Field(default=None, ge=1, le=MAX_MC_SAMPLES,
                                   description="Monte Carlo draws per split for logprobs (acache.scoring)")
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    web_search_options: dict | None = None


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
    add_special_tokens: bool | None = Field(
        default=None, description="the tokenizer's special tokens (a BOS) around the text; by default yes for a "
        "prompt, as /v1/completions encodes it, and no for messages, whose template writes its own")
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
