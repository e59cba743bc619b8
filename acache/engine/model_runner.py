"""Executes a scheduler output: batched anchor selections and forwards through the requests' slot maps.

The runner reads requests and never changes their state; it returns a :class:`RunnerOutput`. Every
forward is ``gather + attention``: each request's key set is read from the pool through its slot map
(shared affix slots and its private slots), padded to the batch's longest and masked. Fresh K/V of a
refresh go to the request's private slots; shared pages are never written.

A fault raised for one request (a bad shape, a selector's error) fails that request alone: the batch is
rerun one request at a time and only the ones that fail alone are reported. A fault of the engine
itself (out of memory, a device error) is raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from acache.affix.bicache import bicache_forward
from acache.affix.context import SelectionContext, request_seed
from acache.affix.one_pass import refresh_selecting, selecting_inputs
from acache.affix.placement import place_affixes
from acache.affix.selectors import make_selector
from acache.decoding.canvas import build_canvas
from acache.decoding.sampler import propose
from acache.engine.focus import focused_step
from acache.engine.kv_cache_manager import KVCacheManager
from acache.engine.outputs import ForwardBatch, RunnerOutput, Sample, SchedulerOutput
from acache.engine.page_pool import PagedKV, PagePool
from acache.engine.request import Request
from acache.engine.step_keys import StepKeyCache
from acache.models.base import DiffusionLM
from acache.policies import QUERY_SELECTORS

logger = logging.getLogger(__name__)


def is_engine_fault(exc: BaseException) -> bool:
    """Faults of the machine, not of one request: they fail the whole batch."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("CUDA error", "device-side assert"))


