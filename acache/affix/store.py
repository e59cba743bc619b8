"""The affix store: one copy of each affix's K/V, computed alone at positions ``0..n-1``.

Entries are found by the content hash of their token ids and verified id for id on every hit. A byte
budget is kept by evicting the least recently used entries that no request holds; an entry that cannot
be fitted is handed out uncached (``transient``) rather than failing the request. The store saves to
and loads from disk (safetensors plus a manifest), refusing a cache made with another model.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from acache.affix.prompt import affix_key
from acache.models.base import DiffusionLM

MANIFEST = "manifest.json"
TENSORS = "affixes.safetensors"
FORMAT_VERSION = 1


@dataclass
class AffixEntry:
    key: str
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [n, Hkv, D], pre-RoPE, computed at positions 0..n-1
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


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    collisions: int = 0
    transient: int = 0


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
    h = hashlib.sha256()
    cfg = {k: v for k, v in vars(model.config).items() if k != "raw"}
    h.update(json.dumps(cfg, sort_keys=True).encode())
    for layer in (model.layers[0], model.layers[-1]):
        for p in (layer.k_proj.weight, layer.v_proj.weight, layer.attn_norm.weight):
            h.update(p.detach().float().cpu().numpy().tobytes())
    h.update(model.embed.weight[:8].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class AffixStore:
    """Shared affix K/V of one model, under an optional byte budget."""

    def __init__(self, model: DiffusionLM, max_bytes: int | None = None, keep_hidden: bool = False,
                 key_fn: Callable[[Sequence[int]], str] = affix_key) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.model = model
        self.max_bytes = max_bytes
        self.keep_hidden = keep_hidden
        self.key_fn = key_fn
        self.entries: OrderedDict[str, AffixEntry] = OrderedDict()
        self.stats = StoreStats()
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, token_ids: Sequence[int]) -> bool:
        entry = self.entries.get(self.key_fn(token_ids))
        return entry is not None and entry.token_ids == tuple(token_ids)

    def compute(self, token_ids: Sequence[int], name: str | None = None) -> AffixEntry:
        """Runs the affix alone at positions ``0..n-1`` and keeps its per-layer pre-RoPE K/V."""
        return compute_affix(self.model, token_ids, name, self.keep_hidden, self.key_fn)

    def acquire(self, token_ids: Sequence[int], name: str | None = None) -> tuple[AffixEntry, bool]:
        """The entry of an affix, computed on a miss; the caller holds it until :meth:`release`.

        Returns ``(entry, hit)``. A hash match whose ids differ is a miss (collision guard).
        """
        ids = tuple(int(t) for t in token_ids)
        key = self.key_fn(ids)
        entry = self.entries.get(key)
        if entry is not None and entry.token_ids == ids:
            self.stats.hits += 1
            self.entries.move_to_end(key)
            entry.refcount += 1
            return entry, True
        self.stats.misses += 1
        fresh = self.compute(ids, name)
        if entry is not None:  # same hash, different ids: never overwrite an entry others may hold
            self.stats.collisions += 1
            return self._transient(fresh), False
        if not self._make_room(fresh.nbytes()):
            return self._transient(fresh), False
        fresh.refcount = 1
        self.entries[key] = fresh
        return fresh, False

    def release(self, entry: AffixEntry) -> None:
        if entry.transient:
            return
        if entry.refcount <= 0:
            raise RuntimeError(f"affix {entry.key[:12]} released more often than acquired")
        entry.refcount -= 1

    def ensure_hidden(self, entry: AffixEntry) -> AffixEntry:
        """Adds the affix-alone hidden states (BiCache needs them) to an entry made without them."""
        if entry.hidden is None:
            entry.hidden = compute_affix(self.model, entry.token_ids, entry.name, True, self.key_fn).hidden
        return entry

    def _transient(self, entry: AffixEntry) -> AffixEntry:
        self.stats.transient += 1
        entry.transient = True
        return entry

    def _make_room(self, need: int) -> bool:
        if self.max_bytes is None:
            return True
        used = self.nbytes
        if used + need <= self.max_bytes:
            return True
        for key in [k for k, e in self.entries.items() if e.refcount == 0]:
            used -= self.entries.pop(key).nbytes()
            self.stats.evictions += 1
            if used + need <= self.max_bytes:
                return True
        return False

    def clear(self) -> None:
        """Drops every entry no request holds."""
        for key in [k for k, e in self.entries.items() if e.refcount == 0]:
            del self.entries[key]

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        manifest = {"format": FORMAT_VERSION, "model_fingerprint": self.fingerprint,
                    "family": self.model.family, "num_layers": len(self.model.layers), "entries": []}
        for e in self.entries.values():
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
        """Adds the entries saved at ``path``; returns how many. Refuses a cache of another model."""
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
            hidden = ([tensors[f"{key}.h.{layer}"].to(dtype) for layer in range(n_layers + 1)]
                      if item["hidden"] else None)
            entry = AffixEntry(key, ids, [tensors[f"{key}.k.{layer}"].to(dtype) for layer in range(n_layers)],
                               [tensors[f"{key}.v.{layer}"].to(dtype) for layer in range(n_layers)],
                               hidden, item.get("name"))
            if key in self.entries or not self._make_room(entry.nbytes()):
                continue
            self.entries[key] = entry
            loaded += 1
        return loaded


@dataclass
class AffixHold:
    """The entries one request holds, released together."""

    store: AffixStore
    entries: list[AffixEntry] = field(default_factory=list)
    hits: int = 0
    misses: int = 0

    def acquire(self, token_ids: Sequence[int], name: str | None = None) -> AffixEntry:
        entry, hit = self.store.acquire(token_ids, name)
        self.entries.append(entry)
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        return entry

    def release(self) -> None:
        for e in self.entries:
            self.store.release(e)
        self.entries.clear()
