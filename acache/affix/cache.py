"""One affix cache over either storage: the rules written once, the K/V kept where the caller runs.

Entries are found by the content hash of their token ids and verified id for id on every hit; the
requests that hold one are counted, and only an entry no request holds is evicted, least recently used
first, when a new one needs room. A storage decides where K/V live and what room means: dense tensors
under a byte budget (the reference path, BiCache's hidden states) or pages of the engine's pool. When
room cannot be made, a dense cache hands the affix out uncached (``transient``) and a paged one answers
None, so the engine's request waits. Either saves to and loads from the same on-disk format, refusing
a cache made with another model.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch
from safetensors.torch import load_file, save_file

from acache.affix.prompt import affix_key
from acache.models.base import DiffusionLM

MANIFEST = "manifest.json"
TENSORS = "affixes.safetensors"
FORMAT_VERSION = 1


@dataclass
class AffixEntry:
    """An affix's per-layer K/V as dense tensors, computed alone at positions ``0..n-1``."""

    key: str
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [n, Hkv, D], pre-RoPE
    values: list[torch.Tensor]
    hidden: list[torch.Tensor] | None = None  # input states of each layer and the last output [n, hidden]
    name: str | None = None
    refcount: int = 0
    transient: bool = False  # handed out without being stored

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *(self.hidden or [])]
        return sum(t.numel() * t.element_size() for t in tensors)


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

    def put(self, entry: AffixEntry) -> H:
        """Stores the entry's K/V (room is checked first) and returns its handle."""

    def read(self, handle: H) -> AffixEntry: ...

    def drop(self, handle: H) -> None: ...


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


@torch.inference_mode()
def compute_affix(model: DiffusionLM, token_ids: Sequence[int], name: str | None = None, keep_hidden: bool = False,
                  key_fn: Callable[[Sequence[int]], str] = affix_key) -> AffixEntry:
    """An affix's per-layer pre-RoPE K/V from running it alone at positions ``0..n-1``."""
    ids = tuple(int(t) for t in token_ids)
    label = f"affix {name!r}" if name else "affix"
    limit = model.config.max_position_embeddings
    if not ids:
        raise ValueError(f"{label} is empty")
    if len(ids) > limit:
        raise ValueError(f"{label} has {len(ids)} tokens, more than the model's context of {limit}")
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"{label} holds a token id outside the vocabulary of {vocab}")
    device = model.device
    x = torch.tensor([ids], device=device)
    out = model.run_layers(model.embed(x), torch.arange(len(ids), device=device)[None], None, None,
                           range(len(model.layers)), return_kv=True, capture_inputs=keep_hidden)
    hidden = [h[0] for h in out.layer_inputs] if keep_hidden else None
    return AffixEntry(key_fn(ids), ids, [k[0] for k in out.kv.keys], [v[0] for v in out.kv.values], hidden, name)


def model_fingerprint(model: DiffusionLM) -> str:
    """Identifies the weights an affix cache was computed with: config plus K/V projections' bytes."""
    import hashlib

    h = hashlib.sha256()
    cfg = {k: v for k, v in vars(model.config).items() if k != "raw"}
    h.update(json.dumps(cfg, sort_keys=True).encode())
    for layer in (model.layers[0], model.layers[-1]):
        for p in (layer.k_proj.weight, layer.v_proj.weight, layer.attn_norm.weight):
            h.update(p.detach().float().cpu().numpy().tobytes())
    h.update(model.embed.weight[:8].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


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
        return stored, False

    def release(self, entry: H) -> None:
        if getattr(entry, "transient", False):
            return
        if entry.refcount <= 0:
            raise RuntimeError(f"affix {entry.key[:12]} released more often than acquired")
        entry.refcount -= 1

    def evict_until(self, cost: int, keep: set[str] = frozenset()) -> bool:
        """Evicts unreferenced entries, least recently used first, until ``cost`` fits."""
        for key in [k for k, e in self.entries.items() if e.refcount == 0 and k not in keep]:
            if self.storage.has_room(cost):
                break
            self.storage.drop(self.entries.pop(key))
            self.stats.evictions += 1
        return self.storage.has_room(cost)

    def clear(self) -> None:
        """Drops every entry no request holds."""
        for key in [k for k, e in self.entries.items() if e.refcount == 0]:
            self.storage.drop(self.entries.pop(key))

    def _transient(self, entry: AffixEntry) -> AffixEntry:
        self.stats.transient += 1
        entry.transient = True
        return entry

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        manifest = {"format": FORMAT_VERSION, "model_fingerprint": self.fingerprint,
                    "family": self.model.family, "num_layers": len(self.model.layers), "entries": []}
        for handle in self.entries.values():
            e = self.storage.read(handle)
            for layer, (k, v) in enumerate(zip(e.keys, e.values, strict=True)):
                tensors[f"{e.key}.k.{layer}"] = k.contiguous().cpu()
                tensors[f"{e.key}.v.{layer}"] = v.contiguous().cpu()
            for layer, h in enumerate(e.hidden or []):
                tensors[f"{e.key}.h.{layer}"] = h.contiguous().cpu()
            manifest["entries"].append({"key": e.key, "name": e.name, "token_ids": list(e.token_ids),
                                        "hidden": e.hidden is not None})
        save_file(tensors, root / TENSORS)
        (root / MANIFEST).write_text(json.dumps(manifest) + "\n")
        return root

    def load(self, path: str | Path) -> int:
        """Adds the entries saved at ``path`` that fit; returns how many. Refuses a cache of another model."""
        root = Path(path)
        if not (root / MANIFEST).is_file() or not (root / TENSORS).is_file():
            raise FileNotFoundError(f"no affix cache at {root}: expected {MANIFEST} and {TENSORS}")
        manifest = json.loads((root / MANIFEST).read_text())
        if manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"affix cache at {root} has format {manifest.get('format')}, "
                             f"this version reads {FORMAT_VERSION}")
        if manifest.get("model_fingerprint") != self.fingerprint:
            raise ValueError(f"affix cache at {root} was made with another model ({manifest.get('family')}, "
                             f"{manifest.get('num_layers')} layers, fingerprint "
                             f"{str(manifest.get('model_fingerprint'))[:12]}) than this one "
                             f"({self.model.family}, {len(self.model.layers)} layers, fingerprint "
                             f"{self.fingerprint[:12]}); refusing to load it")
        tensors = load_file(root / TENSORS, device=str(self.model.device))
        dtype, n_layers = self.model.dtype, len(self.model.layers)
        loaded = 0
        for item in manifest["entries"]:
            key, ids = item["key"], tuple(item["token_ids"])
            if key != self.key_fn(ids):
                raise ValueError(f"affix cache at {root}: entry {key[:12]} does not hash its token ids")
            if key in self.entries or not self.evict_until(self.storage.cost(len(ids))):
                continue
            hidden = ([tensors[f"{key}.h.{layer}"].to(dtype) for layer in range(n_layers + 1)]
                      if item["hidden"] else None)
            entry = AffixEntry(key, ids, [tensors[f"{key}.k.{layer}"].to(dtype) for layer in range(n_layers)],
                               [tensors[f"{key}.v.{layer}"].to(dtype) for layer in range(n_layers)],
                               hidden, item.get("name"))
            self.entries[key] = self.storage.put(entry)
            loaded += 1
        return loaded
