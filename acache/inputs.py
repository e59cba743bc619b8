"""The one input processor: every prompt form turned into a validated request, for ``LLM`` and the server.

Text, token ids, segment lists with affixes, chats (with affix messages) and ``AffixPrompt`` all become an
:class:`AffixPrompt` here; text goes through the model's tokenizer (a word it has no token for is a
ValueError naming it) and chats through the model's own template; :meth:`InputProcessor.check` makes the
checks of a request against the model (vocabulary, context) that the engine repeats with the pool.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch

from acache.affix.chat import chat_prompt
from acache.affix.prompt import GEN, Affix, AffixPrompt, resolve_segments
from acache.models.config import ModelConfig
from acache.models.tokenizer import Tokenizer
from acache.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | AffixPrompt | Sequence[object]


def _is_segment_list(prompt: object) -> bool:
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and any(isinstance(s, (str, Affix)) or s is GEN or isinstance(s, (list, tuple)) for s in prompt))


def _is_token_id(value: object) -> bool:
    """One token id: any integer, a 0-d integer tensor too (a list of a tensor's items); not a bool."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() \
            and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prompt_list(prompts: object) -> list:
    """One prompt or a list of prompts, as a list. A list holding an Affix or GEN at its top level is one
    segment prompt; a list of ints (or an array of token ids) is one token-id prompt."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):
        prompts = prompts.tolist()
    if isinstance(prompts, (str, AffixPrompt)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            return []
        if any(isinstance(p, Affix) or p is GEN for p in prompts) or all(map(_is_token_id, prompts)):
            return [prompts]
        return [p.tolist() if hasattr(p, "tolist") else p for p in prompts]
    raise TypeError(f"prompts must be text, token ids, an AffixPrompt, segments, or a list of these; "
                    f"got {type(prompts).__name__}")


def sampling_params_list(sampling_params: object, n: int) -> list[SamplingParams]:
    """One SamplingParams for every prompt, or a list of them, one per prompt (None: the defaults)."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts; give one "
                             "SamplingParams, or one per prompt")
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        return list(sampling_params)
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                    f"got {type(sampling_params).__name__}")


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, config: ModelConfig, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len or config.max_position_embeddings

    def encode_text(self, text: str) -> list[int]:
        """A text segment's ids (no special tokens); a ValueError names the words it has no token for."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def encode_prompt(self, prompt: PromptInput, chat: bool = False) -> AffixPrompt:
        """Any accepted prompt form as an :class:`AffixPrompt` (which may hold no affix)."""
        if chat and not isinstance(prompt, str):
            raise ValueError("chat=True applies to text prompts; for a chat with affixes build the prompt with "
                             "LLM.chat_prompt(messages)")
        if isinstance(prompt, AffixPrompt):
            resolved = prompt
        elif isinstance(prompt, str) and chat:  # encoded message by message, as the server's chat encodes it
            resolved = self.chat_prompt([{"role": "user", "content": prompt}], affix_messages=())
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            resolved = AffixPrompt(tuple(ids), len(ids))
        elif _is_segment_list(prompt) and not all(isinstance(t, int) for t in prompt):
            resolved = resolve_segments(prompt, self.encode_text)
        elif isinstance(prompt, (list, tuple)):  # AffixPrompt takes the ids as integers (as_token_ids) or names them
            resolved = AffixPrompt(tuple(prompt), len(prompt))
        else:
            raise TypeError(f"a prompt must be text, token ids, an AffixPrompt or a segment list, "
                            f"got {type(prompt).__name__}")
        vocab = self.config.vocab_size
        bad = next((t for t in resolved.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is not in the model's vocabulary of {vocab}")
        return resolved

    def chat_prompt(self, messages: list[dict[str, str]], affix_messages: Iterable[int] | None = None
                    ) -> AffixPrompt:
        """A chat rendered through the model's template, with the chosen messages (default: the system
        prompt) as affixes; consecutive chosen messages share one affix."""
        return chat_prompt(messages, self.render_chat, self.encode_text, affix_messages)

    def check(self, prompt: AffixPrompt, params: SamplingParams, label: str = "prompt") -> None:
        """Raises a ValueError naming the problem when the request cannot run on this model."""
        prompt.check_fits(self.config.vocab_size, self.max_model_len, params.gen_length, label)
