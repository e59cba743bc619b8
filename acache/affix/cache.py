"""One affix cache over either storage: the rules written once, the K/V kept where the caller runs.

Entries are found by the content hash of their token ids and verified id for id on every hit; the
requests that hold one are counted, and only an entry no request holds is evicted, least recently used
first, when a new one needs room. A storage decides where K/V live and what room means: dense tensors
under a byte budget (the reference path, BiCache's hidden states) or pages of the engine's pool. When
room cannot be made, a dense cache hands the affix out uncached (``transient``) and a paged one answers
None, so the engine's request waits. Either saves to and loads from the same directory
(:mod:`acache.affix.persistence`), refusing a cache made with another model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from acache.affix.entry import AffixEntry, compute_affix
from acache.affix.persistence import AffixDirectory, LoadReport, model_fingerprint
from acache.affix.prompt import affix_key
from acache.models.base import DiffusionLM


class Handle(Protocol):
    key: str
    token_ids: tuple[int, ...]
    name: str | None
    refcount: int


H = TypeVar("H", bound=Handle)


class AffixStorage(Protocol[H]):
    """Where an affix cache keeps its entries' K/V."""

    def cost(self, num_tokens: int) -> int:
        """Capacity an affix of ``num_tokens`` takes."""

    def has_room(self, cost: int) -> bool: ...

    @property
    def capacity(self) -> int | None:
        """The most capacity affixes may take together (None: unbounded)."""

    def put(self, entry: AffixEntry) -> H:
        """Stores the entry's K/V (room is checked first) and returns its handle."""

    def read(self, handle: H) -> AffixEntry: ...

    def drop(self, handle: H) -> None: ...


@dataclass(frozen=True)
class AffixEvent:
    """What changed in an affix cache: ``stored`` (computed or loaded) or ``evicted``, by content hash. A
    cluster's router keeps its map of which replica holds which affix from these, not from guesses."""

    kind: str
    key: str
    num_tokens: int


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    collisions: int = 0
    transient: int = 0

    @property
    def queries(self) -> int:
        return self.hits + self.misses


