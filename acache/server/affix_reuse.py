"""Which spans of a request become shared affixes, with no change on the client's side.

Candidates in a chat: the messages before the last user message (system prompt and few-shot turns,
merged into one span) and every user message of at least ``min_document_tokens`` tokens (a pasted
document). A candidate becomes an affix the second time its exact tokens are seen: a span seen once is
not worth a shared copy, one seen again is; one the engine already holds (a restart with
``--affix-cache-dir``) is one at once. Affixes registered with ``POST /v1/affixes`` are affixes from
their first use; with ``--affix-cache-dir`` the registry is saved beside the affix cache
(``registry.json``) and loaded at start, so that an id stays valid across a restart. Whether an automatic
affix may then answer a request is the reuse gate's call (:mod:`acache.server.reuse_gate`): becoming an
affix makes a span a candidate for reuse, not reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from acache.affix.chat import chat_segments
from acache.affix.persistence import Quarantined, quarantine, store_lock, write_atomic, writing_if_allowed
from acache.affix.prompt import GEN, Affix, AffixPrompt, Segment, affix_key, resolve_segments
from acache.inputs import InputProcessor

AFFIX_MARKER = "<|affix|>"  # where an infix completion places its registered affix
REGISTRY = "registry.json"
REGISTRY_FORMAT = 1
log = logging.getLogger("acache.server")


def registration_id(token_ids: list[int] | tuple[int, ...], messages: list[dict] | None) -> str:
    """The id of a registration: the hash of what was registered, so that the same content gets the same id
    in every process and a stored registration whose content was altered no longer matches its id."""
    described = json.dumps({"tokens": list(token_ids), "messages": messages}, sort_keys=True)
    return "affix-" + hashlib.sha256(described.encode()).hexdigest()[:24]


class AffixRegistry:
    """Explicitly registered affixes, by id. An id is the hash of what was registered (the tokens, and the
    messages for a chat affix), so registering the same content again returns the same id and no client
    can overwrite another's entry; the registry keeps at most ``max_bytes``, least recently used first out."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the affix registry needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._by_id: OrderedDict[str, tuple[tuple[int, ...], list[dict] | None, str | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, token_ids: list[int], messages: list[dict] | None, name: str | None) -> str:
        if not token_ids:
            raise ValueError("an affix must not be empty")
        affix_id = registration_id(token_ids, messages)
        size = _size(token_ids, messages, name)
        if size > self.max_bytes:
            raise ValueError(f"the affix takes {size} bytes, more than the registry's {self.max_bytes}")
        with self._lock:
            if affix_id in self._by_id:
                self._by_id.move_to_end(affix_id)
                return affix_id
            self._by_id[affix_id] = (tuple(token_ids), messages, name, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (*_, dropped) = self._by_id.popitem(last=False)
                self.nbytes -= dropped
        return affix_id

    def get(self, affix_id: str) -> tuple[tuple[int, ...], list[dict] | None, str | None]:
        with self._lock:
            if affix_id not in self._by_id:
                raise ValueError(f"unknown affix id {affix_id!r}; register one with POST /v1/affixes")
            self._by_id.move_to_end(affix_id)
            ids, messages, name, _ = self._by_id[affix_id]
            return ids, messages, name

    def __len__(self) -> int:
        return len(self._by_id)

    def snapshot(self) -> list[dict]:
        """Every registration, least recently used first, as ``registry.json`` holds them."""
        with self._lock:
            return [{"id": i, "tokens": list(ids), "messages": messages, "name": name}
                    for i, (ids, messages, name, _) in self._by_id.items()]

    def save(self, root: Path, fingerprint: str) -> int:
        """Writes the registrations to ``root/registry.json`` (atomically, under the store's lock), with the
        sound ones already there that this registry does not hold while the byte budget allows (another
        server's on a shared directory, or ones this one let go); returns how many it wrote. A registry file it
        cannot keep (another model's, unreadable) and malformed registrations are moved into ``quarantine/`` and
        logged, as :meth:`load` moves them, not overwritten unseen."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        mine = self.snapshot()
        held = {item["id"] for item in mine}
        room = self.max_bytes - sum(_size(i["tokens"], i["messages"], i["name"]) for i in mine)
        with store_lock(root, exclusive=True):
            theirs = []
            try:
                found = _read_registry(root, fingerprint) if (root / REGISTRY).exists() else []
            except OSError:  # not read at all (a permission, the disk): no evidence of damage, so the save fails
                raise
            except Exception as exc:  # another model's, or unreadable: kept aside and logged, never overwritten unseen
                moved = quarantine(root, "registry", f"{root / REGISTRY}: {exc}; set aside by a save",
                                   [root / REGISTRY])
                log.warning("affix registry %s: %s; set aside by a save, moved to %s", root, exc, moved)
                found = []
            for n, item in reversed(list(enumerate(found))):
                fault = _fault(item, None)
                if fault is not None:
                    label = _label(item, n)
                    moved = quarantine(root, f"registration-{label}", f"{fault}; set aside by a save", [],
                                       {"registration.json": json.dumps(item).encode()})
                    log.warning("affix registry %s: registration %s set aside by a save, moved to %s: %s", root,
                                label, moved, fault)
                    continue
                if item["id"] in held:
                    continue
                size = _size(item["tokens"], item["messages"], item["name"])
                if size <= room:
                    theirs.append(item)
                    room -= size
            items = theirs[::-1] + mine
            body = {"format": REGISTRY_FORMAT, "model_fingerprint": fingerprint, "affixes": items}
            write_atomic(root / REGISTRY, (json.dumps(body) + "\n").encode())
        return len(items)

    def load(self, root: Path, fingerprint: str, vocab_size: int) -> list[Quarantined]:
        """Registers what ``root/registry.json`` holds (the ids stay those the clients were given) and moves
        what cannot be trusted into ``root/quarantine`` with the reason, never keeping the server down: a
        registration whose content no longer hashes to its id or that is malformed alone, a file that is not
        a registry or belongs to another model whole. Each is logged; returns what was set aside."""
        root = Path(root)
        if not (root / REGISTRY).is_file():
            return []
        aside: list[Quarantined] = []
        with writing_if_allowed(root) as writable:
            def set_aside(what: str, label: str, reason: str, files: list[Path], written: dict | None) -> None:
                moved = None
                if writable:
                    try:
                        moved = quarantine(root, label, reason, files, written)
                    except OSError as exc:  # skipped as in a read-only directory: the server still starts
                        reason = f"{reason} (could not be moved aside: {exc})"
                aside.append(Quarantined(what, reason, moved))

            try:
                items = _read_registry(root, fingerprint)
            except OSError as exc:  # not read at all: no evidence of damage, left where it is
                aside.append(Quarantined(f"the registry ({REGISTRY})", f"cannot be read ({exc})", None,
                                         "it could not be read"))
                items = []
            except Exception as exc:
                set_aside(f"the registry ({REGISTRY})", "registry", f"{root / REGISTRY}: {exc}", [root / REGISTRY],
                          None)
                items = []
            good = []
            for n, item in enumerate(items):
                fault = _fault(item, vocab_size)
                if fault is None:
                    good.append(item)
                    continue
                label = _label(item, n)
                set_aside(f"registration {label}", f"registration-{label}", fault, [],
                          {"registration.json": json.dumps(item).encode()})
            if writable and aside and items:
                body = {"format": REGISTRY_FORMAT, "model_fingerprint": fingerprint, "affixes": good}
                try:
                    write_atomic(root / REGISTRY, (json.dumps(body) + "\n").encode())
                except OSError as exc:  # the faults stay on disk, and are set aside again next time
                    log.warning("affix registry %s: could not rewrite it without its faults: %s", root, exc)
        for item in good:
            try:
                self.register(item["tokens"], item["messages"], item["name"])
            except ValueError as exc:  # larger than this server's --affix-registry-bytes: it stays on disk
                log.warning("affix registry %s: %s not loaded: %s", root, item["id"], exc)
        for q in aside:
            log.warning("affix registry %s: %s set aside, %s: %s", root, q.what, q.where, q.reason)
        if aside:
            log.warning("affix registry %s: kept %d registrations; %d set aside (their ids are unknown now: "
                        "register them again)", root, len(good), len(aside))
        return aside


def _label(item: object, index: int) -> str:
    """How a registration set aside is named: its id, made safe for a folder name, or its place in the file."""
    return re.sub(r"[^0-9a-zA-Z-]", "", str(item.get("id") if isinstance(item, dict) else ""))[:40] or str(index)


def _size(token_ids: list[int] | tuple[int, ...], messages: list[dict] | None, name: str | None) -> int:
    described = json.dumps({"tokens": list(token_ids), "messages": messages}, sort_keys=True)
    return 8 * len(token_ids) + len(described) + len(name or "")


def _read_registry(root: Path, fingerprint: str) -> list:
    """The registrations ``root/registry.json`` lists; raises where the file as a whole cannot be trusted."""
    try:
        body = json.loads((root / REGISTRY).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a registry ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != REGISTRY_FORMAT or not isinstance(body.get("affixes"), list):
        found = body.get("format") if isinstance(body, dict) else None
        raise ValueError(f"not a registry of format {REGISTRY_FORMAT} (format {found!r})")
    if body.get("model_fingerprint") != fingerprint:
        raise ForeignRegistry(f"made with another model (fingerprint {str(body.get('model_fingerprint'))[:12]}, this "
                         f"one {fingerprint[:12]})")
    return body["affixes"]


class ForeignRegistry(ValueError):
    """A sound registry of another model."""


def _fault(item: object, vocab_size: int | None) -> str | None:
    """What is wrong with one stored registration (None: nothing); ``vocab_size`` None skips the token range."""
    if not isinstance(item, dict) or set(item) != {"id", "tokens", "messages", "name"}:
        return "malformed (not an object of id, tokens, messages and name)"
    tokens, messages, name = item["tokens"], item["messages"], item["name"]
    if not isinstance(tokens, list) or not tokens or any(type(t) is not int for t in tokens):
        return "its tokens are not a non-empty list of token ids"
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in tokens):
        return f"it holds a token id outside the vocabulary of {vocab_size}"
    if messages is not None and (not isinstance(messages, list) or not all(
            isinstance(m, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())
            for m in messages)):
        return "its messages are not a list of messages"
    if name is not None and not isinstance(name, str):
        return "its name is not a string"
    if item["id"] != registration_id(tokens, messages):
        return f"its content does not hash to its id {str(item['id'])[:40]!r} (corrupt or altered)"
    return None


class AutoAffixer:
    """``held(ids)``: the engine already holds this affix. ``listeners`` hear of every candidate seen, by
    content hash and length (a cluster's router sends the next request with that span to the replica that
    saw it, so that the second sighting, which makes it an affix, happens there)."""

    def __init__(self, inputs: InputProcessor, held: Callable[[tuple[int, ...]], bool] = lambda ids: False,
                 min_document_tokens: int = 128, max_tracked: int = 65536) -> None:
        self.inputs = inputs
        self.held = held
        self.min_document_tokens = min_document_tokens
        self.max_tracked = max_tracked
        self.listeners: list[Callable[[str, int], None]] = []
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _seen_before(self, ids: list[int]) -> bool:
        key = affix_key(ids)
        with self._lock:
            count = self._seen.pop(key, 0) + 1
            self._seen[key] = count
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        for listener in self.listeners:
            listener(key, len(ids))
        return count >= 2

    def _encode(self, text: str) -> list[int]:
        return self.inputs.encode_text(text)

    def chat_candidates(self, messages: list[dict], reuse: bool, registered: int = 0) -> list[Segment]:
        """The chat through the model's template with every candidate span as an :class:`Affix` of token ids:
        the messages before the last user message, every long user message, and the first ``registered``
        messages (a registered affix, an affix of its own)."""
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages))
        candidates = set(range(last_user)) | set(range(registered))
        for i, m in enumerate(messages):
            if m["role"] == "user" and len(self._encode(m["content"])) >= self.min_document_tokens:
                candidates.add(i)
        chosen = sorted(candidates) if reuse else []
        return chat_segments(messages, self.inputs.render_chat, chosen,
                             split_before=[registered] if registered else [], encode=self._encode)

    def chat_prompt(self, messages: list[dict], reuse: bool, registered: int = 0,
                    check: Callable[[AffixPrompt], None] | None = None) -> AffixPrompt:
        """The chat's candidates that were seen before (or registered, or held) kept as affixes. ``check`` is
        called first with the prompt that reuses nothing automatic (the same tokens): a request it refuses is no
        sighting of its spans."""
        segments = self.chat_candidates(messages, reuse, registered)
        if check is not None:
            check(resolve_segments([seg if not isinstance(seg, Affix) or (registered and n == 0) else
                                    list(seg.token_ids) for n, seg in enumerate(segments)], self._encode))
        kept = []
        for n, seg in enumerate(segments):
            if isinstance(seg, Affix):
                ids = list(seg.token_ids)
                forced = (registered and n == 0) or self.held(tuple(ids))
                if not (forced or self._seen_before(ids)):
                    seg = ids
            kept.append(seg)
        return resolve_segments(kept, self._encode)

    def completion_prompt(self, prompt: str | list[int], affix: tuple[int, ...] | None, name: str | None,
                          layout: str) -> AffixPrompt:
        """The affix before the prompt (prefix), after the generation region (suffix), or in place of the
        prompt's one ``AFFIX_MARKER`` (infix)."""
        if layout == "infix":
            if affix is None:
                raise ValueError("affix_layout 'infix' places a registered affix: pass 'affix' too")
            if not isinstance(prompt, str) or prompt.count(AFFIX_MARKER) != 1:
                raise ValueError(f"affix_layout 'infix' needs a text prompt holding {AFFIX_MARKER!r} exactly once, "
                                 "where the affix goes")
        if affix is None:  # a whole prompt, as LLM.generate encodes it (a text's special tokens, a BOS, included)
            return self.inputs.encode_prompt(prompt)
        body = self._encode(prompt) if isinstance(prompt, str) and layout != "infix" else prompt
        segment = Affix(token_ids=affix, name=name)
        if layout == "infix":
            before, after = prompt.split(AFFIX_MARKER)
            segments = [before, segment, after, GEN]
        else:
            segments = [segment, list(body), GEN] if layout == "prefix" else [list(body), GEN, segment]
        return resolve_segments(segments, self._encode)
