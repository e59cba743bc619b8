"""The serving engine: add requests, step them with continuous batching, abort them.

A step is vLLM's loop: ``Scheduler.schedule()`` picks what runs (anchor selections, refreshes,
in-block steps), ``ModelRunner.execute()`` runs it and returns tokens, confidences, anchors and
timings without touching a request, and ``Scheduler.update_from_output()`` applies them. Every
``SamplingParams`` field is per request; any mix of requests decodes each as it would alone, to the rounding of a
batched forward (docs/guide/engine.md: a near-tie can commit another token in another batch).

The attention families keep their K/V in a page pool (``KVCacheManager`` + ``ModelRunner``); the state-cache families
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
from acache.engine.kv_cache_manager import KVCacheManager
from acache.engine.metrics import EngineMetrics
from acache.engine.model_runner import ModelRunner
from acache.engine.outputs import EngineOutput
from acache.engine.page_pool import PagePool
from acache.engine.request import Request
from acache.engine.scheduler import Scheduler, SchedulerConfig, StepFailed
from acache.engine.state_cache_manager import StateCacheManager, check_nothing_after_answer, check_state_request
from acache.engine.state_runner import StateRunner
from acache.models.base import DiffusionLM
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """``kv_cache_memory`` bytes for the page pool, or for the state-cache families' per-request caches (default: 1 GiB
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

    def __post_init__(self) -> None:
        required = ("page_size", "max_num_seqs", "max_num_batched_tokens")
        for name in (*required, "kv_cache_memory", "max_model_len", "max_affix_tokens"):
            value = getattr(self, name)
            if (value is not None or name in required) and (
                    isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer{'' if name in required else ' or None'}, "
                                 f"got {value!r}")
        for name in ("compile", "reuse_step_keys"):
            value = getattr(self, name)
            if not isinstance(value, bool) and (value is not None or name == "compile"):
                raise ValueError(f"{name} must be true or false{'' if name == 'compile' else ' or None'}, "
                                 f"got {value!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, int | float) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def model_len(self, context: int) -> int:
        """Tokens a request may hold, prompt and generation: ``max_model_len``, within the model's context. The
        one place the limit is resolved (the engine, LLM and the server's checks all read it)."""
        if self.max_model_len is not None and self.max_model_len > context:
            raise ValueError(f"max_model_len must be an integer in 1..{context} (the model's context), "
                             f"got {self.max_model_len!r}")
        return self.max_model_len or context

    def kv_budget(self, device: torch.device) -> int:
        """Bytes for the KV pages (or the state-cache families' caches): ``kv_cache_memory``; else 1 GiB off
        CUDA, and on CUDA ``gpu_memory_utilization`` of the memory free now. The one place the budget is set."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * self.gpu_memory_utilization)

    def check_family(self, family: type | DiffusionLM | SSMBlockDiffusionLM | R2LM) -> None:
        """What this configuration asks of a family that it cannot give (a class, before its weights load, or a
        model): torch.compile of a state-cache family, whose layers are not the attention decoder's, or its step keys,
        which it has no pages for."""
        if self.compile and getattr(family, "state_cache", False):
            raise ValueError(f"compile applies to the attention families' decoder layers; a {family.family} "
                             "model runs eagerly (a state-cache family)")
        if self.reuse_step_keys and getattr(family, "state_cache", False):
            raise ValueError(f"reuse_step_keys keeps rotated copies of paged K/V; a {family.family} model keeps "
                             "a cache of its own (a state-cache family)")


class LLMEngine:
    def __init__(self, model: DiffusionLM | SSMBlockDiffusionLM | R2LM, config: EngineConfig | None = None,
                 stop_token_ids: Seq[int] = (),
                 affix_source: AffixStore | None = None, bicache_profile: BiCacheProfile | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.served = False  # a server's loop steps it: nothing else may (the engine is not thread-safe)
        c = self.config
        c.check_family(model)
        self.max_model_len = c.model_len(model.config.max_position_embeddings)
        memory = c.kv_budget(model.device)
        self.state_cache = getattr(model, "state_cache", False)
        self.pool: PagePool | None = None
        if not self.state_cache and hasattr(model, "fuse_projections"):
            model.fuse_projections()  # the same values, fewer matmuls; a no-op when an earlier engine fused them
        if c.compile:
            model.compile_layers()
        if self.state_cache:  # a cache of the model's own per request (the state-cache families)
            self.kv: KVCacheManager | StateCacheManager = StateCacheManager(model, memory)
            self.runner: ModelRunner | StateRunner = StateRunner(model, self.kv)
        else:
            self.pool = PagePool.from_budget(model.config, c.page_size, model.dtype, model.device, memory)
            self.kv = KVCacheManager(model, self.pool, affix_source, c.max_affix_tokens)
            reuse = c.reuse_step_keys if c.reuse_step_keys is not None else model.device.type == "cpu"
            self.runner = ModelRunner(model, self.pool, reuse_step_keys=reuse)
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens), self.kv,
                                   len(model.layers), self.metrics, bicache_profile, self.runner.release)
        self.stop_token_ids = frozenset({model.config.eos_token_id, *stop_token_ids})
        self._ids = itertools.count()
        self.undelivered: list[EngineOutput] = []  # finished by a step that then failed (take_undelivered)

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
        if request_id is None:  # the next id no request in the engine holds (a caller may have named one so)
            request_id = f"req-{next(self._ids)}"
            while self._find(request_id) is not None:
                request_id = f"req-{next(self._ids)}"
        if self._find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if generator is None:
            generator = params.generator(self.model.device)
        elif not isinstance(generator, torch.Generator) or generator.device.type != self.model.device.type:
            found = generator.device if isinstance(generator, torch.Generator) else type(generator).__name__
            raise ValueError(f"generator must be a torch.Generator on the model's device ({self.model.device.type}), "
                             f"got {found}")
        req = self._request(prompt, params, request_id, generator, stream)
        self.scheduler.add(req)
        return request_id

    def check_request(self, prompt: AffixPrompt | Seq[int], params: SamplingParams) -> None:
        """Every check :meth:`add_request` makes, without queuing anything (a server answers 400 with it
        before it starts a stream; ``LLM.generate`` asks it for the whole batch first). It also refuses on the
        user's behalf text after the answer on a block-causal model, which the engine would decode beside, never
        reading it; :meth:`add_request` itself takes such a prompt (its equivalence tests draw every layout)."""
        request = self._request(prompt, params, "", None, False)
        if getattr(self.model, "block_causal", False) and not self.state_cache:  # those refuse it in _request
            check_nothing_after_answer(self.model.family, request.prompt)
        self.scheduler.check(request)

    def _request(self, prompt: AffixPrompt | Seq[int], params: SamplingParams, request_id: str,
                 generator: torch.Generator | None, stream: bool) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, AffixPrompt):  # its ids taken as integers, or named (as_token_ids)
            ids = tuple(prompt)
            prompt = AffixPrompt(ids, len(ids))
        cfg = self.model.config
        prompt.check_fits(cfg.vocab_size, self.max_model_len, params.gen_length)
        if self.state_cache:
            check_state_request(self.model.family, prompt, params)
        if params.affix_reuse(bool(prompt.affixes))[1]:  # BiCache: refused now, not at admission inside a step
            self.kv.store.check_hidden_room()
        if params.focus_layers is not None and params.focus_layers >= len(self.model.layers):
            raise ValueError(f"focus_layers ({params.focus_layers}) focuses the layers after it: it must be below "
                             f"the model's {len(self.model.layers)} layers")
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
        requests, partial outputs of blocks just completed). A fault of the machine is raised; the outputs the
        step made before it are kept for :meth:`take_undelivered`."""
        try:
            sched = self.scheduler.schedule()
        except StepFailed as failed:  # a fault of the machine while admitting: what failed alone before it goes out
            self.undelivered = list(failed.outputs)
            raise failed.cause from None
        if not sched:
            return sched.failed  # requests whose admission failed alone, if any
        try:
            result = self.runner.execute(sched)
            return sched.failed + self.scheduler.update_from_output(sched, result)
        except StepFailed as failed:  # the caller fails what the engine holds; these it no longer does
            self.undelivered = sched.failed + list(failed.outputs)  # a caller that never takes them keeps the last
            raise failed.cause from None
        except BaseException:
            self.undelivered = list(sched.failed)
            raise

    def take_undelivered(self) -> list[EngineOutput]:
        """The outputs of requests a failed step had finished before the fault (see :class:`StepFailed`): a
        caller that fails the requests the engine still holds delivers these too."""
        out, self.undelivered = self.undelivered, []
        return out

    def reset_metrics(self) -> None:
        """Starts a fresh measurement: run metrics, affix hit counts and the KV peak (from what is in use now)."""
        self.metrics = self.scheduler.metrics = EngineMetrics()
        self.affixes.stats.hits = self.affixes.stats.misses = 0
        self.kv.reset_peak()

    def summary(self) -> dict:
        """Run metrics; the cache peak is in pages of the pool (for the state-cache families, whose caches are not
        paged: in bytes)."""
        return self.metrics.summary(*self.kv.memory_usage(), self.affixes.stats.hits, self.affixes.stats.queries)

    def _find(self, request_id: str) -> Request | None:
        for req in (*self.scheduler.running, *self.scheduler.waiting):
            if req.request_id == request_id:
                return req
        return None
