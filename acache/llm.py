"""The offline entry point: ``LLM(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from acache.affix.bicache import BiCacheProfile
from acache.affix.chat import chat_prompt
from acache.affix.prompt import GEN, Affix, AffixPrompt, resolve_segments
from acache.affix.store import AffixStore
from acache.engine import EngineConfig, EngineOutput, LLMEngine
from acache.models.loader import load_model, parse_device, parse_dtype
from acache.models.tokenizer import Tokenizer
from acache.outputs import AffixRequestStats, RequestOutput, RequestStats
from acache.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | AffixPrompt | Sequence[object]


def _is_segment_list(prompt: object) -> bool:
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and any(isinstance(s, (str, Affix)) or s is GEN or isinstance(s, (list, tuple)) for s in prompt))


def _as_prompt_list(prompts: object) -> list:
    """One prompt or a list of prompts, as a list. A list holding an Affix or GEN at its top level is one
    segment prompt; a list of ints (or an array of token ids) is one token-id prompt."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):
        prompts = prompts.tolist()
    if isinstance(prompts, (str, AffixPrompt)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            return []
        if any(isinstance(p, Affix) or p is GEN for p in prompts) or all(
                isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [prompts]
        return [p.tolist() if hasattr(p, "tolist") else p for p in prompts]
    raise TypeError(f"prompts must be text, token ids, an AffixPrompt, segments, or a list of these; "
                    f"got {type(prompts).__name__}")


class LLM:
    """A diffusion LM loaded from a local checkpoint directory, ready to generate.

    Every request runs on the paged engine, whatever its cache policy or affix policy, at most
    ``max_batch_size`` at a time, in a KV pool of ``kv_cache_memory`` bytes (default 1 GiB on CPU,
    ``gpu_memory_utilization`` of free memory on CUDA) with pages of ``page_size`` tokens. ``seed`` seeds the
    sampling noise of requests whose :class:`SamplingParams` carry no seed of their own.
    Shared affixes live in the engine's pool (one copy each, evicted when no request holds them);
    ``affix_cache_dir`` loads a saved affix cache into it at start. ``affix_cache_bytes`` bounds the dense
    store that keeps BiCache's affix hidden states (None: unbounded); ``bicache_profile`` is the depth table
    for ``affix_policy='bicache-profiled'``.
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 max_batch_size: int = 8, seed: int = 0, affix_cache_bytes: int | None = None,
                 affix_cache_dir: str | Path | None = None, bicache_profile: str | Path | None = None,
                 page_size: int = 16, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.5) -> None:
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype)
        self.model_path = Path(model)
        self.model = load_model(model, dtype=self.dtype, device=self.device)
        self.tokenizer = Tokenizer.from_dir(model)
        self.config = self.model.config
        self.max_batch_size = max_batch_size
        self.affix_store = AffixStore(self.model, affix_cache_bytes)
        self.bicache_profile = BiCacheProfile.load(bicache_profile, self.model) if bicache_profile else None
        self._rng = torch.Generator().manual_seed(seed)
        self._next_request_id = 0
        self.engine_config = EngineConfig(page_size=page_size, kv_cache_memory=kv_cache_memory,
                                          gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_batch_size)
        self._engine: LLMEngine | None = None
        if affix_cache_dir is not None:
            self.engine.affixes.load(affix_cache_dir)

    @property
    def engine(self) -> LLMEngine:
        """The paged engine, built on first use."""
        if self._engine is None:
            self._engine = LLMEngine(self.model, self.engine_config, self.stop_token_ids, self.affix_store,
                                     self.bicache_profile)
        return self._engine

    def save_affix_cache(self, path: str | Path) -> Path:
        """Saves every shared affix the engine holds, for a later ``LLM(..., affix_cache_dir=path)``."""
        return self.engine.affixes.save(path)

    @property
    def stop_token_ids(self) -> set[int]:
        """The config's EOS plus the tokenizer's end-of-turn token."""
        ids = {self.config.eos_token_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _encode_segment(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: PromptInput, chat: bool = False) -> AffixPrompt:
        """Any accepted prompt form as an :class:`AffixPrompt` (which may hold no affix)."""
        if chat and not isinstance(prompt, str):
            raise ValueError("chat=True applies to text prompts; for a chat with affixes build the prompt with "
                             "LLM.chat_prompt(messages)")
        if isinstance(prompt, AffixPrompt):
            ids = list(prompt.token_ids)
            resolved = prompt
        elif isinstance(prompt, str):
            if chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(prompt)
            resolved = AffixPrompt(tuple(ids), len(ids))
        elif _is_segment_list(prompt) and not all(isinstance(t, int) for t in prompt):
            resolved = resolve_segments(prompt, self._encode_segment)
            ids = list(resolved.token_ids)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            resolved = None
        else:
            raise TypeError(f"a prompt must be text, token ids, an AffixPrompt or a segment list, "
                            f"got {type(prompt).__name__}")
        vocab = self.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is not in the model's vocabulary of {vocab}")
        return resolved or AffixPrompt(tuple(ids), len(ids))

    def chat_prompt(self, messages: list[dict[str, str]], affix_messages: Iterable[int] | None = None
                    ) -> AffixPrompt:
        """A chat rendered through the model's template, with the chosen messages (default: the system
        prompt) as affixes; consecutive chosen messages share one affix."""
        def render(msgs, add_generation_prompt):
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)

        return chat_prompt(messages, render, self._encode_segment, affix_messages)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, chat: bool = False,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for each prompt; outputs come back in prompt order.

        A prompt is text, token ids, an :class:`AffixPrompt`, or a list of segments (text, token ids,
        :class:`Affix`, ``GEN``). ``sampling_params`` is one :class:`SamplingParams` for every prompt or a
        list of them, one per prompt. With ``affix_policy`` set, affixes are taken from the shared store
        and only anchors are recomputed; otherwise affix tokens are computed like the rest. A request
        that fails alone (its output's ``error`` says why) does not stop the others.
        """
        prompts = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        texts = [p if isinstance(p, str) else None for p in prompts]
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        for i, (p, params) in enumerate(zip(encoded, params_list, strict=True)):
            p.check_fits(self.config.vocab_size, self.config.max_position_embeddings, params.gen_length, f"prompt {i}")
        done = self._run_engine(encoded, params_list, use_tqdm)
        outputs = []
        for i, (out, params) in enumerate(zip(done, params_list, strict=True)):
            outputs.append(RequestOutput(request_id=self._next_request_id, prompt=texts[i],
                                         prompt_token_ids=list(encoded[i].token_ids),
                                         text=self.tokenizer.decode(out.token_ids), token_ids=out.token_ids,
                                         stats=self._stats(out, params), error=out.error))
            self._next_request_id += 1
        return outputs

    @staticmethod
    def _params_list(sampling_params: object, n: int) -> list[SamplingParams]:
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

    def _run_engine(self, prompts: list[AffixPrompt], params: list[SamplingParams],
                    use_tqdm: bool) -> list[EngineOutput]:
        engine = self.engine
        ids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(engine.add_request(p, sp, generator=self._generator(sp) if sp.temperature > 0 else None))
            done: dict[str, EngineOutput] = {}
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
                while len(done) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        finally:  # an interrupted or refused call leaves nothing behind in the engine
            for rid in ids:
                engine.abort(rid)
        return [done[rid] for rid in ids]

    @staticmethod
    def _stats(out: EngineOutput, params: SamplingParams) -> RequestStats:
        s = out.stats
        affix = None
        if params.affix_policy is not None:
            affix = AffixRequestStats(params.affix_policy, params.anchor_ratio, out.affix_tokens, out.anchors,
                                      out.recomputed_per_refresh, list(s.refresh_times_s), s.selection_time_s,
                                      s.affix_hits, s.affix_queries - s.affix_hits, out.bicache_depth)
        wall = (s.finished or s.arrival) - s.arrival
        return RequestStats(len(out.token_ids), out.nfe, out.refreshes, s.forward_time_s, wall, s.max_batch, affix)

    def _generator(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed)
