"""The dense affix store: one copy of each affix's K/V as tensors, under an optional byte budget.

It is the affix cache (:mod:`acache.affix.cache`) over dense storage: what the reference path places on
its canvas, and where BiCache finds the affix-alone hidden states. An entry that cannot be fitted is
handed out uncached (``transient``) rather than failing the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from acache.affix.cache import AffixCache
from acache.affix.entry import AffixEntry, compute_affix
from acache.affix.prompt import affix_key
from acache.models.base import DiffusionLM


class DenseStorage:
    """K/V kept as the entries' own tensors; ``max_bytes`` bounds their sum (None: unbounded)."""

    def __init__(self, model: DiffusionLM, max_bytes: int | None, keep_hidden: bool) -> None:
        cfg = model.config
        elem = model.embed.weight.element_size()
        self.per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
        if keep_hidden:
            self.per_token += (cfg.num_layers + 1) * cfg.hidden_size * elem
        self.max_bytes = max_bytes
        self.stored: dict[str, AffixEntry] = {}

    @property
    def used(self) -> int:
        return sum(e.nbytes() for e in self.stored.values())

    def cost(self, num_tokens: int) -> int:
        return num_tokens * self.per_token

    def has_room(self, cost: int) -> bool:
        return self.max_bytes is None or self.used + cost <= self.max_bytes

    @property
    def capacity(self) -> int | None:
        return self.max_bytes

    def put(self, entry: AffixEntry) -> AffixEntry:
        self.stored[entry.key] = entry
        return entry

    def read(self, handle: AffixEntry) -> AffixEntry:
        return handle

    def drop(self, handle: AffixEntry) -> None:
        self.stored.pop(handle.key, None)


class AffixStore(AffixCache[AffixEntry]):
    """Shared affix K/V of one model as dense tensors, under an optional byte budget."""

    def __init__(self, model: DiffusionLM, max_bytes: int | None = None, keep_hidden: bool = False,
                 key_fn: Callable[[Sequence[int]], str] = affix_key) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        super().__init__(model, DenseStorage(model, max_bytes, keep_hidden), keep_hidden, key_fn)
        self.max_bytes = max_bytes

    @property
    def nbytes(self) -> int:
        return self.storage.used

    def check_hidden_room(self) -> None:
        """Raises a ValueError where the hidden states BiCache adds would go past the byte budget uncounted: the
        engine asks when a BiCache request is added, before it could wait in the queue on it."""
        if self.max_bytes is not None and not self.keep_hidden:
            raise ValueError("BiCache needs the affixes' hidden states, which this store's byte budget does not "
                             "count: build it with keep_hidden=True")

    def ensure_hidden(self, entry: AffixEntry) -> AffixEntry:
        """Adds the affix-alone hidden states (BiCache needs them) to an entry made without them. A store under a
        byte budget that was built without them (``keep_hidden=False``) does not count them, so it refuses rather
        than grow past its budget."""
        if entry.hidden is None and not entry.transient:
            self.check_hidden_room()
        if entry.hidden is None:
            entry.hidden = compute_affix(self.model, entry.token_ids, entry.name, True, self.key_fn).hidden
        return entry
