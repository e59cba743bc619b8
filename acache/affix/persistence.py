"""The affix cache on disk: one directory per model, a manifest naming one content-named safetensors file,
written atomically under a lock, checked entry by entry when read, and healed by setting faults aside.

What the store on disk guarantees, and against whom: it is built against accidents, not against an
adversary who can write its directory. A save is atomic (a reader sees the old store or the new one), and
a load detects a truncated or bit-flipped file, swapped or deleted files, a manifest that is not one, an
entry whose K/V do not hash to its checksum or whose first layer does not follow from its own token ids
(another affix's, or another model's, K/V), wrong shapes and non-finite values. It does not authenticate:
the checksums are plain SHA-256 and only layer 0 is recomputed, so someone who can write the directory can
alter a deeper layer, recompute the checksums, and have it served. Keep the directory writable by the
server's user only. :meth:`AffixDirectory.load` refuses a store with any fault (library use, tests);
:meth:`AffixDirectory.recover` (the server) moves each fault aside into ``quarantine/`` and loads the rest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes

from acache.affix.entry import AffixEntry, first_layer_kv
from acache.models.base import DiffusionLM

MANIFEST = "manifest.json"
LOCK = ".lock"
QUARANTINE = "quarantine"
FORMAT_VERSION = 2
log = logging.getLogger("acache.affix")


@dataclass(frozen=True)
class Quarantined:
    """A part of a store on disk that could not be trusted: ``what`` it was, ``why``, and the folder it was
    moved to (None where the directory is read-only: it was skipped, not moved)."""

    what: str
    reason: str
    moved_to: Path | None
    not_moved: str = "the directory is read-only"  # why, where ``moved_to`` is None

    @property
    def where(self) -> str:
        return f"moved to {self.moved_to}" if self.moved_to else f"skipped (not moved: {self.not_moved})"


@dataclass
class LoadReport:
    """What :meth:`AffixCache.recover` did: how many entries it loaded and what it set aside."""

    loaded: int = 0
    quarantined: list[Quarantined] = field(default_factory=list)


def model_fingerprint(model: DiffusionLM) -> str:
    """Identifies the weights an affix cache was computed with: the config, and every parameter's name,
    shape and an evenly strided sample of at most 4,096 of its values (cheap even for an 8B model), as loaded (a
    checkpoint loaded at another precision has another; a store names the precision it was computed in, and a
    load checks that first, so that such a store is named for its precision)."""
    h = hashlib.sha256()
    cfg = {k: v for k, v in vars(model.config).items() if k != "raw"}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 4096)][:4096]
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()


class AffixDirectory:
    """The store at ``root`` of one model's affixes (``fingerprint`` names the weights, ``key_fn`` hashes
    token ids as the cache does). It reads and writes entries; which of them the cache keeps is the
    cache's business (:meth:`acache.affix.cache.AffixCache.save`, ``load`` and ``recover``)."""

    def __init__(self, root: Path, model: DiffusionLM, fingerprint: str,
                 key_fn: Callable[[Sequence[int]], str]) -> None:
        self.root = root
        self.model = model
        self.fingerprint = fingerprint
        self.key_fn = key_fn

    def save(self, saved: Sequence[AffixEntry], claim: Callable[[int], bool] = lambda n: True) -> Path:
        """Writes ``saved`` (least recently used first) to the directory: a content-named tensor file, then the
        manifest naming it, each through a temporary file, fsync and rename, under the directory's lock; a
        reader sees the old cache or the new one, never a mix, and a crash mid-save leaves the old one
        loadable. Entries already there that ``saved`` lacks (another process's of this model, or ones this
        one let go) are kept, most recent first, while ``claim(num_tokens)`` grants them room, and written
        before ``saved``: the store never outgrows the cache, and a load, which keeps the last entries when
        room runs short, keeps this process's. A store of another model or precision found there is moved
        aside into ``quarantine/``, never overwritten."""
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        for e in saved:
            mine = {f"{e.key}.k.{layer}": k for layer, k in enumerate(e.keys)}
            mine |= {f"{e.key}.v.{layer}": v for layer, v in enumerate(e.values)}
            mine |= {f"{e.key}.h.{layer}": h for layer, h in enumerate(e.hidden or [])}
            mine = {name: t.detach().contiguous().cpu() for name, t in mine.items()}
            tensors |= mine
            entries.append({"key": e.key, "name": e.name, "token_ids": list(e.token_ids),
                            "hidden": e.hidden is not None, "sha256": _checksum(mine)})
        with store_lock(root, exclusive=True):
            _remove_stale(root)
            held = {e["key"] for e in entries}
            theirs = []
            for item, their_tensors in reversed(self._saved_entries(root)):
                if item["key"] not in held and claim(len(item["token_ids"])):
                    theirs.append(item)
                    tensors |= their_tensors
            self._write_store(root, theirs[::-1] + entries, tensors)
        return root

    def _write_store(self, root: Path, entries: list[dict], tensors: dict[str, torch.Tensor]) -> None:
        """The tensor file, then the manifest naming it, then the old tensor files removed (under the lock)."""
        blob = save_bytes(tensors) if tensors else b""
        tensor_file = f"affixes-{hashlib.sha256(blob).hexdigest()[:16]}.safetensors"
        write_atomic(root / tensor_file, blob)
        manifest = {"format": FORMAT_VERSION, "model_fingerprint": self.fingerprint,
                    "family": self.model.family, "num_layers": len(self.model.layers),
                    "dtype": str(self.model.dtype).removeprefix("torch."), "tensors": tensor_file,
                    "entries": entries}
        write_atomic(root / MANIFEST, (json.dumps(manifest) + "\n").encode())
        for old in root.glob("affixes-*.safetensors"):
            if old.name != tensor_file:
                old.unlink(missing_ok=True)

    def _saved_entries(self, root: Path) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        """The entries already saved at ``root`` whose checksums hold, with their tensors (called under the lock).
        What the save cannot keep is set aside into ``quarantine/`` and logged, as :meth:`recover` sets it aside,
        never replaced unseen: a store of another model, precision or format (another version sharing the
        directory), a manifest that cannot be read, tensor files no manifest names, a damaged tensor file (a copy:
        the entries it still holds whole are kept) and entries whose checksums fail."""
        report = LoadReport()
        kept = []
        store = self._readable_store(root, report, writable=True)  # an OSError: the save fails, nothing is moved
        if store is not None:
            manifest, tensors, tensor_file, _ = store
            for i, item in enumerate(manifest["entries"]):
                theirs = _entry_tensors(item, tensors)
                if theirs and isinstance(item.get("token_ids"), list) and _checksum(theirs) == item.get("sha256"):
                    kept.append((item, theirs))
                    continue
                reason = "its tensors do not match their checksum (corrupt or altered)" if theirs else \
                    "malformed, or its tensors are missing (past a cut?)"
                self._set_entry_aside(root, report, i, item, theirs, f"{tensor_file}: {reason}", True)
        self._log_aside(report, "by a save")
        return kept

    def _readable_store(self, root: Path, report: LoadReport, writable: bool,
                        ) -> tuple[dict, dict[str, torch.Tensor], Path, list[Path]] | None:
        """The store at ``root`` as far as it can be trusted (its manifest, tensors and tensor file, and every
        tensor file there), or None where nothing of it can be (called under the lock). What cannot be trusted as a
        whole goes into ``report``, set aside: tensor files no manifest names, a store that cannot be read or is
        another model's, precision's or format's, and a copy of a damaged tensor file (the entries it holds whole
        are read). Files not read at all (an OSError: a permission, a failing disk) are no evidence of damage: it
        is raised, and nothing is moved."""
        tensor_files = sorted(root.glob("affixes-*.safetensors"))
        if not (root / MANIFEST).exists():
            if tensor_files:
                self._set_aside(root, report, "store", f"no {MANIFEST} names them (it was deleted?)", tensor_files,
                                writable)
            return None
        try:
            manifest, tensors, tensor_file, damage = self._read_store(root, salvage=True)
        except OSError:
            raise
        except Exception as exc:  # AffixStoreError, or a fault nobody foresaw: nothing here can be trusted
            self._set_aside(root, report, "store", _reason(exc), [root / MANIFEST, *tensor_files], writable)
            return None
        if damage is not None:
            self._set_aside(root, report, "tensors", f"{damage}; the entries it holds whole were kept", [], writable,
                            {tensor_file.name: tensor_file.read_bytes()})
        return manifest, tensors, tensor_file, tensor_files

    def _set_entry_aside(self, root: Path, report: LoadReport, index: int, item: object,
                         theirs: dict[str, torch.Tensor], reason: str, writable: bool) -> None:
        """One manifest entry, with the tensors it names, set aside under its key (or its index)."""
        key = item.get("key") if isinstance(item, dict) else None
        label = re.sub(r"[^0-9a-zA-Z]", "", str(key))[:12] if key else ""
        written = {"entry.json": json.dumps(item).encode()}
        if theirs:
            written["tensors.safetensors"] = save_bytes({n: t.contiguous() for n, t in theirs.items()})
        self._set_aside(root, report, f"entry-{label or index}", reason, [], writable, written)

    def _foreign(self, manifest: dict) -> str | None:
        """Why a readable manifest is not this model's at this precision (None: it is)."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        if manifest.get("dtype") != dtype:
            return f"computed in {manifest.get('dtype')}, while this model runs in {dtype}"
        if manifest.get("model_fingerprint") != self.fingerprint:
            return (f"made with another model ({manifest.get('family')}, {manifest.get('num_layers')} layers, "
                    f"fingerprint {str(manifest.get('model_fingerprint'))[:12]}) than this one "
                    f"({self.model.family}, {len(self.model.layers)} layers, fingerprint {self.fingerprint[:12]})")
        return None

    def load(self, claim: Callable[[int], bool] = lambda n: True, skip: Collection[str] = ()) -> list[AffixEntry]:
        """The entries saved in the directory, every one checked before the cache takes any room for it (its
        checksum, shapes, dtype and finiteness, and its first layer's K/V recomputed from its token ids,
        which no other model or affix reproduces); any refusal is one :class:`AffixStoreError` naming the
        file and the problem, and nothing is returned (the strict mode: :meth:`recover` loads around a
        fault). Of the sound ones, those ``skip`` names are left out, and the others are placed on the
        model's device from the most recently saved back while ``claim(num_tokens)`` grants them room (the
        rest stay on disk); they come back oldest first."""
        root = self.root
        try:
            if not (root / MANIFEST).is_file():
                raise AffixStoreError(f"no affix cache at {root}: {MANIFEST} is missing")
            with store_lock(root, exclusive=False):
                _remove_stale(root)
                manifest, tensors, tensor_file, _ = self._read_store(root, salvage=False)
        except OSError as exc:  # a directory or file this process may not read
            raise AffixStoreError(f"{root}: cannot read the affix cache there ({exc.strerror or exc})") from None
        checked = [self._checked_entry(item, tensors, tensor_file) for item in manifest["entries"]]
        return self._placed(checked, claim, skip)

    def recover(self, claim: Callable[[int], bool] = lambda n: True,
                skip: Collection[str] = ()) -> tuple[LoadReport, list[AffixEntry]]:
        """What can be trusted of the store (the report and the checked entries, placed as :meth:`load`
        places them), the rest moved aside, so that one fault never keeps a server down. An entry that fails
        any check of :meth:`load` is written into a folder of ``quarantine/`` (its manifest item, its
        tensors, the reason) and dropped from the store: it is simply absent, and the next request that uses
        the affix computes it again. A manifest that cannot be read, or that another model (or this one at
        another precision) wrote, or whose tensor file is gone or unreadable, is moved there with every
        tensor file (the server starts cold); tensor files no manifest names are moved there too, and those
        a sound manifest does not name (a save that died before its manifest, or before removing the old
        file) are deleted. Each is logged by name and reason. A directory this process cannot write, or
        whose lock file it cannot open, is only read: the faults are skipped and reported, not moved; files it
        may not read at all (a permission, a failing disk) are no evidence of damage: the store is reported
        unread and left as it is, and the server starts without it. Running
        out of memory while placing entries stops the loading, and what is on disk stays as it is. Never
        raises for what it finds on disk."""
        try:
            return self._recover(claim, skip)
        except OSError as exc:  # a directory or file this process may not read: it starts without them
            report = LoadReport()
            report.quarantined.append(Quarantined("the whole store", f"cannot be read ({exc})", None,
                                                  "it could not be read"))
            return report, []

    def _recover(self, claim: Callable[[int], bool], skip: Collection[str]) -> tuple[LoadReport, list[AffixEntry]]:
        root = self.root
        report = LoadReport()
        if not root.is_dir():
            return report, []
        checked: list[AffixEntry] = []
        with writing_if_allowed(root) as writable:
            if writable:
                _remove_stale(root)
            store = self._readable_store(root, report, writable)  # an OSError: recover starts cold, moves nothing
            if store is None:
                return report, checked
            manifest, tensors, tensor_file, tensor_files = store
            if writable:
                for orphan in tensor_files:
                    if orphan != tensor_file:
                        orphan.unlink(missing_ok=True)
            kept_items, kept_tensors = [], {}
            for i, item in enumerate(manifest["entries"]):
                theirs = _entry_tensors(item, tensors)
                try:
                    checked.append(self._checked_entry(item, tensors, tensor_file))
                except (torch.OutOfMemoryError, MemoryError) as exc:  # the device, not the entry: stop, keep the store
                    log.warning("affix cache %s: out of memory checking the entries (%s); %d checked, the rest "
                                "stay on disk", root, exc, len(checked))
                    return report, self._placed(checked, claim, skip)
                except Exception as exc:  # AffixStoreError, or a fault nobody foresaw: this entry is set aside
                    self._set_entry_aside(root, report, i, item, theirs, _reason(exc), writable)
                    continue
                kept_items.append(item)
                kept_tensors |= theirs
            if report.quarantined and writable:
                try:
                    self._write_store(root, kept_items, kept_tensors)
                except OSError as exc:  # the faults stay on disk, and are set aside again next time
                    log.warning("affix cache %s: could not rewrite the store without its faults: %s", root, exc)
        return report, self._placed(checked, claim, skip)

    def _placed(self, checked: list[AffixEntry], claim: Callable[[int], bool],
                skip: Collection[str]) -> list[AffixEntry]:
        """The checked entries ``claim`` grants room to, the most recently saved first, moved to the model's
        device; returned oldest first. Out of memory, the ones placed so far."""
        placed = []
        for entry in reversed(checked):
            if entry.key in skip or not claim(entry.length):
                continue
            try:
                placed.append(_to_device(entry, self.model.device, self.model.dtype))
            except (torch.OutOfMemoryError, MemoryError) as exc:
                log.warning("affix cache %s: out of memory placing affix %s (%s); %d loaded, the rest stay on "
                            "disk", self.root, entry.key[:12], exc, len(placed))
                break
        return placed[::-1]

    @staticmethod
    def _set_aside(root: Path, report: LoadReport, label: str, reason: str, files: Sequence[Path],
                   writable: bool, written: dict[str, bytes] | None = None) -> None:
        if label.startswith("entry-"):
            what = label.replace("-", " ", 1)
        elif written:
            what = "the damaged tensor file " + ", ".join(written)
        else:
            what = "the whole store (" + ", ".join(f.name for f in files) + ")"
        moved = None
        if writable:
            try:
                moved = quarantine(root, label, reason, files, written)
            except OSError as exc:  # a full disk, say: skipped as in a read-only directory, the server still starts
                reason = f"{reason} (could not be moved aside: {exc})"
        report.quarantined.append(Quarantined(what, reason, moved))

    def log(self, report: LoadReport) -> None:
        """Each part set aside, by name and reason, and the count loaded (once the cache has admitted them)."""
        root = self.root
        self._log_aside(report)
        if report.quarantined:
            log.warning("affix cache %s: loaded %d entries; %d set aside, recomputed when a request next uses "
                        "them", root, report.loaded, len(report.quarantined))

    def _log_aside(self, report: LoadReport, by: str = "") -> None:
        for q in report.quarantined:
            log.warning("affix cache %s: %s set aside%s, %s: %s", self.root, q.what, f" {by}" if by else "", q.where,
                        q.reason)

    def _read_store(self, root: Path, salvage: bool) -> tuple[dict, dict[str, torch.Tensor], Path, str | None]:
        """The manifest, the tensors (on the CPU) and the tensor file of the store at ``root`` (called under its
        lock), and what is wrong with that file where ``salvage`` read what it still holds whole (None:
        nothing); an :class:`AffixStoreError` where the store as a whole cannot be trusted."""
        manifest_file = root / MANIFEST
        try:
            manifest = json.loads(manifest_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AffixStoreError(f"{manifest_file}: not a manifest ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise AffixStoreError(f"{manifest_file}: format {found!r}, this version reads {FORMAT_VERSION}")
        foreign = self._foreign(manifest)
        if foreign is not None:
            raise AffixStoreError(f"{manifest_file} was {foreign}; refusing to load it")
        tensor_file = root / str(manifest.get("tensors", ""))
        if not isinstance(manifest.get("entries"), list) or tensor_file.parent != root or not tensor_file.is_file():
            raise AffixStoreError(f"{manifest_file}: names no readable tensor file ({tensor_file.name!r})")
        try:
            tensors = load_file(tensor_file, device="cpu") if tensor_file.stat().st_size else {}
            return manifest, tensors, tensor_file, None
        except OSError:  # not read at all: no evidence of damage
            raise
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            damage = f"{tensor_file}: not a safetensors file ({exc})"
        if salvage:
            try:
                return manifest, _salvage(tensor_file), tensor_file, damage
            except OSError:
                raise
            except Exception:  # its header is gone too
                pass
        raise AffixStoreError(damage)

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
        entry = AffixEntry(key, ids, [mine[f"{key}.k.{i}"] for i in range(cfg.num_layers)],
                           [mine[f"{key}.v.{i}"] for i in range(cfg.num_layers)],
                           [mine[f"{key}.h.{i}"] for i in range(cfg.num_layers + 1)] if has_hidden else None, name)
        k0, v0 = first_layer_kv(self.model, ids)
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        if not (torch.allclose(entry.keys[0].float(), k0.float().cpu(), atol=tol, rtol=tol)
                and torch.allclose(entry.values[0].float(), v0.float().cpu(), atol=tol, rtol=tol)):
            raise AffixStoreError(f"{label}: its K/V were not computed from its tokens by this model")
        return entry


class AffixStoreError(ValueError):
    """An affix cache on disk that cannot be trusted: the message names the file and the problem."""


def _entry_tensors(item: object, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a manifest entry names by its key (none for an entry with no key)."""
    key = item.get("key") if isinstance(item, dict) else None
    return {n: t for n, t in tensors.items() if isinstance(key, str) and n.startswith(f"{key}.")}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def quarantine(root: Path, label: str, reason: str, files: Sequence[Path] = (),
               written: dict[str, bytes] | None = None) -> Path:
    """Moves ``files`` of the store at ``root`` (and writes ``written``) into a new folder of
    ``root/quarantine`` beside a ``reason.txt``: what could not be trusted is kept for a person to look at,
    never deleted, and never read again. Called under the store's lock."""
    (root / QUARANTINE).mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = Path(tempfile.mkdtemp(prefix=f"{stamp}-{label}-", dir=root / QUARANTINE))
    (folder / "reason.txt").write_text(reason + "\n")
    for name, data in (written or {}).items():
        (folder / name).write_bytes(data)
    for f in files:  # the manifest first: a crash halfway leaves tensor files no manifest names, set aside next time
        if f.exists():
            os.replace(f, folder / f.name)
    return folder


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def _salvage(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a damaged safetensors file that still lie whole in it, found through its header (a file
    cut short keeps those before the cut; their checksums then say whether they are intact). Raises where
    the header itself cannot be read."""
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or 8 + size > len(data):
        raise ValueError("the header is cut")
    header = json.loads(data[8:8 + size])
    body = memoryview(data)[8 + size:]
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            if not 0 <= begin <= end <= len(body):
                continue  # past the cut
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            raw = bytearray(body[begin:end])
            flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            tensors[name] = flat.reshape(meta["shape"])
        except (KeyError, TypeError, ValueError, RuntimeError):
            continue
    return tensors


def _to_device(entry: AffixEntry, device: torch.device, dtype: torch.dtype) -> AffixEntry:
    move = [t.to(device, dtype) for t in entry.keys], [t.to(device, dtype) for t in entry.values]
    hidden = [t.to(device, dtype) for t in entry.hidden] if entry.hidden is not None else None
    return AffixEntry(entry.key, entry.token_ids, *move, hidden, entry.name)


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, AffixStoreError) else f"unreadable ({type(exc).__name__}: {exc})"


def write_atomic(path: Path, data: bytes) -> None:
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
def store_lock(root: Path, exclusive: bool) -> Iterator[None]:
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


@contextmanager
def writing_if_allowed(root: Path) -> Iterator[bool]:
    """Holds the directory's lock to write it where this process may (yields True), else to read it (False):
    a directory it cannot write, or whose lock file it cannot open (a directory there, another user's file),
    is read without changing anything, with a warning for the lock file."""
    writable = os.access(root, os.W_OK)
    with ExitStack() as held:
        try:
            held.enter_context(store_lock(root, exclusive=writable))
        except AffixStoreError as exc:
            log.warning("%s; reading it without changing anything", exc)
            writable = False
            held.enter_context(store_lock(root, exclusive=False))
        yield writable
