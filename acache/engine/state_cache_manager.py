"""The cache manager of the families whose cache is the model's own object (the state-space variant, R2LM).

A request's cache is its model's ``empty_cache()`` at admission, advanced by the runner as blocks finish
(:class:`BlockCache`). Admission reserves against a byte budget, all or nothing, the most the cache will ever
hold (one fixed-size state for the state-space variant; for R2LM the K/V of the columns before its last step's
span, which is all its cache ever covers, none without a cache) and the copies its steps make beside it
(``step_bytes``: R2LM's step extends a copy of the K/V through the columns it feeds, the state-space model's batch
stacks the states and copies them after): those of every running request where a family runs rows together, the
largest one where it runs them one after another. So a running request never runs out; a request that does not
fit waits, one that could never fit is refused. These families share no affix K/V: the affix table is
:class:`NoSharedAffixes`. What such a family cannot do at all is refused by :func:`check_state_request`, which
the engine and the reference loop (:func:`acache.reference.reference_generate_state_cache`) both ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from acache.affix.cache import CacheStats
from acache.affix.prompt import AffixPrompt
from acache.decoding.request_state import StepPlan
from acache.engine.request import Request
from acache.models.r2lm import R2LM
from acache.models.ssm import SSMBlockDiffusionLM
from acache.sampling_params import SamplingParams


@dataclass
class BlockCache:
    """One request's cache: what ``extend`` left after canvas columns ``[0, covered)``."""

    value: Any
    covered: int = 0


def check_state_request(family: str, prompt: AffixPrompt, params: SamplingParams) -> None:
    """What a state-cache family cannot do, refused by name; the engine and the reference loop both ask here,
    so the two accept the same requests."""
    if params.selector is not None and prompt.affixes:
        raise ValueError(f"affix reuse (selector={params.selector!r}) is not supported for the "
                         f"{family} family: its cache is built block by block, per request")
    for name in ("focus_layers", "far_mask_window"):
        if getattr(params, name) is not None:
            raise ValueError(f"{name} is not supported for the {family} family")
    check_nothing_after_answer(family, prompt)


def check_nothing_after_answer(family: str, prompt: AffixPrompt) -> None:
    """A block-causal model (state-space, R2LM, Fast-dLLM v2) reads no later block: text after the answer would be
    computed and never read, so it is refused rather than ignored."""
    if prompt.gen_at != len(prompt.token_ids):
        raise ValueError(f"the prompt has {len(prompt.token_ids) - prompt.gen_at} tokens after its generation "
                         f"region, which a {family} model cannot read (it sees no later block): "
                         "put all of the prompt before the answer")


class NoSharedAffixes:
    """The affix table of an engine whose family reuses no affix: always empty, and it says so when asked to
    load or save one."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.stats = CacheStats()
        self.entries: dict = {}  # as an affix cache's, for what reads one (a cluster replica's reports)
        self.listeners: list = []

    def __len__(self) -> int:
        return 0

    def lookup(self, token_ids) -> None:
        return None

    def _refuse(self) -> ValueError:
        return ValueError(f"the {self.family} family shares no affix K/V: there is no affix cache to load or save")

    def load(self, path: str | Path) -> int:
        raise self._refuse()

    def recover(self, path: str | Path) -> None:
        raise self._refuse()

    def snapshot(self) -> None:
        raise self._refuse()

    def save(self, path: str | Path, snapshot: object = None) -> Path:
        raise self._refuse()


class StateCacheManager:
    def __init__(self, model: SSMBlockDiffusionLM | R2LM, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {budget_bytes}")
        self.model = model
        self.budget_bytes = budget_bytes
        self.affixes = NoSharedAffixes(model.family)
        self.caches: dict[str, BlockCache] = {}
        self.reserved: dict[str, int] = {}  # the most each request's cache holds
        self.copies: dict[str, int] = {}  # the most each request's step adds beside it
        self.peak_bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._used(self.reserved.values(), self.copies.values())

    def _used(self, held, copies) -> int:
        copies = list(copies)
        return sum(held) + (sum(copies) if self.model.rows_together else max(copies, default=0))

    def held_bytes(self, req: Request) -> int:
        """The most the request's cache holds: the columns before its last step's span (the runner advances it to
        each step's first column), none without a cache."""
        params = req.params
        size = self.model.config.block_size
        covered = 0 if params.cache == "none" else (req.length - params.block_length) // size * size
        return self.model.cache_bytes_for(covered)

    def bytes_needed(self, req: Request) -> int:
        """The request's cache and its step's copies, alone."""
        return self.held_bytes(req) + self.model.step_bytes(req.length)

    def check(self, req: Request) -> None:
        need = self.bytes_needed(req)
        if need > self.budget_bytes:
            raise ValueError(f"{req.label} needs {need} bytes of {self.model.family} cache (its cache "
                             f"and the copy a step makes), more than the whole budget of {self.budget_bytes}; raise "
                             "kv_cache_memory")

    def allocate(self, req: Request) -> bool:
        held, copy = self.held_bytes(req), self.model.step_bytes(req.length)
        if self._used([*self.reserved.values(), held], [*self.copies.values(), copy]) > self.budget_bytes:
            return False
        cache = BlockCache(self.model.empty_cache())  # first: if it raises, nothing is reserved
        self.reserved[req.request_id], self.copies[req.request_id] = held, copy
        self.caches[req.request_id] = cache
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True

    def step_cost(self, req: Request, plan: StepPlan) -> int:
        """Tokens the request's next forward runs: the finished columns its cache must first take in (the
        whole prompt at the first block, a block after that), then the ones it feeds."""
        return len(plan.fed) + max(0, len(plan.past) - self.caches[req.request_id].covered)

    def cache(self, req: Request) -> BlockCache:
        return self.caches[req.request_id]

    def free(self, req: Request) -> None:
        self.caches.pop(req.request_id, None)
        self.reserved.pop(req.request_id, None)
        self.copies.pop(req.request_id, None)

    def memory_usage(self) -> tuple[int, int, int]:
        """``(peak, in use, bytes a unit)`` in the units of the engine's summary: bytes, for this manager."""
        return self.peak_bytes, self.used_bytes, 1

    @property
    def capacity_bytes(self) -> int:
        """The byte budget (``/metrics``: the same for every cache manager)."""
        return self.budget_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.used_bytes
