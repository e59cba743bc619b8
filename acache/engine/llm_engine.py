"""The serving engine: add requests, step them with continuous batching, abort them.

A step is vLLM's loop: ``Scheduler.schedule()`` picks what runs (anchor selections, refreshes,
in-block steps), ``ModelRunner.execute()`` runs it and returns tokens, confidences, anchors and
timings without touching a request, and ``Scheduler.update_from_output()`` applies them. Every
``SamplingParams`` field is per request; any mix of requests decodes each exactly as it would alone.

The attention families keep their K/V in a page pool (``KVCacheManager`` + ``ModelRunner``); the scan families
(the state-space variant, R2LM) keep a cache of the model's own per request (``StateCacheManager`` +
``StateRunner``). Both run through the same scheduler and request lifecycle.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from acache.affix.bicache import BiCacheProfile
from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.decoding.blockwise import check_blockwise_request
from acache.engine.kv_cache_manager import KVCacheManager
from acache.engine.metrics import EngineMetrics
from acache.engine.model_runner import ModelRunner
from acache.engine.outputs import EngineOutput
from acache.engine.page_pool import PagePool
from acache.engine.request import Request
from acache.engine.scheduler import Scheduler, SchedulerConfig
from acache.engine.state_cache_manager import StateCacheManager
from acache.engine.state_runner import StateRunner
from acache.models.base import DiffusionLM
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """``kv_cache_memory`` bytes for the page pool, or for the scan families' per-request caches (default: 1 GiB
    on CPU; on CUDA ``gpu_memory_utilization`` of the free memory)."""

    page_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None  # prompt plus generation; None: the model's context
    max_affix_tokens: int | None = None  # tokens the shared affixes may hold; None: as the pool allows
    # in-block steps keep their key set gathered and rotated from refresh to refresh: faster on CPU, where the
    # per-layer gather and rotation dominate a step, at the cost of a dense copy of each stepping request's
    # cached K/V outside the pool; None: on CPU only (on a GPU the memory is worth more than the copy)
    reuse_step_keys: bool | None = None
    # torch.compile the decoder layers (``DiffusionLM.compile_layers``): the first forward of each kind compiles
    # (tens of seconds), later ones run the fused kernels; the attention families only
    compile: bool = False


class LLMEngine:
    def __init__(self, model: DiffusionLM | SSMBlockDiffusionLM | R2LM, config: EngineConfig | None = None,
                 stop_token_ids: Seq[int] = (),
                 affix_source: AffixStore | None = None, bicache_profile: BiCacheProfile | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.served = False  # a server's loop steps it: nothing else may (the engine is not thread-safe)
        c = self.config
        memory = c.kv_cache_memory
        if memory is None and model.device.type != "cuda":
            memory = DEFAULT_CPU_KV_BYTES
        self.state_cache = getattr(model, "state_cache", False)
        self.pool: PagePool | None = None
        if c.compile and self.state_cache:
            raise ValueError(f"compile applies to the attention families' decoder layers; {model.family} "
                             "(a scan family) runs eagerly")
        if not self.state_cache and hasattr(model, "fuse_projections"):
            model.fuse_projections()  # the same values, fewer matmuls; a no-op when an earlier engine fused them
        if c.compile:
            model.compile_layers()
        if self.state_cache:  # a cache of the model's own per request (the scan families)
            if memory is None:
                free, _ = torch.cuda.mem_get_info(model.device)
                memory = int(free * c.gpu_memory_utilization)
            self.kv: KVCacheManager | StateCacheManager = StateCacheManager(model, memory)
            self.runner: ModelRunner | StateRunner = StateRunner(model, self.kv)
        else:
            self.pool = PagePool.from_budget(model.config, c.page_size, model.dtype, model.device, memory,
                                             c.gpu_memory_utilization)
            self.kv = KVCacheManager(model, self.pool, affix_source, c.max_affix_tokens)
            reuse = c.reuse_step_keys if c.reuse_step_keys is not None else model.device.type == "cpu"
            self.runner = ModelRunner(model, self.pool, reuse_step_keys=reuse)
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens), self.kv,
                                   len(model.layers), self.metrics, bicache_profile)
        self.stop_token_ids = frozenset({model.config.eos_token_id, *stop_token_ids})
        self._ids = itertools.count()
        context = model.config.max_position_embeddings
        if c.max_model_len is not None and not 0 < c.max_model_len <= context:
            raise ValueError(f"max_model_len must be in 1..{context} (the model's context), got {c.max_model_len}")
        self.max_model_len = c.max_model_len or context

    @property
    def affixes(self):
        """The shared affix pages."""
        return self.kv.affixes

    # -- API --------------------------------------------------------------------------------------
    def add_request(self, prompt: AffixPrompt | Seq[int], params: SamplingParams, request_id: str | None = None,
                    generator: torch.Generator | None = None, stream: bool = False) -> str:
        """Queues a request; errors in it are raised here, before anything is queued. With ``stream``,
        :meth:`step` also returns a partial output each time one of its blocks is complete."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self._find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if generator is None:
            generator = params.generator(self.model.device)
        req = self._request(prompt, params, request_id, generator, stream)
        self.scheduler.add(req)
        return request_id

    def check_request(self, prompt: AffixPrompt | Seq[int], params: SamplingParams) -> None:
        """Every check :meth:`add_request` makes, without queuing anything (a server answers 400 with it
        before it starts a stream)."""
        self.scheduler.check(self._request(prompt, params, "check", None, False))

    def _request(self, prompt: AffixPrompt | Seq[int], params: SamplingParams, request_id: str,
                 generator: torch.Generator | None, stream: bool) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, AffixPrompt):
            ids = tuple(int(t) for t in prompt)
            prompt = AffixPrompt(ids, len(ids))
        cfg = self.model.config
        prompt.check_fits(cfg.vocab_size, self.max_model_len, params.gen_length)
        if self.state_cache:
            check_blockwise_request(self.model.family, prompt, params)
        if params.focus_layers is not None and self.model.shifted_logits:
            raise ValueError(f"focus_layers is not supported for {self.model.family} yet: a shifted-logit model "
                             "predicts a token from the column before it, which FOCUS may have left out")
        return Request(request_id, prompt, params, cfg, self.model.shifted_logits, self.model.device, generator,
                       stream, self.stop_token_ids, self.state_cache)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its pages; True if it was in the engine."""
        if self.scheduler.abort(request_id) is None:
            return False
        self.metrics.requests_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def request_ids(self) -> list[str]:
        return [r.request_id for r in (*self.scheduler.running, *self.scheduler.waiting)]

    def step(self) -> list[EngineOutput]:
        """One round: schedule, execute, update. Returns what finished or failed (and, for streaming
        requests, partial outputs of blocks just completed)."""
        sched = self.scheduler.schedule()
        if not sched:
            return []
        return self.scheduler.update_from_output(sched, self.runner.execute(sched))

    def reset_metrics(self) -> None:
        """Starts a fresh measurement: run metrics, affix hit counts and the KV peak (from what is in use now)."""
        self.metrics = self.scheduler.metrics = EngineMetrics()
        self.affixes.stats.hits = self.affixes.stats.misses = 0
        self.kv.reset_peak()

    def summary(self) -> dict:
        """Run metrics; the cache peak is in pages of the pool (for the scan families, whose caches are not
        paged: in bytes)."""
        return self.metrics.summary(*self.kv.memory_usage(), self.affixes.stats.hits, self.affixes.stats.queries)

    def _find(self, request_id: str) -> Request | None:
        for req in (*self.scheduler.running, *self.scheduler.waiting):
            if req.request_id == request_id:
                return req
        return None
