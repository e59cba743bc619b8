"""Continuous batching of diffusion requests, and the one owner of every change of request state.

:meth:`Scheduler.schedule` admits what fits (first come, first served; all the pages a request will
need are taken at once, so it never fails half-way and is never preempted) and groups the running
requests into one anchor selection and a few batched forwards under a token budget.
:meth:`Scheduler.update_from_output` takes the model runner's results back: it fixes anchors and slot
maps, commits tokens, finishes, streams and fails requests.

Forwards are grouped rather than all padded together, by measurement: a refresh feeds the whole
request (hundreds of columns) and an in-block step only its block, so padding steps to refreshes costs
more than the extra forward (BENCHMARKS.md, the heterogeneous row). The groups are refreshes (BiCache
ones by split layer), in-block steps that feed only the block, and the wider steps of the ``none`` and
``prefix`` caches. Inside a group, ragged shapes are padded and masked.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from acache.affix.bicache import BiCacheProfile, bicache_depth
from acache.affix.selectors import drop_uncounted
from acache.decoding.request_state import Phase
from acache.engine.kv_cache_manager import KVCacheManager
from acache.engine.metrics import EngineMetrics
from acache.engine.model_runner import is_engine_fault
from acache.engine.outputs import EngineOutput, ForwardBatch, RunnerOutput, Sample, SchedulerOutput
from acache.engine.request import Request, Status
from acache.engine.state_cache_manager import StateCacheManager

logger = logging.getLogger(__name__)


class StepFailed(Exception):
    """A fault of the machine while a step admitted requests or applied its results: ``cause``, and the ``outputs``
    the step had made before it (finished, failed alone, or a streaming block): a finished or failed request is out
    of the engine, so failing what it still holds would miss it."""

    def __init__(self, cause: BaseException, outputs: list[EngineOutput]) -> None:
        super().__init__(str(cause))
        self.cause, self.outputs = cause, outputs


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


#: A forward pads every request to the widest one fed; past this much padding per real token a batch is split.
MAX_PADDING = 1 / 3


def split_ragged(batch: ForwardBatch, max_padding: float = MAX_PADDING) -> list[ForwardBatch]:
    """Splits a batch whose fed widths differ so much that padding would cost more than a forward: widest
    first, a request joins the current part while the part's padded size stays within ``1 + max_padding``
    of its real tokens (BENCHMARKS.md, the heterogeneous batch: refreshes of mixed anchor ratios)."""
    order = sorted(range(len(batch.requests)), key=lambda i: -len(batch.plans[i].fed))
    parts: list[list[int]] = []
    real = 0
    for i in order:
        width = len(batch.plans[i].fed)
        if parts:
            widest = len(batch.plans[parts[-1][0]].fed)
            if widest * (len(parts[-1]) + 1) <= (1 + max_padding) * (real + width):
                parts[-1].append(i)
                real += width
                continue
        parts.append([i])
        real = width
    return [ForwardBatch([batch.requests[i] for i in sorted(p)], [batch.plans[i] for i in sorted(p)], batch.refresh,
                         batch.split, batch.select) for p in parts]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | StateCacheManager, num_layers: int,
                 metrics: EngineMetrics, bicache_profile: BiCacheProfile | None = None,
                 release: Callable[[str], None] = lambda request_id: None) -> None:
        self.config = config
        self.kv = kv
        self.release = release  # what the runner keeps for a request, dropped when it leaves
        self.num_layers = num_layers
        self.metrics = metrics
        self.bicache_profile = bicache_profile
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """Raises a ValueError naming the problem when ``req`` could never run: a BiCache profile it lacks,
        or more cache than the whole budget."""
        if req.bicache:
            share = sum(a.length for a in req.prompt.affixes) / req.length
            req.bicache_depth = bicache_depth(req.params.selector, req.params.anchor_ratio, self.num_layers,
                                              share, self.bicache_profile)
        self.kv.check(req)

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.kv.free(req)  # whatever a failed admission may have left with it
                req.status = Status.ABORTED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, Status.ABORTED)
                return req
        return None

    def finish(self, req: Request, status: Status = Status.FINISHED) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self.release(req.request_id)
        req.status = status
        req.stats.finished = time.perf_counter()

    # -- schedule -------------------------------------------------------------------------------
    def _admit(self) -> list[EngineOutput]:
        """Admits what fits, in arrival order; returns the outputs of requests whose admission failed. An error of
        one request's own (computing its affix, choosing its anchors at admission) fails that request alone, as
        the runner's do: the others are admitted and step on; only a fault of the machine is raised."""
        failed = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            try:
                if not self.kv.allocate(req):  # all or nothing: what an error took is freed already
                    break
            except Exception as exc:
                if is_engine_fault(exc):  # the requests failed before it are out of the engine: they go with it
                    raise StepFailed(exc, failed) from exc
                self.waiting.popleft()
                failed.append(self._fail_admission(req, exc, running=False))
                continue
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            try:
                self._set_up(req)
            except Exception as exc:
                if is_engine_fault(exc):
                    raise StepFailed(exc, failed) from exc
                failed.append(self._fail_admission(req, exc, running=True))
        return failed

    def _fail_admission(self, req: Request, exc: Exception, running: bool) -> EngineOutput:
        logger.exception("admitting request %s failed; that request fails, the others go on", req.request_id)
        error = f"the engine failed this request: {type(exc).__name__}: {exc}"
        if running:
            return self._fail(req, error)
        req.status, req.error = Status.FAILED, error
        self.metrics.requests_failed += 1
        return self._output(req, Status.FAILED, error=error)

    def _set_up(self, req: Request) -> None:
        """An admitted request's columns: its own, and its anchors where they are known before any forward."""
        if not req.reuse:  # nothing to select: every column is the request's own
            req.state.admit()
        elif req.shared and not req.bicache and (anchors := req.admission_anchors()) is not None:
            # no shared affix takes anchors (direct reuse, ratio 0, exact affixes), or a selector that needs
            # no forward chose them: no selection step
            req.state.admit(req.shared_columns, anchors)
            self.kv.map_slots(req)
            self._count_anchors(req)
        elif req.params.resolved_anchor_pass == "one" and not req.bicache:  # chosen inside the first refresh
            if req.shared:
                req.state.admit(req.shared_columns, select=True)
            else:  # every affix computed with the request: nothing to choose
                req.state.admit()
                self.kv.map_slots(req)

    def schedule(self) -> SchedulerOutput:
        """Admits what fits, then groups the running requests; each group is cut to the token budget
        (always at least one request), in arrival order."""
        out = SchedulerOutput(failed=self._admit())
        budget = self.config.max_num_batched_tokens
        groups: dict[tuple, ForwardBatch] = {}
        used: dict[object, int] = {}
        for req in self.running:
            if req.state.phase is Phase.SELECT:
                key, cost = "select", req.length - sum(s.length for s in req.prompt.affixes)
            else:
                plan = req.state.plan()
                split = self.num_layers - req.bicache_depth if req.bicache and plan.refresh else None
                focus = None if plan.refresh else req.params.focus_layers  # one early depth a forward
                # a selecting forward scores to one depth
                depth = req.params.resolved_anchor_depth if plan.select else None
                key = (plan.refresh, split, len(plan.fed) > req.params.block_length, focus, plan.select, depth)
                cost = self.kv.step_cost(req, plan)
            if used.get(key, 0) and used[key] + cost > budget:
                continue
            used[key] = used.get(key, 0) + cost
            if key == "select":
                out.select.append(req)
                continue
            batch = groups.setdefault(key, ForwardBatch([], [], plan.refresh, split, plan.select))
            batch.requests.append(req)
            batch.plans.append(plan)
        out.forwards = [part for batch in groups.values() for part in split_ragged(batch)]
        return out

    # -- update ---------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineOutput]:
        """Applies the runner's results to the requests; returns what finished or failed (and, for
        streaming requests, partial outputs of blocks just completed). An error applying one request's result
        fails that request alone, as the runner's do; only a fault of the machine ends the step, and the outputs
        of the requests it had finished go with it (:class:`StepFailed`), so that none is lost."""
        outputs: list[EngineOutput] = []
        if sched.select:
            self.metrics.selection_times.add(result.selection_time_s)
        try:
            for req in sched.select:
                outputs += self._contained(req, self._apply_selection, req, result)
            for batch, elapsed in zip(sched.forwards, result.forward_times_s, strict=True):
                (self.metrics.refresh_times if batch.refresh else self.metrics.step_times).add(elapsed)
                if batch.select:
                    self.metrics.selecting_refresh_times.add(elapsed)
                now = time.perf_counter()
                for req in batch.requests:
                    outputs += self._contained(req, self._apply_forward, req, batch, result, elapsed, now)
        except BaseException as exc:
            raise StepFailed(exc, outputs) from exc
        return outputs

    def _contained(self, req: Request, update: Callable[..., list[EngineOutput]], *args) -> list[EngineOutput]:
        """``update(*args)``'s outputs for ``req``; an error of its own (not a fault of the machine) fails it."""
        try:
            return update(*args)
        except Exception as exc:
            if is_engine_fault(exc):
                raise
            logger.exception("applying request %s's step failed; that request fails, the others go on", req.request_id)
            error = f"the engine failed this request: {type(exc).__name__}: {exc}"
            if req in self.running:
                return [self._fail(req, error)]
            return [self._output(req, Status.FAILED, error=error)]  # finished already: its output was not made

    def _apply_selection(self, req: Request, result: RunnerOutput) -> list[EngineOutput]:
        if req.request_id in result.errors:
            return [self._fail(req, result.errors[req.request_id])]
        req.stats.selection_time_s = result.selection_time_s
        if req.stats.first_scheduled is None:
            req.stats.first_scheduled = time.perf_counter()
        anchors = result.anchors[req.request_id]
        if req.bicache:
            req.state.admit()
        else:
            req.state.admit(req.shared_columns, drop_uncounted(anchors, req.shared_spans, req.anchor_counts()))
            self.kv.map_slots(req)
        self._count_anchors(req)
        if req.request_id in result.probe_samples:  # probe_step: the probe decoded the first step
            return self._commit(req, result.probe_samples[req.request_id], probe=True)
        return []

    def _apply_forward(self, req: Request, batch: ForwardBatch, result: RunnerOutput, elapsed: float,
                       now: float) -> list[EngineOutput]:
        if req.request_id in result.errors:
            return [self._fail(req, result.errors[req.request_id])]
        s = req.stats
        s.forward_time_s += elapsed
        s.max_batch = max(s.max_batch, len(batch.requests))
        if s.first_scheduled is None:
            s.first_scheduled = now
        if batch.select:  # the anchors this refresh chose inside its forward
            req.state.fix_anchors(result.anchors[req.request_id])
            self.kv.map_slots(req)
            self._count_anchors(req)
        if batch.refresh:
            s.refresh_times_s.append(elapsed)
            fed = req.state.refresh_fed_count
            s.refreshed_tokens += fed
            self.metrics.refreshed_tokens += fed
        return self._commit(req, result.samples[req.request_id])

    def _count_anchors(self, req: Request) -> None:
        self.metrics.anchors += int(req.state.anchors.sum())
        self.metrics.affix_tokens += req.affix_tokens

    def _commit(self, req: Request, sample: Sample, probe: bool = False) -> list[EngineOutput]:
        """Commits one step's proposals; returns the request's output when it finished, or its partial
        output when a streaming request just completed a block."""
        block = req.state.block
        finished = req.state.commit(*sample, probe=probe)
        if finished or req.state.block != block:
            self._block_done(req)
        if finished:
            return [self._finish(req)]
        if req.stream and req.state.block != block:
            return [self._output(req, Status.RUNNING, finished=False)]
        return []

    def _block_done(self, req: Request) -> None:
        """Times a completed block: the first from the request's arrival (time to first block, a diffusion
        model's time to first token), each later one from the block before it."""
        now = time.perf_counter()
        last = req.stats.last_block
        if last is None:
            self.metrics.first_block_times.add(now - req.stats.arrival)
        else:
            self.metrics.inter_block_times.add(now - last)
        req.stats.last_block = now

    def _output(self, req: Request, status: Status, finished: bool = True, error: str | None = None) -> EngineOutput:
        state = req.state
        ids, stop_token = ([], None) if error else state.output(finished_blocks_only=not finished)
        anchors = state.positions[state.anchors].tolist()  # a partial output's too: a stream cut by a stop string
        refreshes = len(req.stats.refresh_times_s)
        per_refresh = round(req.stats.refreshed_tokens / refreshes) if refreshes else state.recompute_count
        return EngineOutput(req.request_id, ids, status, anchors, req.affix_tokens, per_refresh,
                            req.cached_tokens, req.stats,
                            state.nfe, state.refreshes, req.bicache_depth, finished=finished,
                            stop_token_id=stop_token, error=error)

    def _finish(self, req: Request) -> EngineOutput:
        out = self._output(req, Status.FINISHED)  # before its pages are freed: it reports the affixes it shared
        self.finish(req)
        self.metrics.request_times.add(req.stats.finished - req.stats.arrival)
        self.metrics.requests_finished += 1
        self.metrics.generated_tokens += len(out.token_ids)
        return out

    def _fail(self, req: Request, error: str) -> EngineOutput:
        self.finish(req, Status.FAILED)
        req.error = error
        self.metrics.requests_failed += 1
        return self._output(req, Status.FAILED, error=error)