class AffixCache(Generic[H]):
    """Shared affixes of one model over a storage. ``wait_when_full``: answer None instead of handing
    out an uncached entry when no room can be made."""

    def __init__(self, model: DiffusionLM, storage: AffixStorage[H], keep_hidden: bool = False,
                 key_fn: Callable[[Sequence[int]], str] = affix_key, wait_when_full: bool = False) -> None:
        self.model = model
        self.storage = storage
        self.keep_hidden = keep_hidden
        self.key_fn = key_fn
        self.wait_when_full = wait_when_full
        self.entries: OrderedDict[str, H] = OrderedDict()
        self.stats = CacheStats()
        self._fingerprint: str | None = None
        self.listeners: list[Callable[[AffixEvent], None]] = []

    def _emit(self, kind: str, handle: H) -> None:
        for listener in self.listeners:
            listener(AffixEvent(kind, handle.key, len(handle.token_ids)))

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, token_ids: Sequence[int]) -> bool:
        return self.lookup(tuple(int(t) for t in token_ids)) is not None

    def lookup(self, token_ids: tuple[int, ...]) -> H | None:
        entry = self.entries.get(self.key_fn(token_ids))
        return entry if entry is not None and entry.token_ids == token_ids else None

    def collides(self, token_ids: Sequence[int]) -> bool:
        """Another affix holds this content hash: this one cannot be shared."""
        entry = self.entries.get(self.key_fn(token_ids))
        return entry is not None and entry.token_ids != tuple(token_ids)

    def compute(self, token_ids: Sequence[int], name: str | None = None) -> AffixEntry:
        """Runs the affix alone at positions ``0..n-1`` and keeps its per-layer pre-RoPE K/V."""
        return compute_affix(self.model, token_ids, name, self.keep_hidden, self.key_fn)

    def acquire(self, token_ids: Sequence[int], name: str | None = None) -> tuple[H, bool] | None:
        """``(entry, hit)``, computed and stored on a miss; the caller holds it until :meth:`release`.
        A hash match whose ids differ is a miss that is never stored (collision guard)."""
        ids = tuple(int(t) for t in token_ids)
        key = self.key_fn(ids)
        entry = self.entries.get(key)
        if entry is not None and entry.token_ids == ids:
            self.stats.hits += 1
            self.entries.move_to_end(key)
            entry.refcount += 1
            return entry, True
        if entry is not None:  # same hash, different ids: never overwrite an entry others may hold
            self.stats.collisions += 1
            if self.wait_when_full:
                raise ValueError(f"affix hash {key[:12]} collides with another affix; check collides() first")
            self.stats.misses += 1
            return self._transient(self.compute(ids, name)), False
        if not self.evict_until(self.storage.cost(len(ids))):
            if self.wait_when_full:
                return None  # not answered yet: the request waits and asks again
            self.stats.misses += 1
            return self._transient(self.compute(ids, name)), False
        self.stats.misses += 1
        stored = self.storage.put(self.compute(ids, name))
        stored.refcount = 1
        self.entries[key] = stored
        self._emit("stored", stored)
        return stored, False

    def release(self, entry: H) -> None:
        if getattr(entry, "transient", False):
            return
        if entry.refcount <= 0:
            raise RuntimeError(f"affix {entry.key[:12]} released more often than acquired")
        entry.refcount -= 1

    def evict_until(self, cost: int, keep: set[str] = frozenset()) -> bool:
        """Evicts unreferenced entries, least recently used first, until ``cost`` fits."""
        return self.evict_while(lambda: not self.storage.has_room(cost), keep)

    def evict_while(self, short: Callable[[], bool], keep: set[str] = frozenset()) -> bool:
        """Evicts unreferenced entries, least recently used first, while ``short()`` says room is short;
        True once it no longer does."""
        for key in [k for k, e in self.entries.items() if e.refcount == 0 and k not in keep]:
            if not short():
                break
            self._drop(key)
            self.stats.evictions += 1
        return not short()

    def clear(self) -> None:
        """Drops every entry no request holds."""
        for key in [k for k, e in self.entries.items() if e.refcount == 0]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        handle = self.entries.pop(key)
        self.storage.drop(handle)
        self._emit("evicted", handle)

    def _transient(self, entry: AffixEntry) -> AffixEntry:
        self.stats.transient += 1
        entry.transient = True
        return entry

    # -- persistence: the directory reads and writes, the cache decides what it keeps ----------------
    def directory(self, path: str | Path) -> AffixDirectory:
        return AffixDirectory(Path(path), self.model, self.fingerprint, self.key_fn)

    def snapshot(self) -> list[AffixEntry]:
        """Every entry's K/V copied to the CPU, least recently used first: what :meth:`save` writes. The caller
        stops anything that could evict an entry meanwhile (the server holds the engine's lock); the disk work
        of a save needs no lock."""
        return [self.storage.read(h).to_cpu() for h in self.entries.values()]

    def save(self, path: str | Path, snapshot: list[AffixEntry] | None = None) -> Path:
        """Writes every entry (or ``snapshot``) to ``path`` atomically, with what another process of this model
        saved there while the cache's capacity holds it all, this process's entries last."""
        saved = self.snapshot() if snapshot is None else snapshot
        return self.directory(path).save(saved, self._claims([e.length for e in saved]))

    def load(self, path: str | Path) -> int:
        """Adds the entries saved at ``path`` that fit, the most recently saved first; returns how many. Any
        fault is one AffixStoreError naming the file and the problem, and nothing is loaded."""
        return self._admit(self.directory(path).load(self._claims(self._held_lengths()), set(self.entries)))

    def recover(self, path: str | Path) -> LoadReport:
        """Loads what can be trusted of the store at ``path`` and moves the rest aside (the server's way:
        one fault never keeps it down); never raises for what it finds on disk."""
        directory = self.directory(path)
        report, checked = directory.recover(self._claims(self._held_lengths()), set(self.entries))
        report.loaded = self._admit(checked)
        directory.log(report)
        return report

    def _held_lengths(self) -> list[int]:
        return [len(h.token_ids) for h in self.entries.values()]

    def _claims(self, held: list[int]) -> Callable[[int], bool]:
        """Grants room to affixes of ``num_tokens`` one after another until the storage's capacity, less what
        ``held`` takes, is spent (every one where the storage is unbounded)."""
        left = self.storage.capacity
        if left is None:
            return lambda num_tokens: True
        left -= sum(self.storage.cost(n) for n in held)

        def claim(num_tokens: int) -> bool:
            nonlocal left
            cost = self.storage.cost(num_tokens)
            if cost > left:
                return False
            left -= cost
            return True

        return claim

    def _admit(self, checked: list[AffixEntry]) -> int:
        """Stores the checked entries that are new and fit; how many."""
        loaded = 0
        for entry in checked:
            if entry.key in self.entries or not self.evict_until(self.storage.cost(entry.length)):
                continue
            self.entries[entry.key] = self.storage.put(entry)
            self._emit("stored", entry)
            loaded += 1
        return loaded