def _pad(rows: list[torch.Tensor], fill: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((r.numel() for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.long, device=device)
    valid = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
        valid[i, :r.numel()] = True
    return out, valid


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    def __init__(self, model: DiffusionLM, pool: PagePool, reuse_step_keys: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device
        self.step_keys = StepKeyCache(pool, model.config.head_dim, model.config.rope_theta) if reuse_step_keys \
            else None

    def release(self, request_id: str) -> None:
        """What the runner keeps for a request that finished, failed or was aborted."""
        if self.step_keys is not None:
            self.step_keys.drop(request_id)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        if self.step_keys is not None:
            self.step_keys.keep_only({r.request_id for b in sched.forwards if not b.refresh for r in b.requests})
        if sched.select:
            _sync(self.device)
            t0 = time.perf_counter()
            for rid, (anchors, sample) in self._contained(sched.select, self._select, out.errors).items():
                out.anchors[rid] = anchors
                if sample is not None:
                    out.probe_samples[rid] = sample
            _sync(self.device)
            out.selection_time_s = time.perf_counter() - t0
        self.run_forwards(sched, out, lambda batch: self._forward(batch, out.anchors), self.device)
        return out

    @classmethod
    def run_forwards(cls, sched: SchedulerOutput, out: RunnerOutput, forward: Callable[[ForwardBatch], dict],
                     device: torch.device) -> None:
        """Each of the step's forward batches through ``forward``, timed, a failing request failing alone: the
        loop every runner (paged or state-cache) shares."""
        for batch in sched.forwards:
            _sync(device)
            t0 = time.perf_counter()
            out.samples.update(cls._contained(batch.requests, lambda sub, b=batch: forward(b.only(sub)), out.errors))
            _sync(device)
            out.forward_times_s.append(time.perf_counter() - t0)

    @staticmethod
    def _contained(reqs: list[Request], fn: Callable[[list[Request]], dict], errors: dict[str, str]) -> dict:
        """``fn(reqs)``; if it raises for a reason other than an engine fault, each request is run alone
        and those that still raise are put in ``errors`` with their message. Each request alone draws the noise it
        drew in the batch (its generator rewound): one request's fault does not change another's tokens."""
        if not reqs:
            return {}
        drawn = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            return fn(reqs)
        except Exception as exc:
            if is_engine_fault(exc):
                raise
            if len(reqs) == 1:
                errors[reqs[0].request_id] = f"{type(exc).__name__}: {exc}"
                return {}
            # said, so that a batch that fails on every step (a bug, not a bad request) does not pass unseen
            logger.warning("a forward of %d requests failed (%s: %s); running each alone", len(reqs),
                           type(exc).__name__, exc)
        for generator, state in drawn:
            generator.set_state(state)
        results: dict = {}
        for req in reqs:
            try:
                results.update(fn([req]))
            except Exception as exc:
                if is_engine_fault(exc):
                    raise
                errors[req.request_id] = f"{type(exc).__name__}: {exc}"
        return results

    # -- anchor selection -----------------------------------------------------------------------
    def _select(self, reqs: list[Request]) -> dict[str, tuple[torch.Tensor | None, Sample | None]]:
        """Anchors of each request, chosen with the same selector code as the reference path on a
        padded canvas that holds their shared affix K/V; a batch shares a selector, its query source
        and ``gen_length`` (the canvas has one generation region), each row keeps its own ratio. With
        ``probe_step`` a request also gets the probe's proposals for its first step. A BiCache request
        instead gets its affixes' cached K/V copied into its private slots."""
        anchors: dict[str, tuple[torch.Tensor | None, Sample | None]] = {}
        groups: dict[tuple, list[Request]] = {}
        for req in reqs:
            if req.bicache:
                self._place_bicache(req)
                anchors[req.request_id] = (None, None)
                continue
            p = req.params
            query = p.anchor_query if p.selector in QUERY_SELECTORS else None  # the others ignore it
            groups.setdefault((p.selector, query, p.gen_length), []).append(req)
        cfg = self.model.config
        for (name, query, gen_length), group in groups.items():
            canvas = build_canvas([r.prompt.layout for r in group], gen_length, cfg.mask_token_id,
                                  cfg.pad_token_id, self.device)
            own = torch.zeros_like(canvas.valid)
            for row, r in enumerate(group):
                cols = slice(canvas.pad_left[row], canvas.pad_left[row] + r.length)
                canvas.valid[row, cols] &= ~r.state.far_columns()  # far masks are out of selection's forwards too
                own[row, cols] = r.state.base_recompute(r.shared_columns)
            placements = [[(r.prompt.affixes[i].start, a.entry(self.pool)) for i, a in r.shared] for r in group]
            kv, slot = place_affixes(self.model, canvas, placements)
            seeds = [request_seed(r.params.seed, r.prompt.token_ids) for r in group]
            ctx = SelectionContext(self.model, canvas, slot, kv, seeds, own)
            chosen = make_selector(name, query or "probe").select(ctx, [r.params.anchor_ratio for r in group])
            stepping = [r.params.block_length for r in group if r.params.probe_step]
            logits = ctx.probe_logits(max(stepping)) if stepping else None
            for row, req in enumerate(group):
                pad = canvas.pad_left[row]
                cols = slice(pad, pad + req.length)
                sample = None
                if logits is not None and req.params.probe_step:
                    sample = self._propose(req, logits[row:row + 1, :req.params.block_length])
                anchors[req.request_id] = (chosen[row, cols] & (slot[row, cols] >= 0), sample)
        return anchors

    @staticmethod
    def _propose(req: Request, logits: torch.Tensor) -> Sample:
        """One request's proposed tokens and confidences from its ``[1, L, V]`` block logits. One call a request,
        not one for the batch: a reduction over the vocabulary may sum in another order for another number of
        rows, and a request must propose alike batched and alone."""
        gens = [req.generator] if req.params.temperature > 0 else None
        x0, conf = propose(logits, req.params.temperature, gens, mask_token_id=req.state.mask_token_id)
        return x0[0], conf[0]

    def _place_bicache(self, req: Request) -> None:
        for index, entry in req.entries:
            c0, c1 = req.span_columns(index)
            self.pool.write(req.slot_map[c0:c1], entry.keys, entry.values)

    # -- forwards -------------------------------------------------------------------------------
    def _forward(self, batch: ForwardBatch, anchors: dict[str, torch.Tensor]) -> dict[str, Sample]:
        """One batched forward; returns each request's proposed tokens and confidences for its block (and puts
        in ``anchors`` those a ``select`` forward chose)."""
        if batch.select:
            return self._select_forward(batch, anchors)
        reqs, plans, dev = batch.requests, batch.plans, self.device
        trash = self.pool.trash_slot
        fed, fed_valid = _pad([p.fed for p in plans], 0, dev)
        past, past_valid = _pad([p.past for p in plans], 0, dev)
        block, _ = _pad([p.block for p in plans], 0, dev)
        rows = torch.arange(len(reqs), device=dev)[:, None]
        width = max(r.length for r in reqs)
        tokens = torch.stack([F.pad(r.state.tokens, (0, width - r.length)) for r in reqs])
        positions = torch.stack([F.pad(r.state.positions, (0, width - r.length)) for r in reqs])
        slot_maps = torch.stack([F.pad(r.slot_map, (0, width - r.length), value=trash) for r in reqs])
        kept = None  # FOCUS's kept tokens, on a focused step
        if batch.split is not None:
            hidden = self._bicache_refresh(batch, tokens, positions, slot_maps, fed, fed_valid)
        else:
            past_slots = torch.where(past_valid, slot_maps[rows, past], torch.full_like(past, trash))
            paged = PagedKV(self.pool, past_slots, positions[rows, past], past_valid) if past.shape[1] else None
            if self.step_keys is not None and not batch.refresh and paged is not None:  # rotated once a refresh
                sets = [self.step_keys.get(r.request_id, r.state.refreshes, r.slot_map[p.past],
                                           r.state.positions[p.past]) for r, p in zip(reqs, plans, strict=True)]
                paged = self.step_keys.stacked([r.request_id for r in reqs], sets, fed.shape[1], dev)
            focus = reqs[0].params.focus_layers if not batch.refresh and paged is not None else None
            if focus is not None and focus < len(self.model.layers):
                masked = (tokens[rows, fed] == self.model.config.mask_token_id) & fed_valid
                ratios = torch.tensor([r.params.focus_ratio for r in reqs], dtype=torch.float64, device=dev)
                least = torch.tensor([r.state.rule.least_commits(r.state.step) for r in reqs], device=dev)
                hidden, kept = focused_step(self.model, self.pool, tokens[rows, fed], positions[rows, fed], fed_valid,
                                            slot_maps[rows, fed], paged, masked, ratios, focus, least)
            else:
                out = self.model(tokens[rows, fed], positions[rows, fed], fed_valid, past=paged,
                                 return_kv=batch.refresh)
                if batch.refresh:
                    write = torch.where(fed_valid, slot_maps[rows, fed], torch.full_like(fed, trash))
                    self.pool.write(write, out.kv.keys, out.kv.values)
                hidden = out.hidden
        logits = self.model.logits(hidden, block, fed_valid)
        samples = {}
        for i, (req, plan) in enumerate(zip(reqs, plans, strict=True)):
            x0, conf = self._propose(req, logits[i:i + 1, :plan.block.numel()])
            if kept is not None:  # a token FOCUS left out has no proposal: it cannot be committed this step
                out_of_focus = ~kept[i, plan.block]
                x0[out_of_focus] = req.state.mask_token_id
                conf[out_of_focus] = -1.0
            samples[req.request_id] = (x0, conf)
        return samples

    def _select_forward(self, batch: ForwardBatch, anchors: dict[str, torch.Tensor]) -> dict[str, Sample]:
        """First refreshes that choose their anchors inside the forward (:mod:`acache.affix.one_pass`), on the
        requests' own canvases padded to the widest: the shared affixes' K/V are read from their pages, and the
        K/V of each request's own columns and anchors are written to the private slots its slot map will give
        them once the scheduler fixes the anchors."""
        reqs, plans, dev, pool = batch.requests, batch.plans, self.device, self.pool
        inputs = selecting_inputs([(r.state, r.shared_spans) for r in reqs], dev)
        trash, width = pool.trash_slot, inputs.tokens.shape[1]
        shared_slots = torch.full((len(reqs), width), trash, dtype=torch.long, device=dev)
        for i, req in enumerate(reqs):
            for index, affix in req.shared:
                c0, c1 = req.span_columns(index)
                shared_slots[i, c0:c1] = affix.slots

        def cached(layer: int, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            slots = shared_slots.gather(1, cols)
            return pool.keys[layer][slots], pool.values[layer][slots]

        result = refresh_selecting(self.model, *inputs, cached)
        slot_maps = []
        for i, req in enumerate(reqs):
            chosen = result.anchors[i, :req.length]
            recompute = inputs.own[i, :req.length] | chosen
            slot_maps.append(F.pad(KVCacheManager.slot_map(req, recompute), (0, width - req.length), value=trash))
            anchors[req.request_id] = chosen
        write = torch.stack(slot_maps).gather(1, result.cols.clamp_max(width - 1))
        pool.write(torch.where(result.valid, write, torch.full_like(write, trash)), result.keys, result.values)
        block, _ = _pad([p.fed[p.block] for p in plans], 0, dev)
        logits = self.model.logits(result.hidden, block, inputs.valid)
        return {req.request_id: self._propose(req, logits[i:i + 1, :plan.block.numel()])
                for i, (req, plan) in enumerate(zip(reqs, plans, strict=True))}

    def _bicache_refresh(self, batch: ForwardBatch, tokens: torch.Tensor, positions: torch.Tensor,
                         slot_maps: torch.Tensor, fed: torch.Tensor, fed_valid: torch.Tensor) -> torch.Tensor:
        """BiCache's split refresh: own tokens through the shallow layers against the affixes' cached K/V
        (in the request's private slots), the affix-alone states spliced in, the deep layers on all."""
        dev, trash, split = self.device, self.pool.trash_slot, batch.split
        layers = len(self.model.layers)
        rows = torch.arange(len(batch.requests), device=dev)[:, None]
        f = fed.shape[1]
        fed_hidden = torch.zeros(len(batch.requests), f, self.model.config.hidden_size, dtype=self.model.dtype,
                                 device=dev)
        own_index, affix_cols = [], []
        for i, (req, plan) in enumerate(zip(batch.requests, batch.plans, strict=True)):
            for index, entry in req.entries:
                c0, c1 = req.span_columns(index)
                at = torch.searchsorted(plan.fed, torch.arange(c0, c1, device=dev))
                fed_hidden[i, at] = entry.hidden[split].to(fed_hidden.dtype)
            # the rest runs with the request's own columns
            is_affix = req.state.copied_affix_columns([req.span_columns(index) for index, _ in req.entries])
            fed_is_affix = is_affix[plan.fed]
            own_index.append(torch.nonzero(~fed_is_affix).flatten())
            affix_cols.append(plan.fed[fed_is_affix])
        own, own_valid = _pad(own_index, f, dev)
        own_cols = torch.where(own_valid, fed.gather(1, own.clamp_max(max(f - 1, 0))), 0)
        acols, acols_valid = _pad(affix_cols, 0, dev)
        affix_slots = torch.where(acols_valid, slot_maps[rows, acols], torch.full_like(acols, trash))
        past = PagedKV(self.pool, affix_slots, positions[rows, acols], acols_valid)
        out, shallow, deep = bicache_forward(self.model, split, tokens[rows, own_cols], positions[rows, own_cols],
                                             own_valid, past, fed_hidden, own, positions[rows, fed], fed_valid)
        own_write = torch.where(own_valid, slot_maps[rows, own_cols], torch.full_like(own_cols, trash))
        self.pool.write(own_write, shallow.keys, shallow.values, range(0, split))
        fed_write = torch.where(fed_valid, slot_maps[rows, fed], torch.full_like(fed, trash))
        self.pool.write(fed_write, deep.keys, deep.values, range(split, layers))
        return out.hidden
