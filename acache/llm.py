"""The offline entry point: ``LLM(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from acache.affix.bicache import BiCacheProfile
from acache.affix.persistence import LoadReport
from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.engine import EngineConfig, EngineOutput, LLMEngine, parallel
from acache.engine.parallel import MirroredEngine, serve_rank
from acache.inputs import InputProcessor, PromptInput, prompt_list, sampling_params_list
from acache.models.checkpoint import SPECIAL_TOKENS
from acache.models.config import affix_training
from acache.models.loader import load_model, parse_device, read_config
from acache.models.tensor_parallel import check_divisible, shard_model
from acache.models.tokenizer import Tokenizer
from acache.outputs import AffixRequestStats, RequestOutput, RequestStats
from acache.policies import DEFAULT_SELECTOR
from acache.sampling_params import SamplingParams

log = logging.getLogger("acache")


class LLM:
    """A diffusion LM loaded from a local checkpoint directory, ready to generate.

    Every request runs on the paged engine, whatever its cache policy or selector, at most
    ``max_batch_size`` at a time, in a KV pool of ``kv_cache_memory`` bytes (default 1 GiB on CPU,
    ``gpu_memory_utilization`` of free memory on CUDA) with pages of ``page_size`` tokens. ``seed`` seeds the
    sampling noise of requests whose :class:`SamplingParams` carry no seed of their own.
    Shared affixes live in the engine's pool (one copy each, evicted when no request holds them);
    ``affix_cache_dir`` loads a saved affix cache into it at start: strictly by default (a fault anywhere is an
    ``AffixStoreError`` and nothing loads), or, with ``affix_cache_quarantine``, as a server must: each fault
    is moved into the directory's ``quarantine/`` and the rest loads (``affix_cache_report`` says what was
    set aside; a set-aside affix is recomputed when next used). ``affix_cache_bytes`` bounds the dense
    store that keeps BiCache's affix K/V and hidden states (default 1 GiB; None: unbounded);
    ``bicache_profile`` is the depth table for ``selector='bicache-profiled'``. ``max_affix_tokens`` bounds
    the tokens the shared affixes hold in the pool (None: as much as the pool has free).
    ``tensor_parallel_size`` K > 1 splits every layer over K processes (gloo on CPU, nccl on CUDA, one GPU
    each), spawned here and stopped by :meth:`close`; ``tensor_parallel_rank`` is set only in those processes.
    ``compile`` runs the decoder layers through ``torch.compile`` (attention families; see ``EngineConfig``).
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 max_batch_size: int = 8, seed: int | None = 0, affix_cache_bytes: int | None = 1 << 30,
                 affix_cache_dir: str | Path | None = None, bicache_profile: str | Path | None = None,
                 page_size: int = 16, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 max_affix_tokens: int | None = None, tensor_parallel_size: int = 1,
                 tensor_parallel_rank: tuple | None = None, compile: bool = False,
                 affix_cache_quarantine: bool = False) -> None:
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None (a fresh seed), got {seed!r}")
        if seed is None:  # drawn here, once: tensor-parallel ranks are given this one
            seed = int(torch.randint(0, 2**62, (1,)))
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
                or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        self.device = parse_device(device)
        if self.device.type == "cuda" and tensor_parallel_rank is None and \
                tensor_parallel_size > torch.cuda.device_count():  # else a rank dies alone and rank 0 waits 10 min
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size} runs one rank a GPU, and this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        self.model_path = Path(model)
        engine_config = EngineConfig(page_size=page_size, kv_cache_memory=kv_cache_memory,
                                     gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_batch_size,
                                     max_model_len=max_model_len, max_affix_tokens=max_affix_tokens, compile=compile)
        family, model_config = read_config(model)
        engine_config.check_family(family)  # before the weights load, as the tokenizer and the context length
        self.tokenizer = Tokenizer.from_dir(model)
        check_mask_token(family.family, model_config.mask_token_id, self.tokenizer)
        self.max_model_len = engine_config.model_len(model_config.max_position_embeddings)
        state_cache = getattr(family, "state_cache", False)  # a cache of the family's own, no affix K/V
        if state_cache:
            for name, value in (("tensor_parallel_size", tensor_parallel_size != 1),
                                ("affix_cache_dir", affix_cache_dir), ("bicache_profile", bicache_profile)):
                if value:
                    raise ValueError(f"{name} is not supported for a {family.family} model (it shares no affix "
                                     "K/V and runs on one device)")
        self.tensor_parallel_size = tensor_parallel_size
        self._tp_workers: list = []
        self._channel = None
        self._closed = False
        tp = None
        if tensor_parallel_size != 1 or tensor_parallel_rank is not None:
            check_divisible(model_config, tensor_parallel_size)
            if affix_cache_dir is not None:
                raise ValueError("affix_cache_dir is not supported with tensor parallelism (each rank holds a "
                                 "slice of every affix)")
            tp, self._channel = self._join_group(tensor_parallel_rank, dict(
                dtype=dtype, device=device, max_batch_size=max_batch_size, seed=seed,
                affix_cache_bytes=affix_cache_bytes, bicache_profile=bicache_profile, page_size=page_size,
                kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len, max_affix_tokens=max_affix_tokens, compile=compile))
            if self.device.type == "cuda":
                self.device = torch.device("cuda", tp.rank)
        try:
            self.model = load_model(model, dtype=dtype, device=self.device)
            # checked against the whole model, as it was profiled: a shard's fingerprint is another
            self.bicache_profile = BiCacheProfile.load(bicache_profile, self.model) if bicache_profile else None
            if tp is not None:
                shard_model(self.model, tp)
                engine_config = replace(engine_config, kv_cache_memory=self._channel.agree_min(
                    engine_config.kv_budget(self.device)))
        except BaseException:  # a rank-0 failure at start leaves no worker and no group behind: they wait on it in
            self._stop_workers(terminate=True)  # a collective it will not join, so they are ended, not waited for
            raise
        self.dtype = self.model.dtype
        self.config = self.model.config
        self.inputs = InputProcessor(self.tokenizer, self.config, self.max_model_len)
        self.max_batch_size = max_batch_size
        self.affix_store = None if state_cache else AffixStore(
            self.model, affix_cache_bytes, keep_hidden=True)
        self._rng = torch.Generator().manual_seed(seed)
        self._next_request_id = 0
        self.engine_config = engine_config
        self._engine: LLMEngine | MirroredEngine | None = None
        self.affix_cache_report: LoadReport | None = None
        if affix_cache_dir is not None and affix_cache_quarantine:
            self.affix_cache_report = self.engine.affixes.recover(affix_cache_dir)
        elif affix_cache_dir is not None:
            self.affix_cache_report = LoadReport(self.engine.affixes.load(affix_cache_dir))
        if tp is not None and tp.rank > 0:
            serve_rank(self.engine, self._channel)  # a worker rank: replays rank 0's engine until it stops
            parallel.leave()

    def _join_group(self, rank: tuple | None, kwargs: dict):
        """Rank 0 (``rank`` None) spawns the other ranks and joins; a spawned rank joins with its own."""
        if rank is None:
            tp, channel, self._tp_workers = parallel.start(self.tensor_parallel_size, self.device, _tp_worker,
                                                           (str(self.model_path), kwargs))
            return tp, channel
        return parallel.join(*rank)

    def close(self) -> None:
        """Stops the tensor-parallel ranks (a no-op without tensor parallelism). Call it when no other thread
        is stepping the engine (the server's engine thread has stopped)."""
        if self._channel is not None and self._tp_workers:
            told = _within(STOP_GRACE_S, self._channel.send, ("stop",))
            if told is not True:  # a rank gone, or alive and stuck: the others are stopped all the same
                log.warning("could not tell the tensor-parallel ranks to stop (%s); terminating them",
                            told or f"no answer in {STOP_GRACE_S} s")
            self._engine = None
            self._closed = True
            self._stop_workers(terminate=told is not True)

    def _stop_workers(self, terminate: bool = False) -> None:
        """Waits for the ranks to end (``terminate``: ends them first), then leaves the group."""
        for p in self._tp_workers:
            if terminate:
                p.terminate()
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self._tp_workers = []
        self._channel = None
        parallel.leave()

    @property
    def engine(self) -> LLMEngine:
        """The paged engine, built on first use."""
        if self._closed:
            raise RuntimeError("this LLM was closed: its tensor-parallel ranks are gone")
        if self._engine is None:
            engine = LLMEngine(self.model, self.engine_config, self.stop_token_ids, self.affix_store,
                               self.bicache_profile)
            self._engine = MirroredEngine(engine, self._channel) if self._tp_workers else engine
        return self._engine

    def save_affix_cache(self, path: str | Path, lock: AbstractContextManager | None = None) -> Path:
        """Saves every shared affix the engine holds, for a later ``LLM(..., affix_cache_dir=path)``. ``lock`` is
        held while the affixes are copied off the engine's pages (a server's engine lock), not while they are
        written."""
        if self.tensor_parallel_size > 1:
            raise ValueError("saving the affix cache is not supported with tensor parallelism (each rank holds a "
                             "slice of every affix)")
        with lock if lock is not None else nullcontext():
            snapshot = self.engine.affixes.snapshot()
        return self.engine.affixes.save(path, snapshot)

    @property
    def default_selector(self) -> str:
        """How affixes are reused when a request does not say: by direct reuse (no anchors, no selection: the
        fastest path) for a model trained to be reused (``config.affix_training``), else by ACache with
        :data:`acache.policies.DEFAULT_SELECTOR`."""
        return "none" if affix_training(self.config) is not None else DEFAULT_SELECTOR

    @property
    def stop_token_ids(self) -> set[int]:
        """The config's EOS plus the tokenizer's end-of-turn token."""
        ids = {self.config.eos_token_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode_prompt(self, prompt: PromptInput, chat: bool = False) -> AffixPrompt:
        """Any accepted prompt form as an :class:`AffixPrompt` (which may hold no affix)."""
        return self.inputs.encode_prompt(prompt, chat)

    def chat_prompt(self, messages: list[dict[str, str]], affix_messages: Iterable[int] | None = None
                    ) -> AffixPrompt:
        """A chat rendered through the model's template, with the chosen messages (default: the system
        prompt) as affixes; consecutive chosen messages share one affix."""
        return self.inputs.chat_prompt(messages, affix_messages)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, chat: bool = False,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for each prompt; outputs come back in prompt order.

        A prompt is text, token ids, an :class:`AffixPrompt`, or a list of segments (text, token ids,
        :class:`Affix`, ``GEN``). ``sampling_params`` is one :class:`SamplingParams` for every prompt or a
        list of them, one per prompt. With ``selector`` set, affixes are taken from the shared store
        and only anchors are recomputed; otherwise affix tokens are computed like the rest. A request
        that fails alone (its output's ``error`` says why) does not stop the others.
        """
        prompts = prompt_list(prompts)
        params_list = sampling_params_list(sampling_params, len(prompts))
        texts = [p if isinstance(p, str) else None for p in prompts]
        encoded = [self.inputs.encode_prompt(p, chat) for p in prompts]
        for i, (p, params) in enumerate(zip(encoded, params_list, strict=True)):
            self.inputs.check(p, params, f"prompt {i}")
        done = self._run_engine(encoded, params_list, use_tqdm)
        outputs = []
        for i, (out, params) in enumerate(zip(done, params_list, strict=True)):
            outputs.append(RequestOutput(request_id=self._next_request_id, prompt=texts[i],
                                         prompt_token_ids=list(encoded[i].token_ids),
                                         text=self.tokenizer.decode(out.token_ids), token_ids=out.token_ids,
                                         stats=self._stats(out, params), error=out.error,
                                         stop_token_id=out.stop_token_id))
            self._next_request_id += 1
        return outputs

    def _run_engine(self, prompts: list[AffixPrompt], params: list[SamplingParams],
                    use_tqdm: bool) -> list[EngineOutput]:
        engine = self.engine
        if engine.served:
            raise RuntimeError("this LLM's engine is being served (acache.server steps it on its own thread), so "
                               "generate() cannot run beside it: send the request to the server, or build a second "
                               "LLM for offline use")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):  # the whole batch, before any is queued
            try:
                engine.check_request(p, sp)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        ids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
                ids.append(engine.add_request(p, sp, generator=sp.generator(self.device, default_seed=seed)))
            done: dict[str, EngineOutput] = {}
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
                while len(done) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except KeyboardInterrupt:
            if self._tp_workers:  # the other ranks may wait in a collective rank 0 left: they cannot be told
                self._engine, self._closed, ids = None, True, []
                self._stop_workers(terminate=True)
            raise
        finally:  # an interrupted or refused call leaves nothing behind in the engine
            for rid in ids:
                engine.abort(rid)
        return [done[rid] for rid in ids]

    @staticmethod
    def _stats(out: EngineOutput, params: SamplingParams) -> RequestStats:
        s = out.stats
        affix = None
        if params.selector is not None:
            affix = AffixRequestStats(params.selector, params.anchor_ratio, out.affix_tokens, out.anchors,
                                      out.recomputed_per_refresh, list(s.refresh_times_s), s.selection_time_s,
                                      s.affix_hits, s.affix_queries - s.affix_hits, out.bicache_depth,
                                      out.cached_tokens)
        wall = (s.finished or s.arrival) - s.arrival
        return RequestStats(len(out.token_ids), out.nfe, out.refreshes, s.forward_time_s, wall, s.max_batch, affix)


STOP_GRACE_S = 30.0  # how long close() waits for the ranks to take its "stop"


def _within(seconds: float, call, *args) -> bool | str | None:
    """``call(*args)`` on a thread of its own: True once it returned, its error's text if it raised, None if it
    was still running after ``seconds`` (it is left to its thread, a daemon)."""
    result: list = []

    def run() -> None:
        try:
            call(*args)
            result.append(True)
        except Exception as exc:
            result.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def _tp_worker(rank: int, world_size: int, init_method: str, backend: str, model: str, kwargs: dict) -> None:
    """Entry point of a spawned tensor-parallel rank: an LLM that serves rank 0's engine calls, then exits. It
    ignores Ctrl-C, which the terminal sends to every process of the group: rank 0 decides when it stops (a
    shutdown's grace period still needs it), and stops it with ``stop`` or terminates it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    LLM(model, tensor_parallel_size=world_size, tensor_parallel_rank=(rank, world_size, init_method, backend),
        **kwargs)


def check_mask_token(family: str, mask_token_id: int, tokenizer: Tokenizer) -> None:
    """The config's mask id is the tokenizer's mask token: the one tokenizer_config.json names (``mask_token``), else
    the family's one where the vocabulary has it (a Fast-dLLM v2 config without the field takes upstream's Qwen2.5
    id): a mismatch would decode from the wrong token, silently."""
    name = tokenizer.mask_token or SPECIAL_TOKENS.get(family, {}).get("mask")
    found = tokenizer.token_to_id(name) if name else None
    if tokenizer.mask_token is not None and found is None:
        raise ValueError(f"tokenizer_config.json's mask_token {name!r} is not in the tokenizer's vocabulary")
    if found is not None and found != mask_token_id:
        raise ValueError(f"config.json's mask_token_id {mask_token_id} is not the tokenizer's mask token {name!r} "
                         f"(id {found}): set mask_token_id to {found} in config.json")
