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

import fcntl
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes

from acache.affix.prompt import affix_key
from acache.models.base import DiffusionLM

MANIFEST = "manifest.json"
LOCK = ".lock"
FORMAT_VERSION = 2


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
    """Identifies the weights an affix cache was computed with: the config, and every parameter's name,
    shape and an evenly strided sample of at most 4,096 of its values (cheap even for an 8B model)."""
    h = hashlib.sha256()
    cfg = {k: v for k, v in vars(model.config).items() if k != "raw"}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 4096)][:4096]
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(sample.float().cpu().numpy().tobytes())
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

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Writes every entry to ``path``: a content-named tensor file, then the manifest naming it, each
        through a temporary file, fsync and rename, under the directory's lock; a reader sees the old
        cache or the new one, never a mix, and a crash mid-save leaves the old one loadable. Entries
        already there (another process's, of this model) are kept, so that two savers lose nothing."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        for handle in self.entries.values():
            e = self.storage.read(handle)
            mine = {f"{e.key}.k.{layer}": k for layer, k in enumerate(e.keys)}
            mine |= {f"{e.key}.v.{layer}": v for layer, v in enumerate(e.values)}
            mine |= {f"{e.key}.h.{layer}": h for layer, h in enumerate(e.hidden or [])}
            mine = {name: t.detach().contiguous().cpu() for name, t in mine.items()}
            tensors |= mine
            entries.append({"key": e.key, "name": e.name, "token_ids": list(e.token_ids),
                            "hidden": e.hidden is not None, "sha256": _checksum(mine)})
        with store_lock(root, exclusive=True):
            _remove_stale(root)
            mine = {e["key"] for e in entries}
            for item, theirs in self._saved_entries(root):
                if item["key"] not in mine:
                    entries.append(item)
                    tensors |= theirs
            blob = save_bytes(tensors) if tensors else b""
            tensor_file = f"affixes-{hashlib.sha256(blob).hexdigest()[:16]}.safetensors"
            _write_atomic(root / tensor_file, blob)
            manifest = {"format": FORMAT_VERSION, "model_fingerprint": self.fingerprint,
                        "family": self.model.family, "num_layers": len(self.model.layers),
                        "dtype": str(self.model.dtype).removeprefix("torch."), "tensors": tensor_file,
                        "entries": entries}
            _write_atomic(root / MANIFEST, (json.dumps(manifest) + "\n").encode())
            for old in root.glob("affixes-*.safetensors"):
                if old.name != tensor_file:
                    old.unlink(missing_ok=True)
        return root

    def _saved_entries(self, root: Path) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        """The entries already saved at ``root`` whose checksums hold, with their tensors (none if the
        directory holds no readable cache of this model)."""
        try:
            manifest = json.loads((root / MANIFEST).read_text())
            if manifest.get("format") != FORMAT_VERSION or manifest.get("model_fingerprint") != self.fingerprint:
                return []
            tensors = load_file(root / manifest["tensors"], device="cpu")
        except Exception:  # nothing trustworthy there to keep: it is replaced
            return []
        kept = []
        for item in manifest.get("entries", []):
            try:
                theirs = {n: t for n, t in tensors.items() if n.startswith(f"{item['key']}.")}
                if theirs and _checksum(theirs) == item["sha256"]:
                    kept.append((item, theirs))
            except (TypeError, KeyError):
                continue
        return kept

    def load(self, path: str | Path) -> int:
        """Adds the entries saved at ``path`` that fit; returns how many. Every entry is checked before any
        room is taken for it (its checksum, shapes, dtype and finiteness, and its first layer's K/V
        recomputed from its token ids, which no other model or affix reproduces); any refusal is one
        :class:`AffixStoreError` naming the file and the problem."""
        root = Path(path)
        manifest_file = root / MANIFEST
        if not manifest_file.is_file():
            raise AffixStoreError(f"no affix cache at {root}: {MANIFEST} is missing")
        with store_lock(root, exclusive=False):
            _remove_stale(root)
            try:
                manifest = json.loads(manifest_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise AffixStoreError(f"{manifest_file}: not a manifest ({exc})") from None
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
                found = manifest.get("format") if isinstance(manifest, dict) else None
                raise AffixStoreError(f"{manifest_file}: format {found!r}, this version reads {FORMAT_VERSION}")
            if manifest.get("model_fingerprint") != self.fingerprint:
                raise AffixStoreError(
                    f"{manifest_file} was made with another model ({manifest.get('family')}, "
                    f"{manifest.get('num_layers')} layers, fingerprint {str(manifest.get('model_fingerprint'))[:12]}) "
                    f"than this one ({self.model.family}, {len(self.model.layers)} layers, fingerprint "
                    f"{self.fingerprint[:12]}); refusing to load it")
            tensor_file = root / str(manifest.get("tensors", ""))
            entries = manifest.get("entries")
            if not isinstance(entries, list) or tensor_file.parent != root or not tensor_file.is_file():
                raise AffixStoreError(f"{manifest_file}: names no readable tensor file ({tensor_file.name!r})")
            try:
                tensors = load_file(tensor_file, device="cpu") if tensor_file.stat().st_size else {}
            except Exception as exc:  # safetensors raises its own error types on corrupt files
                raise AffixStoreError(f"{tensor_file}: not a safetensors file ({exc})") from None
        checked = [self._checked_entry(item, tensors, tensor_file) for item in entries]
        loaded = 0
        for entry in checked:
            if entry.key in self.entries or not self.evict_until(self.storage.cost(entry.length)):
                continue
            self.entries[entry.key] = self.storage.put(entry)
            self._emit("stored", entry)
            loaded += 1
        return loaded

    def _checked_entry(self, item: object, tensors: dict[str, torch.Tensor], file: Path) -> AffixEntry:
        cfg, dtype = self.model.config, self.model.dtype
        try:
            key, ids, name, has_hidden, digest = (item["key"], tuple(int(t) for t in item["token_ids"]),
                                                  item.get("name"), bool(item["hidden"]), item["sha256"])
        except (TypeError, KeyError, ValueError) as exc:
            raise AffixStoreError(f"{file.parent / MANIFEST}: an entry is malformed ({exc!r})") from None
        label = f"{file}: entry {str(key)[:12]}"
        if not ids or key != self.key_fn(ids):
            raise AffixStoreError(f"{label} does not hash its token ids")
        if any(not 0 <= t < cfg.vocab_size for t in ids):
            raise AffixStoreError(f"{label} holds a token id outside the vocabulary of {cfg.vocab_size}")
        names = [f"{key}.{kind}.{layer}" for kind in "kv" for layer in range(cfg.num_layers)]
        if has_hidden:
            names += [f"{key}.h.{layer}" for layer in range(cfg.num_layers + 1)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise AffixStoreError(f"{label}: tensor {missing[0]} is missing")
        mine = {n: tensors[n] for n in names}
        if _checksum(mine) != digest:
            raise AffixStoreError(f"{label}: its tensors do not match their checksum (corrupt or altered)")
        n = len(ids)
        for tname, t in mine.items():
            want = (n, cfg.hidden_size) if ".h." in tname else (n, cfg.num_kv_heads, cfg.head_dim)
            if tuple(t.shape) != want:
                raise AffixStoreError(f"{label}: tensor {tname} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != dtype and not (t.is_floating_point() and dtype.is_floating_point):
                raise AffixStoreError(f"{label}: tensor {tname} has dtype {t.dtype}, expected {dtype}")
            if not bool(torch.isfinite(t).all()):
                raise AffixStoreError(f"{label}: tensor {tname} holds NaN or infinite values")
        dev = self.model.device
        entry = AffixEntry(key, ids, [mine[f"{key}.k.{i}"].to(dev, dtype) for i in range(cfg.num_layers)],
                           [mine[f"{key}.v.{i}"].to(dev, dtype) for i in range(cfg.num_layers)],
                           [mine[f"{key}.h.{i}"].to(dev, dtype) for i in range(cfg.num_layers + 1)] if has_hidden
                           else None, name)
        k0, v0 = first_layer_kv(self.model, ids)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        if not (torch.allclose(entry.keys[0].float(), k0.float(), atol=tol, rtol=tol)
                and torch.allclose(entry.values[0].float(), v0.float(), atol=tol, rtol=tol)):
            raise AffixStoreError(f"{label}: its K/V were not computed from its tokens by this model")
        return entry


class AffixStoreError(ValueError):
    """An affix cache on disk that cannot be trusted: the message names the file and the problem."""


@torch.inference_mode()
def first_layer_kv(model: DiffusionLM, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's pre-RoPE K/V of ``token_ids``: they depend on each token alone (no attention yet),
    so a stored entry can be checked against its own ids at the cost of one embedding and two projections."""
    layer = model.layers[0]
    x = model.embed(torch.tensor(list(token_ids), device=model.device))
    h = layer.attn_norm(x)
    shape = (len(token_ids), layer.num_kv_heads, layer.head_dim)
    return layer.k_proj(h).view(shape), layer.v_proj(h).view(shape)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(root: Path) -> None:
    """Temporary files left by a save that died (held under the lock, none can be in progress)."""
    for tmp in root.glob(".*.tmp-*"):
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only directory: they do no harm there
            break


@contextmanager
def store_lock(root: Path, exclusive: bool):
    """The directory's lock: one writer, or any number of readers. A reader of a directory it cannot write
    (a cache shipped read-only) reads without it: nobody can be writing there."""
    try:
        f = open(root / LOCK, "a+")  # noqa: SIM115 (held open for the lock's lifetime)
    except OSError as exc:
        if exclusive:
            raise AffixStoreError(f"{root}: cannot write the affix cache there ({exc.strerror})") from None
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
