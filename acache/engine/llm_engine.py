"""The serving engine: add requests, step them with continuous batching, abort them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from acache.affix.prompt import AffixPrompt
from acache.affix.selectors import SELECTORS
from acache.affix.store import AffixStore
from acache.decoding.cache_policy import commits_block_head
from acache.decoding.commit import commit_step
from acache.decoding.generate import truncate_at_stop
from acache.engine.affix_pages import AffixPageTable
from acache.engine.metrics import EngineMetrics
from acache.engine.page_pool import PagePool
from acache.engine.runner import ModelRunner
from acache.engine.scheduler import Scheduler, SchedulerConfig
from acache.engine.sequence import Phase, Sequence, Status
from acache.models.base import DiffusionLM
from acache.sampling_params import SamplingParams

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """``kv_cache_memory`` bytes for the page pool (default: 1 GiB on CPU; on CUDA
    ``gpu_memory_utilization`` of the free memory)."""

    page_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 16384


@dataclass
class EngineOutput:
    request_id: str
    token_ids: list[int]  # cut at the first stop token; for a partial output, the finished blocks so far
    status: Status
    anchors: list[int]  # absolute positions of the recomputed affix tokens
    affix_tokens: int  # shared affix tokens of the request
    recomputed_per_refresh: int
    stats: object  # SequenceStats
    finished: bool = True
    stopped: bool = False  # a stop token ended the output before gen_length


class LLMEngine:
    def __init__(self, model: DiffusionLM, config: EngineConfig | None = None, stop_token_ids: Seq[int] = (),
                 affix_source: AffixStore | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        c = self.config
        memory = c.kv_cache_memory
        if memory is None and model.device.type != "cuda":
            memory = DEFAULT_CPU_KV_BYTES
        self.pool = PagePool.from_budget(model.config, c.page_size, model.dtype, model.device, memory,
                                         c.gpu_memory_utilization)
        self.affixes = AffixPageTable(model, self.pool, affix_source)
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens), self.pool, self.affixes)
        self.runner = ModelRunner(model, self.pool)
        self.stop_token_ids = {model.config.eos_token_id, *stop_token_ids}
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._live: set[str] = set()

    # -- API --------------------------------------------------------------------------------------
    def add_request(self, prompt: AffixPrompt | Seq[int], params: SamplingParams, request_id: str | None = None,
                    generator: torch.Generator | None = None, stream: bool = False) -> str:
        """Queues a request; errors in it are raised here, before anything is queued. With ``stream``,
        :meth:`step` also returns a partial output each time one of its blocks is complete."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.cache != "dual":
            raise ValueError(f"the engine runs the dual cache; cache={params.cache!r} is served by the "
                             "single-request path")
        if params.affix_policy is not None and params.affix_policy not in SELECTORS:
            raise ValueError(f"the engine serves the anchor selectors ({', '.join(SELECTORS)}); "
                             f"{params.affix_policy!r} is served by the single-request path")
        if not isinstance(prompt, AffixPrompt):
            ids = tuple(int(t) for t in prompt)
            prompt = AffixPrompt(ids, len(ids))
        cfg = self.model.config
        prompt.check_fits(cfg.vocab_size, cfg.max_position_embeddings, params.gen_length)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        seq = Sequence(request_id, prompt, params, cfg, self.model.device, generator)
        seq.shifted = self.model.shifted_logits
        seq.stream = stream
        self.scheduler.add(seq)
        self._live.add(request_id)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its pages; True if it was in the engine."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._live.discard(request_id)
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

    def step(self) -> list[EngineOutput]:
        """One scheduling round: batched selections, refreshes and in-block steps; returns what finished
        (and, for streaming requests, partial outputs of blocks just completed)."""
        batch = self.scheduler.schedule()
        finished: list[EngineOutput] = []
        if batch.select:
            self._select(batch.select)
        for phase, group in ((Phase.REFRESH, batch.refresh), (Phase.STEP, batch.step)):
            if not group:
                continue
            x0, conf, elapsed = self.runner.forward(group, phase)
            times = self.metrics.refresh_times_s if phase is Phase.REFRESH else self.metrics.step_times_s
            times.append(elapsed)
            for i, seq in enumerate(group):
                seq.stats.nfe += 1
                seq.stats.forward_time_s += elapsed
                seq.stats.max_batch = max(seq.stats.max_batch, len(group))
                if seq.stats.first_scheduled is None:
                    seq.stats.first_scheduled = time.perf_counter()
                if phase is Phase.REFRESH:
                    seq.stats.refresh_times_s.append(elapsed)
                    self.metrics.refreshed_tokens += seq.recompute_count
                block = seq.block
                if self._commit(seq, x0[i], conf[i]):
                    finished.append(self._finish(seq))
                elif seq.stream and seq.block != block:
                    finished.append(self._partial(seq))
        return finished

    def reset_metrics(self) -> None:
        """Starts a fresh measurement: run metrics, affix hit counts and the KV peak (from what is in use now)."""
        self.metrics = EngineMetrics()
        self.affixes.hits = self.affixes.queries = 0
        self.pool.peak_pages_used = self.pool.num_used

    def summary(self) -> dict:
        return self.metrics.summary(self.pool.peak_pages_used, self.pool.num_used, self.pool.page_bytes,
                                    self.affixes.hits, self.affixes.queries)

    # -- internals --------------------------------------------------------------------------------
    def _select(self, seqs: list[Sequence]) -> None:
        plain = [s for s in seqs if not s.affixes]
        for seq in plain:
            seq.set_anchors(torch.zeros(seq.length, dtype=torch.bool, device=seq.tokens.device))
        reuse = [s for s in seqs if s.affixes]
        if reuse:
            elapsed = self.runner.select(reuse)
            self.metrics.selection_times_s.append(elapsed)
            for seq in reuse:
                seq.stats.selection_time_s = elapsed
                self.metrics.anchors += int(seq.anchors.sum())
                self.metrics.affix_tokens += seq.affix_tokens

    def _commit(self, seq: Sequence, x0: torch.Tensor, conf: torch.Tensor) -> bool:
        start, end = seq.block_cols
        force_head = seq.shifted and commits_block_head("dual", seq.params.refresh_interval)
        tokens, masked = commit_step(seq.rule, seq.tokens[None, start:end], x0[None], conf[None], seq.masked[None],
                                     seq.step, force_head)
        seq.tokens[start:end], seq.masked = tokens[0], masked[0]
        return seq.advance()

    def _partial(self, seq: Sequence) -> EngineOutput:
        done = seq.tokens[seq.gen_start:seq.gen_start + seq.block * seq.params.block_length].tolist()
        ids = truncate_at_stop(done, self.stop_token_ids | set(seq.params.stop_token_ids))
        return EngineOutput(seq.request_id, ids, Status.RUNNING, [], seq.affix_tokens, seq.recompute_count,
                            seq.stats, finished=False, stopped=len(ids) < len(done))

    def _finish(self, seq: Sequence) -> EngineOutput:
        seq.stats.finished = time.perf_counter()
        generated = seq.tokens[seq.gen_start:seq.gen_start + seq.params.gen_length].tolist()
        stops = self.stop_token_ids | set(seq.params.stop_token_ids)
        seq.output = truncate_at_stop(generated, stops)
        anchors = seq.positions[seq.anchors].tolist()
        out = EngineOutput(seq.request_id, seq.output, Status.FINISHED, anchors, seq.affix_tokens,
                           seq.recompute_count, seq.stats, stopped=len(seq.output) < len(generated))
        self.scheduler.finish(seq)
        self._live.discard(seq.request_id)
        self.metrics.requests_finished += 1
        self.metrics.generated_tokens += len(seq.output)
        return out
