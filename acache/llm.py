"""The offline entry point: ``LLM(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from acache.decoding.generate import generate
from acache.models.loader import load_model, parse_device, parse_dtype
from acache.models.tokenizer import Tokenizer
from acache.outputs import RequestOutput, RequestStats
from acache.sampling_params import SamplingParams

PromptInput = str | Sequence[int]


class LLM:
    """A diffusion LM loaded from a local checkpoint directory, ready to generate.

    ``max_batch_size`` prompts are decoded together (left-padded); ``seed`` seeds the sampling noise
    of requests whose :class:`SamplingParams` carry no seed of their own.
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 max_batch_size: int = 8, seed: int = 0) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype)
        self.model_path = Path(model)
        self.model = load_model(model, dtype=self.dtype, device=self.device)
        self.tokenizer = Tokenizer.from_dir(model)
        self.config = self.model.config
        self.max_batch_size = max_batch_size
        self._rng = torch.Generator().manual_seed(seed)
        self._next_request_id = 0

    @property
    def stop_token_ids(self) -> set[int]:
        """The config's EOS plus the tokenizer's end-of-turn token."""
        ids = {self.config.eos_token_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode_prompt(self, prompt: PromptInput, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                return self.tokenizer.encode(text, add_special_tokens=False)
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is not in the model's vocabulary of {vocab}")
        return ids

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | None = None, *, chat: bool = False,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for each prompt (text or token ids); outputs come back in prompt order."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        limit = self.config.max_position_embeddings
        for i, ids in enumerate(encoded):
            if len(ids) + params.gen_length > limit:
                raise ValueError(f"prompt {i} is too long: {len(ids)} tokens plus gen_length "
                                 f"{params.gen_length} exceed the model's context of {limit}")
        stops = self.stop_token_ids | set(params.stop_token_ids)
        outputs: list[RequestOutput] = []
        bar = tqdm(total=len(encoded), desc="generate", unit="req", disable=not use_tqdm or len(encoded) < 2)
        for first in range(0, len(encoded), self.max_batch_size):
            batch = encoded[first:first + self.max_batch_size]
            gens = [self._generator(params) for _ in batch] if params.temperature > 0 else None
            result = generate(self.model, batch, params, stops, gens)
            s = result.stats
            for offset, ids in enumerate(result.token_ids):
                i = first + offset
                outputs.append(RequestOutput(
                    request_id=self._next_request_id, prompt=texts[i], prompt_token_ids=encoded[i],
                    text=self.tokenizer.decode(ids), token_ids=ids,
                    stats=RequestStats(len(ids), s.nfe, s.refreshes, s.forward_time_s, s.wall_time_s, len(batch)),
                ))
                self._next_request_id += 1
            bar.update(len(batch))
        bar.close()
        return outputs

    def _generator(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed)
